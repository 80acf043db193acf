"""``kvspec fuzz``: budgeted random traces against a target; every finding saved as a trace.

The oracle is what the policy claims unless ``--oracle`` says otherwise (``all``, or
ids). A finding is a *violation* (an invariant of the oracle broke) or a *crash* (the
target raised something other than a ``KVSpecError``); operations the target rejects
cleanly are counted, not reported. The unshrunk trace is written as soon as the finding
is made, the shrunk one when shrinking ends; file names carry target, policy, oracle
and a content hash, so no run overwrites another's finding. Next to each trace is its finding
page (the same name, ``.html``: ``kvspec.report.html``).

Exit codes: 0 nothing found, 1 a finding, 2 bad arguments, 3 internal error, 130
interrupted (statistics so far printed, findings kept).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvspec.adapters.targets import get_factory
from kvspec.contract.config import POLICIES
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, EXIT_INTERRUPTED, ConfigError
from kvspec.drivers.harness import FuzzResult, check_writable, finding_name, fuzz, save_trace
from kvspec.drivers.trace import Trace
from kvspec.oracle import oracles
from kvspec.report.html import page_for_trace

NAME = "fuzz"
HELP = "fuzz a target with random engine traces; write each finding as a shrunk trace"
EPILOG = "exit codes: 0 nothing found, 1 finding, 2 bad input or usage, 3 internal error, 130 interrupted"


def budget_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text[:40]!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--target", default="model", help="model, impl, vllm or bug:<name> (default: model)")
    p.add_argument("--policy", default=None, choices=POLICIES,
                   help="policy (default: repair; baseline for vllm; a bug's own policy for bug:<name>)")
    p.add_argument("--budget", type=budget_seconds, default=60.0, help="seconds to search (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--oracle", default=None, metavar="claims|all|ID,ID",
                   help="invariants that judge the run (default: claims, what the policy guarantees; "
                        "for bug:<name>, the catalogue's oracle of that variant)")
    p.add_argument("--out", default="fuzz-out", help="directory for finding traces (default fuzz-out)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    oracles.check_spec(args.oracle)
    factory = get_factory(args.target)
    bug = args.target[4:] if args.target.startswith("bug:") else None
    policy = _default_policy(args.target, bug)
    if bug is not None and args.policy is not None and args.policy != policy:
        raise ConfigError(f"bug:{bug} runs under policy {policy!r}, not {args.policy!r}")
    policy = args.policy or policy
    check_writable(args.out)
    saved: dict[str, Path] = {}

    def keep(trace: Trace, stage: str) -> None:
        name = finding_name(args.target, policy, _oracle_label(args.oracle), trace, stage)
        saved[stage] = save_trace(trace, args.out, name)
        page = page_for_trace(trace, saved[stage], factory)
        if not args.json:
            print(f"\n{stage} finding written: {saved[stage]} (page: {page})", file=sys.stderr)

    def progress(traces: int, ops: int, secs: float) -> None:
        if not args.json and traces % 20 == 0:
            print(f"\r{traces} traces, {ops} ops, {secs:.0f}/{args.budget:.0f}s", end="", file=sys.stderr)

    res = fuzz(factory, policy, args.budget, args.seed, args.oracle, args.target, progress=progress, bug=bug,
               on_finding=keep)
    report(args, res, policy, saved)
    if res.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FINDING if res.found else EXIT_CLEAN


def _default_policy(target: str, bug: str | None) -> str:
    if bug is not None:
        from kvspec.model.bugs import BUGS

        return BUGS[bug].policy
    return "baseline" if target == "vllm" else "repair"


def _oracle_label(spec: str | None) -> str:
    return "claims" if spec in (None, "claims") else str(spec)


def report(args: argparse.Namespace, res: FuzzResult, policy: str, saved: dict[str, Path]) -> None:
    out: dict[str, Any] = {
        "target": args.target, "policy": policy, "oracle": res.oracle, "found": res.found, "kind": res.kind,
        "interrupted": res.interrupted, "seconds": round(res.seconds, 3), "traces": res.traces, "ops": res.ops,
        "ops_per_second": round(res.ops_per_second, 1), "rejected": res.rejected, "rare_paths": res.rare,
        "finding": res.outcome.to_json() if res.found and res.outcome else None,
        "trace": str(saved["shrunk"]) if "shrunk" in saved else None,
        "unshrunk_trace": str(saved["unshrunk"]) if "unshrunk" in saved else None,
        "trace_ops": len(res.trace.ops) if res.trace else None,
    }
    if args.json:
        print(json.dumps(out))
        return
    print(file=sys.stderr)
    state = " (interrupted)" if res.interrupted else ""
    print(f"{res.traces} traces, {res.ops} operations in {res.seconds:.1f}s ({res.ops_per_second:.0f} ops/s), "
          f"oracle: {res.oracle}{state}")
    if res.rejected:
        print(f"  operations rejected cleanly by the target: {res.rejected}")
    for name, n in res.rare.items():
        print(f"  {name}: {n}")
    if res.found and res.outcome is not None:
        print(f"FOUND {res.outcome.kind}: {res.outcome.describe()}")
        if res.trace is not None:
            print(f"shrunk trace ({len(res.trace.ops)} operations): {saved.get('shrunk')}")
        if "unshrunk" in saved:
            print(f"unshrunk trace: {saved['unshrunk']}")
    else:
        print("nothing found")
