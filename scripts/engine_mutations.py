"""Break the engine's async-scheduling rules one at a time and count the lockstep traces that catch it.

    .vllm-venv/bin/python scripts/engine_mutations.py [--traces N] [--seed S] [--only NAME]

Each mutation replaces one piece of ``kvspec/drivers/engine.py``'s source (the text must occur
exactly once) in a fresh process, then runs ``N`` random traces per configuration family of the
``engine-async`` lockstep (the engine against vLLM 0.33.0's real ``AsyncScheduler``;
``kvspec.drivers.divergence``) and prints how many diverge. A mutation no trace catches is a
rule the lockstep does not check. Needs the vLLM venv.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "kvspec" / "drivers" / "engine.py"

MUTATIONS: dict[str, tuple[str, str]] = {
    "no output placeholders": ("r.num_output_placeholders += 1 + drafts.scheduled.get(rid, 0)", "pass"),
    "no skip at max_tokens": ("if need <= 0 or self._reaches_max_tokens(r):", "if need <= 0:"),
    "no deferred frees": ("self.defer_block_free = self.async_scheduling", "self.defer_block_free = False"),
    "preempt a request a batch in flight writes": ("if not self._blocks_can_be_freed(victim):", "if False:"),
    "window frees on computed tokens": ("skipped = self._skipped(g, r.num_computed_tokens - r.num_in_flight_tokens)",
                                        "skipped = self._skipped(g, r.num_computed_tokens)"),
    "admit with stale output in flight": ("            if r.num_stale_output_tokens > 0:\n                continue",
                                          "            if False:\n                continue"),
    "stale output dropped": ("                r.num_stale_output_tokens -= n\n",
                             "                r.num_stale_output_tokens -= n\n                continue\n"),
    "no stop at max_tokens": ("if self.async_scheduling and len(r.output) >= max(1, r.max_tokens):", "if False:"),
    "admission cap for one batch": ("in_flight_tokens = self.batch_queue_size *", "in_flight_tokens = 1 *"),
    "no caching of confirmed blocks": ("            if confirming:\n", "            if False:\n"),
}

CHILD = """
import sys, types
source = open({engine!r}).read()
old, new = {old!r}, {new!r}
assert source.count(old) == 1, "mutation text must occur once"
module = types.ModuleType("kvspec.drivers.engine")
module.__file__ = {engine!r}
sys.modules["kvspec.drivers.engine"] = module
exec(compile(source.replace(old, new), {engine!r}, "exec"), module.__dict__)
from kvspec.drivers.divergence import FAMILIES, measure
caught = total = 0
for family in FAMILIES:
    tally = measure("engine-async", family, {seed}, {traces}, 120)
    caught += tally.traces - tally.agreeing
    total += tally.traces
print(caught, total)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=8, help="traces per family (default 8)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the random traces (default 7)")
    parser.add_argument("--only", help="run only the mutation with this name")
    args = parser.parse_args(argv)
    survivors = 0
    for name, (old, new) in MUTATIONS.items():
        if args.only and name != args.only:
            continue
        code = CHILD.format(engine=str(ENGINE), old=old, new=new, seed=args.seed, traces=args.traces)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{name}: the mutated engine did not run: {done.stderr.strip().splitlines()[-1:]}")
            survivors += 1
            continue
        caught, total = map(int, done.stdout.split()[-2:])
        survivors += caught == 0
        print(f"{name}: {caught} of {total} traces diverge", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
