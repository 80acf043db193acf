"""``kvspec snapshot TRACE --out FILE``: replay a trace on a target and write its snapshot.

The file is what ``kvspec check-snapshot`` reads (``kvspec/contract/schema/snapshot.schema.json``,
``format_version`` 1): the target's pools and scheduler state (``OffloadTarget.snapshot()``) and
the engine's view, after the trace's last operation or after operation ``--at N`` (0-based,
inclusive). The target is ``--target`` or the one the trace header names: ``model``, ``impl``,
``bug:<name>``, or a real vLLM manager through kvspec's adapter (``vllm``, ``vllm+pr47235``,
``vllm+repair``, ``vllm@VERSION``; in the venv that holds it). Operations the target rejects
cleanly change nothing and are counted; a crash of the target writes nothing (exit 1).
No invariant is checked here: ``kvspec check-snapshot FILE`` does that. A trace of the offloading
manager (header ``"manager": "offloading"``) is replayed with that manager's driver and written
in its format (``offloading-snapshot.schema.json``: the target's state and what the driver
observed); its targets are ``offloading``, ``offloading-impl``, ``vllm-offloading[@VERSION]``
and ``bug:<name>``.
"""

from __future__ import annotations

import argparse

from kvspec.adapters.targets import get_factory
from kvspec.commands._snapshot_out import report_crash, write_snapshot
from kvspec.commands.replay import header_target
from kvspec.contract.errors import ConfigError, KVSpecError, exit_codes
from kvspec.drivers import trace as trace_io
from kvspec.drivers.engine import Engine

NAME = "snapshot"
HELP = "replay a trace on a target and write its snapshot (the file check-snapshot reads)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = exit_codes("snapshot written", "the target crashed (nothing written)")
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--out", required=True, metavar="FILE", help="the snapshot file to write")
    p.add_argument("--target", default=None,
                   help="model, impl, bug:<name> or a real vLLM target; for an offloading-manager trace "
                        "offloading, offloading-impl, vllm-offloading[@VERSION] or bug:<name> "
                        "(default: the trace header's)")
    p.add_argument("--at", type=int, default=None, metavar="N",
                   help="the snapshot after operation N (0-based; default: after the last)")


def run(args: argparse.Namespace) -> int:
    if args.at is not None and args.at < 0:
        raise ConfigError(f"--at must be an operation index >= 0, got {args.at}")
    from kvspec.commands import _offloading as offloading

    if offloading.trace_is_offloading(args.trace):
        return offloading.snapshot(args)
    with trace_io.open_trace(args.trace) as tr:
        name = args.target or header_target(tr.target)
        engine = Engine(get_factory(name)(tr.config))
        applied = rejected = 0
        for i, op in enumerate(tr.ops()):
            if args.at is not None and i > args.at:
                break
            try:
                engine.apply(op)
            except KVSpecError:
                rejected += 1
            except Exception as exc:  # the target's crash: there is no state to show
                return report_crash(name, i, exc)
            applied += 1
        if args.at is not None and args.at >= applied:
            raise ConfigError(f"--at {args.at}: the trace has {applied} operation(s)")
    return write_snapshot(engine.snapshot(), args.out, name, applied, rejected)

