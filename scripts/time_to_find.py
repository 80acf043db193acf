"""Time to find every known bug: the table the README quotes.

    python scripts/time_to_find.py [--seeds 5] [--budget 20] [--only a,b] [--against REV] [--json OUT]

Each known-bug variant (``kvspec bugs``' catalogue) is hunted once per seed (seeds 1..K, as
``kvspec bugs --seeds K``), one hunt at a time on one core: the fuzzer with the bug's oracle, until
its first finding or ``--budget`` seconds. A hunt reports the seconds of searching and the
operations applied until the finding (shrinking is not timed); the table gives the medians over
the seeds (``kvspec.drivers.findtime``: a hunt that found nothing counts as longer than any that
did, and a median that falls on one is printed ``>budget``).

With ``--against REV`` (a git revision of this repository) REV's tree is exported (``git
archive``) and hunted the same way, the two trees alternating seed by seed, each seed's hunts in a
fresh process of its own tree, so that both meet the same load on a shared machine; the table
gives both and the ratio of the medians (REV / this tree: above 1, this tree finds sooner).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure(seed: int, budget: float, only: list[str]) -> None:
    """In a fresh process: every bug of ``only`` (all: empty) hunted with ``seed``; one JSON line each."""
    import kvspec
    from kvspec.drivers import harness
    from kvspec.model.bugs import BUGS, make_bug_target

    try:
        from kvspec.drivers.campaign import single_threaded
        single_threaded()
    except ImportError:
        pass
    extra: dict[str, Any] = {}
    if "shrink_finding" in inspect.signature(harness.fuzz).parameters:
        extra["shrink_finding"] = False  # not timed either way; skipping it saves the wait
    for name in only or list(BUGS):
        if name not in BUGS:
            print(json.dumps({"bug": name, "missing": True, "kvspec": kvspec.__file__}), flush=True)
            continue
        bug = BUGS[name]
        res = harness.fuzz(partial(make_bug_target, name), bug.policy, budget, seed, target_name=f"bug:{name}",
                           bug=name, **extra)
        found = res.kind == harness.VIOLATION
        print(json.dumps({"bug": name, "seed": seed, "found": found, "seconds": res.search_seconds,
                          "ops": res.ops + res.rejected, "kvspec": kvspec.__file__}), flush=True)


def run_in(tree: Path | None, seed: int, budget: float, only: list[str]) -> list[dict[str, Any]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", str(seed), "--budget", str(budget)]
    if only:
        cmd += ["--only", ",".join(only)]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)  # found before the editable install's finder, which comes last
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"hunting in {tree or 'this tree'} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        if not Path(r["kvspec"]).resolve().is_relative_to((tree or ROOT).resolve()):
            raise SystemExit(f"the hunt imported kvspec from {r['kvspec']}, not from {tree or ROOT}")
    return [r for r in rows if not r.get("missing")]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from kvspec.drivers.findtime import Sample, time_to_find

    by_bug: dict[str, list[Any]] = {}
    for r in rows:
        by_bug.setdefault(r["bug"], []).append(Sample(r["seed"], r["found"], r["seconds"], r["ops"]))
    return {bug: time_to_find(samples) for bug, samples in by_bug.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5, help="hunts per bug, seeds 1..K (default 5)")
    p.add_argument("--budget", type=float, default=20.0, help="seconds per hunt (default 20)")
    p.add_argument("--only", default="", help="comma-separated bug names (default: every known bug)")
    p.add_argument("--against", metavar="REV", help="also hunt with REV's tree, alternating seed by seed")
    p.add_argument("--json", metavar="OUT", help="write every hunt's row and the medians as JSON")
    p.add_argument("--measure", type=int, metavar="SEED", help=argparse.SUPPRESS)
    a = p.parse_args()
    only = [n for n in a.only.split(",") if n]
    if a.measure is not None:
        measure(a.measure, a.budget, only)
        return 0
    from kvspec.drivers.findtime import describe

    start = time.monotonic()
    here: list[dict[str, Any]] = []
    there: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvspec-ttf-") as tmp:
        tree = None
        if a.against:
            sys.path.insert(0, str(ROOT / "scripts"))
            from bench_fuzz import export_tree

            tree = export_tree(a.against, Path(tmp))
        for seed in range(1, a.seeds + 1):
            if tree is not None:
                there += run_in(tree, seed, a.budget, only)
            here += run_in(None, seed, a.budget, only)
            print(f"seed {seed} of {a.seeds} done ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    mine, theirs = summarize(here), summarize(there)
    head = f"{'bug':26} {'found':>6} {'median s':>9} {'median ops':>11}"
    if a.against:
        head += f"   {a.against[:10]:>10}: {'found':>6} {'median s':>9} {'median ops':>11} {'ratio s':>8}"
    print(head)
    for bug, t in mine.items():
        secs, ops = describe(t, a.budget)
        line = f"{bug:26} {t.found_seeds:>3}/{t.seeds:<2} {secs:>9} {ops:>11}"
        if a.against and bug in theirs:
            o = theirs[bug]
            osecs, oops = describe(o, a.budget)
            ratio = (f"{o.median_seconds / t.median_seconds:.1f}x" if o.median_seconds and t.median_seconds
                     else "-")
            line += f"   {'':>10}  {o.found_seeds:>3}/{o.seeds:<2} {osecs:>9} {oops:>11} {ratio:>8}"
        print(line)
    slowest = max((t.median_seconds if t.median_seconds is not None else float("inf")) for t in mine.values())
    print(f"slowest median: {slowest:.2f} s ({a.seeds} seeds, budget {a.budget:g} s per hunt, one hunt at a time)")
    if a.json:
        Path(a.json).write_text(json.dumps({"here": here, "against": there, "rev": a.against,
                                            "medians": {b: t.to_json() for b, t in mine.items()},
                                            "medians_against": {b: t.to_json() for b, t in theirs.items()}},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
