"""Long lockstep run: a kvspec policy's model against vLLM 0.33.0 with the patch implementing it.

    .vllm-pr47235-venv/bin/python scripts/lockstep_vllm_patched.py [--target vllm+pr47235] [--traces 500]

Runs ``--traces`` random traces (300 operations each, generated on the policy's model),
spread round-robin over the eager configurations of ``tests/test_vllm_patched.py``, with the
model alongside: the same outcome and the same snapshot (policy state included) after every
operation. Prints the count in agreement; exit 0 when all agree, 1 at the first divergence
(its trace written under --out, replayable with ``kvspec replay TRACE --against model``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_vllm_patched import CONFIGS, lockstep, policy_trace

from kvspec.drivers.trace import Trace

POLICY = {"vllm+pr47235": "signal-rescan", "vllm+repair": "repair"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="vllm+pr47235", choices=sorted(POLICY))
    ap.add_argument("--traces", type=int, default=500)
    ap.add_argument("--seed", type=int, default=10_000, help="first trace seed")
    ap.add_argument("--out", default="out/vllm-divergences")
    args = ap.parse_args()
    names = list(CONFIGS)
    start = time.perf_counter()
    ops = 0
    for k in range(args.traces):
        name = names[k % len(names)]
        config = replace(CONFIGS[name], policy=POLICY[args.target])
        seed = args.seed + k
        trace = policy_trace(config, seed)
        d = lockstep(config, trace, args.target)
        if d is not None:
            path = Path(args.out) / f"{args.target.replace('+', '-')}-divergence-{name}-seed{seed}.jsonl"
            Trace(config, trace[: d[0] + 1], target=args.target, seed=seed,
                  note=f"model vs {args.target} diverge at operation {d[0]}: {d[1]}").write(path)
            print(f"DIVERGENCE after {k} traces in agreement: {name} seed {seed} operation {d[0]}: {d[1]}\n"
                  f"trace: {path}")
            return 1
        ops += len(trace)
    secs = time.perf_counter() - start
    print(f"[{args.target} lockstep] {args.traces} traces, {ops} operations in agreement with the "
          f"{POLICY[args.target]} model over {len(names)} configurations ({secs:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
