"""``kvspec replay TRACE``: run a trace on a target; report its first finding.

The trace is read as a stream (any size, bounded memory; a bad line is reported when it is
reached). The target is ``--target`` or the one the header names; the oracle is
``--oracle``, else the one the header recorded, else what the target's policy claims (for
``bug:<name>``, the catalogue's oracle of that variant). The report names both, the
operation index, and the finding's kind: a *violation* (invariant id and blocks), a *crash*
(exception type), a *divergence* from ``--against``, or an *expectation* of the trace not
met (an operation recorded as accepted is now rejected, or the reverse).

Exit codes: 0 no finding, 1 a finding, 2 bad trace or arguments, 3 internal error.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvspec.adapters.targets import get_factory
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, ConfigError, TraceError, echo
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import Outcome, run_ops
from kvspec.oracle import claims as oracles

NAME = "replay"
HELP = "replay a trace file on a target; report the first finding (op index, invariant or crash) or divergence"
EPILOG = "exit codes: 0 no finding, 1 finding, 2 bad input or usage, 3 internal error"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--target", default=None, help="target to run (default: the trace header's, 'harness' = model)")
    p.add_argument("--against", default=None, help="also run this reference target and compare snapshots")
    p.add_argument("--oracle", default=None, metavar="claims|all|ID,ID",
                   help="invariants that judge the run (default: the header's recorded oracle, else claims)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    oracles.check_spec(args.oracle)
    with trace_io.open_trace(args.trace) as tr:
        name = args.target or header_target(tr.target)
        factory = get_factory(name)
        reference = get_factory(args.against) if args.against else None
        bug = name[4:] if name.startswith("bug:") else None
        if args.oracle is None and tr.oracle is not None:
            ids = oracles.parse_ids(",".join(tr.oracle), "the trace header's oracle")
            orc = oracles.Oracle(f"recorded ({','.join(ids)})", ids)
        else:
            orc = oracles.resolve(args.oracle, tr.config, bug)
        out = run_ops(tr.config, tr.ops(), factory, orc.ids, reference)
        recorded = tr.finding
        if out.input_error:
            raise TraceError(tr.line, f"operation {out.op_index}: {out.expectation}")
    same = _matches(recorded, out)
    if args.json:
        print(json.dumps({"target": name, "against": args.against, "oracle": orc.to_json(),
                          "ops_run": out.ops_run, "failed": out.failed, **out.to_json(),
                          "recorded_finding": recorded, "reproduces_recorded": same}))
    else:
        print(f"{name} (oracle: {orc.name}): {out.describe()}")
        if recorded is not None:
            print(f"recorded finding: {recorded['kind']} "
                  f"{recorded.get('invariant') or recorded.get('exception') or ''} at operation "
                  f"{recorded['op_index']}: {'reproduced' if same else 'NOT reproduced'}")
    return EXIT_FINDING if out.failed else EXIT_CLEAN


def header_target(target: str) -> str:
    """The target a header names ("harness", the state machine's traces, means the model)."""
    name = "model" if target == "harness" else target
    try:
        get_factory(name)
    except ConfigError as exc:
        raise ConfigError(f"the trace header names target {echo(target)}, which cannot run here ({exc}); "
                          "pass --target") from None
    return name


def _matches(recorded: dict[str, Any] | None, out: Outcome) -> bool | None:
    if recorded is None:
        return None
    found = out.finding()
    return found is not None and all(found[k] == recorded[k] for k in ("kind", "op_index", "invariant", "exception"))
