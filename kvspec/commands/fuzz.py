"""``kvspec fuzz``: budgeted random traces against a target, the invariant catalogue as oracle."""

from __future__ import annotations

import argparse
import json
import sys

from kvspec.harness import fuzz, write_trace
from kvspec.interfaces import POLICIES
from kvspec.model.invariants import CATALOGUE
from kvspec.targets import get_factory

NAME = "fuzz"
HELP = "fuzz a target with random engine traces; write each finding as a shrunk trace"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="model", help="model, impl, vllm or bug:<name> (default: model)")
    p.add_argument("--policy", default=None, choices=POLICIES, help="policy (default: repair; baseline for vllm)")
    p.add_argument("--budget", type=float, default=60.0, help="seconds to search (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--oracle", default=None,
                   help="comma-separated invariant ids (default: every invariant in the catalogue)")
    p.add_argument("--out", default="fuzz-out", help="directory for finding traces (default fuzz-out)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    policy = args.policy or ("baseline" if args.target in ("vllm",) else "repair")
    oracle = tuple(args.oracle.split(",")) if args.oracle else tuple(CATALOGUE)
    factory = get_factory(args.target)

    def progress(traces: int, ops: int, secs: float) -> None:
        if not args.json and traces % 20 == 0:
            print(f"\r{traces} traces, {ops} ops, {secs:.0f}/{args.budget:.0f}s", end="", file=sys.stderr)

    res = fuzz(factory, policy, args.budget, args.seed, oracle, args.target, progress=progress)
    path = None
    if res.found and res.trace is not None:
        path = str(write_trace(res.trace, args.out, f"{args.target.replace(':', '-')}-{policy}-seed{args.seed}"))
    if args.json:
        print(json.dumps({"target": args.target, "policy": policy, "found": res.found, "seconds": round(res.seconds, 3),
                          "traces": res.traces, "ops": res.ops, "rare_paths": res.rare,
                          "finding": res.outcome.describe() if res.found and res.outcome else None,
                          "trace": path, "trace_ops": len(res.trace.ops) if res.trace else None}))
    else:
        print(file=sys.stderr)
        print(f"{res.traces} traces, {res.ops} operations in {res.seconds:.1f}s")
        for name, n in res.rare.items():
            print(f"  {name}: {n}")
        if res.found and res.outcome is not None and res.trace is not None:
            print(f"FOUND {res.outcome.describe()}")
            print(f"shrunk trace ({len(res.trace.ops)} operations): {path}")
    return 1 if res.found else 0
