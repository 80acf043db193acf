"""``kvspec replay TRACE``: run a trace on a target; report the first violation or divergence."""

from __future__ import annotations

import argparse
import json

from kvspec import trace as trace_io
from kvspec.harness import replay
from kvspec.model.invariants import CATALOGUE
from kvspec.targets import get_factory

NAME = "replay"
HELP = "replay a trace file on a target; report the first violation (op index, invariant, blocks) or divergence"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--target", default=None, help="target to run (default: the trace header's, else model)")
    p.add_argument("--against", default=None, help="also run this reference target and compare snapshots")
    p.add_argument("--oracle", default=None, help="comma-separated invariant ids (default: all)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    tr = trace_io.read(args.trace)
    name = args.target or (tr.target if tr.target not in ("harness",) else "model")
    if name.startswith("bug:") or name in ("model", "impl", "vllm"):
        factory = get_factory(name)
    else:
        factory = get_factory("model")
    reference = get_factory(args.against) if args.against else None
    oracle = tuple(args.oracle.split(",")) if args.oracle else tuple(CATALOGUE)
    out = replay(tr, factory, oracle, reference)
    if args.json:
        print(json.dumps({"target": name, "ops": len(tr.ops), "ops_run": out.ops_run, "failed": out.failed,
                          "op_index": out.op_index,
                          "violation": out.violation.to_json() if out.violation else None,
                          "divergence": out.divergence, "error": out.error}))
    else:
        print(f"{name}: {out.describe()}")
    return 1 if out.failed else 0
