"""``kvspec bugs``: fuzz every known-bug variant with the invariant catalogue as the only oracle."""

from __future__ import annotations

import argparse
import json
import sys

from kvspec.harness import fuzz, write_trace
from kvspec.model.bugs import BUGS, make_bug_target

NAME = "bugs"
HELP = "fuzz each known-bug variant (invariants only, no reference model) and report what is found"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=float, default=20.0, help="seconds per bug (default 20)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", default=None, help="comma-separated bug names")
    p.add_argument("--out", default=None, help="directory for the shrunk traces")
    p.add_argument("--json", action="store_true", help="print a JSON list")


def hunt(budget: float, seed: int, names: list[str] | None = None, out: str | None = None,
         quiet: bool = False) -> list[dict]:
    rows = []
    for name in names or list(BUGS):
        bug = BUGS[name]
        if not quiet:
            print(f"  hunting {name} ...", file=sys.stderr)
        res = fuzz(lambda cfg, n=name: make_bug_target(n, cfg), bug.policy, budget, seed, bug.oracle,
                   target_name=f"bug:{name}")
        path = None
        if res.found and res.trace is not None and out:
            path = str(write_trace(res.trace, out, name))
        rows.append({"bug": name, "source": bug.source, "found": res.found, "seconds": round(res.seconds, 3),
                     "invariant": (res.outcome.violation.id if res.outcome and res.outcome.violation
                                   else ("crash" if res.found else None)),
                     "trace_ops": len(res.trace.ops) if res.trace else None, "trace": path})
    return rows


def run(args: argparse.Namespace) -> int:
    names = args.only.split(",") if args.only else None
    for n in names or []:
        if n not in BUGS:
            print(f"kvspec bugs: unknown bug {n!r}; known: {', '.join(BUGS)}", file=sys.stderr)
            return 2
    rows = hunt(args.budget, args.seed, names, args.out, quiet=args.json)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'bug':26} {'found':6} {'seconds':>8} {'invariant':10} {'trace ops':>9}")
        for r in rows:
            print(f"{r['bug']:26} {'yes' if r['found'] else 'NO':6} {r['seconds']:8.2f} {r['invariant'] or '-':10} "
                  f"{r['trace_ops'] if r['trace_ops'] is not None else '-':>9}")
    return 0 if all(r["found"] for r in rows) else 1
