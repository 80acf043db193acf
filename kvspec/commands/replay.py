"""``kvspec replay TRACE``: run a trace on a target; report its first finding.

The trace is read as a stream (any size, bounded memory; a bad line is reported when it is
reached). The target is ``--target`` or the one the header names (``--raw``: its raw form,
``raw:vllm`` or ``raw:vllm@VERSION``, where calls the model refuses reach vLLM); the oracle is
``--oracle``, else the one the header recorded, else what the target's policy claims (for
``bug:<name>``, the catalogue's oracle of that variant). The report names both, the
operation index, and the finding's kind: a *violation* (invariant id and blocks), a *crash*
(exception type), a *divergence* from ``--against``, or an *expectation* of the trace not
met (an operation recorded as accepted is now rejected, or the reverse).

``--explain`` narrates the replay operation by operation in the engine's terms (``kvspec.report``):
what each operation did, every request's cursor and holes after it, and at the finding the
invariant's rule and the blocks, keys and positions involved (with ``--json``, the narration is
the object's ``narration``). ``--html FILE`` writes the same narration as a self-contained page
with a timeline picture.

Exit codes: 0 no finding, 1 a finding, 2 bad trace or arguments, 3 internal error, 130
interrupted.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvspec.adapters import claims as claimed
from kvspec.adapters.targets import TargetFactory, get_factory, raw_target
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, ConfigError, TraceError, echo, exit_codes
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import Outcome, run_ops
from kvspec.oracle import oracles
from kvspec.report.html import write_page
from kvspec.report.narrate import Narration, Narrator

NAME = "replay"
HELP = "replay a trace file on a target; report the first finding (op index, invariant or crash) or divergence"
EPILOG = exit_codes("no finding", "finding")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--target", default=None, help="target to run (default: the trace header's, 'harness' = model)")
    p.add_argument("--against", default=None, help="also run this reference target and compare snapshots")
    p.add_argument("--oracle", default=None, metavar="claims|all|ID,ID",
                   help="invariants that judge the run (default: the header's recorded oracle, else claims)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--raw", action="store_true",
                   help="run the raw form of the (real vLLM) target: calls the model would refuse reach vLLM")
    p.add_argument("--refine", action="store_true",
                   help="also check refinement (R1) after every accepted operation: each request's step is one "
                        "the proofs' transitions (kvspec.specs.transitions) admit (on by itself for a trace whose "
                        "recorded finding is R1)")
    p.add_argument("--explain", action="store_true",
                   help="narrate every operation: what it did, cursors and holes after it, the finding's rule")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="write the narration and a timeline picture as one self-contained HTML page")


def run(args: argparse.Namespace) -> int:
    from kvspec.commands import _offloading as offloading

    if offloading.trace_is_offloading(args.trace):
        return offloading.replay(args)
    from kvspec.specs.refinement import REFINEMENT_ID  # z3, loaded only when replaying

    oracles.check_spec(args.oracle)
    with trace_io.open_trace(args.trace) as tr:
        name = args.target or header_target(tr.target)
        name = raw_target(name) if args.raw else name
        factory = get_factory(name)
        reference = get_factory(args.against) if args.against else None
        bug = name[4:] if name.startswith("bug:") else None
        if args.oracle is None and tr.oracle is not None:
            ids = oracles.parse_ids(",".join(tr.oracle), "the trace header's oracle")
            orc = oracles.Oracle(f"recorded ({','.join(ids)})", ids)
        else:
            orc = claimed.resolve(args.oracle, tr.config, bug)
        recorded = tr.finding
        refine = args.refine or (recorded is not None and recorded.get("invariant") == REFINEMENT_ID)
        if args.explain or args.html is not None:
            narration = _narrate(args, tr, name, orc, factory, reference)
            out = narration.outcome
        else:
            narration, out = None, run_ops(tr.config, tr.ops(), factory, orc.ids, reference, refine=refine)
        if out.input_error:
            raise TraceError(tr.line, f"operation {out.op_index}: {out.expectation}")
        if recorded is not None and recorded["op_index"] is not None and recorded["op_index"] >= tr.ops_read:
            tr.finish()  # the run stopped before the recorded index: is it in the trace at all?
    same = _matches(recorded, out)
    if args.html is not None and narration is not None:
        try:
            write_page(narration, args.html)
        except OSError as exc:
            raise ConfigError(f"--html {echo(args.html)}: cannot write the page: {exc.strerror or exc}") from None
    if args.json:
        explained = {"narration": narration.to_json()} if args.explain and narration is not None else {}
        print(json.dumps({"target": name, "against": args.against, "oracle": orc.to_json(),
                          "ops_run": out.ops_run, "failed": out.failed, **out.to_json(),
                          "recorded_finding": recorded, "reproduces_recorded": same, **explained}))
    else:
        print(f"{name} (oracle: {orc.name}): {out.describe()}")
        if recorded is not None:
            print(f"recorded finding: {recorded['kind']} "
                  f"{recorded.get('invariant') or recorded.get('exception') or ''} at operation "
                  f"{recorded['op_index']}: {'reproduced' if same else 'NOT reproduced'}")
    return EXIT_FINDING if out.failed else EXIT_CLEAN


def _narrate(args: argparse.Namespace, tr: trace_io.TraceStream, name: str, orc: oracles.Oracle,
             factory: TargetFactory, reference: TargetFactory | None) -> Narration:
    """Run the trace through the narrator; print each story as it is told under ``--explain``
    (text), keep them all only when a page or JSON needs them (so text streams any length)."""
    narrator = Narrator(tr.config, factory, orc.ids, reference)
    keep = args.html is not None or args.json
    stories = []
    for story in narrator.stories(tr.ops()):
        if args.explain and not args.json:
            print(story.text())
        if keep:
            stories.append(story)
    assert narrator.outcome is not None  # set when the stories are exhausted
    return Narration(args.trace, name, orc.name, tr.config.to_json(), tr.finding, tuple(stories), narrator.outcome)


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
