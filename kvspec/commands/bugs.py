"""``kvspec bugs``: fuzz every known-bug variant with the invariant catalogue as the only oracle.

A bug counts as *found* only when a named invariant of its oracle breaks (kind
``violation``); a crash of the variant is reported (kind ``crash``) but is not a find,
since a crash says nothing about the rule the variant breaks. No reference model runs. With
``--out``, each shrunk trace is saved with its finding page beside it (the same name, ``.html``).

Exit codes: 0 every bug found, 1 some bug not found, 2 bad arguments, 3 internal error,
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvspec.commands.fuzz import add_ray_argument, add_workers_argument, budget_seconds
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, EXIT_INTERRUPTED, ConfigError, exit_codes
from kvspec.drivers.campaign import JobsInterrupted, check_ray, check_workers, map_jobs
from kvspec.drivers.harness import VIOLATION, check_writable, finding_name, fuzz, save_trace
from kvspec.drivers.trace import Trace
from kvspec.model.bugs import BUGS, make_bug_target
from kvspec.report.html import page_for_trace

NAME = "bugs"
HELP = "fuzz each known-bug variant (invariants only, no reference model) and report what is found"
EPILOG = exit_codes("every bug found", "some bug not found")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--budget", type=budget_seconds, default=20.0, help="seconds per bug (default 20)")
    p.add_argument("--seed", type=int, default=1, help="seed of every hunt (default 1)")
    p.add_argument("--only", default=None, help="comma-separated bug names (default: every known bug)")
    p.add_argument("--out", default=None, help="directory for the shrunk traces (default: none written)")
    add_workers_argument(p, "processes hunting different bugs at once; the rows do not depend on it")
    add_ray_argument(p)
    p.add_argument("--json", action="store_true", help="print a JSON list")


@dataclass
class Hunt:
    """One bug's hunt: its row, the shrunk finding, and whether Ctrl-C cut it short."""

    row: dict[str, Any]
    trace: Trace | None
    interrupted: bool


def hunt_one(budget: float, seed: int, quiet: bool, name: str) -> Hunt:
    """Fuzz bug ``name`` for ``budget`` seconds (a campaign job: picklable, prints only progress)."""
    bug = BUGS[name]
    if not quiet:
        print(f"  hunting {name} ...", file=sys.stderr)
    res = fuzz(partial(make_bug_target, name), bug.policy, budget, seed, target_name=f"bug:{name}", bug=name)
    kind = res.kind
    o = res.outcome
    row = {"bug": name, "source": bug.source, "found": kind == VIOLATION, "kind": kind,
           "oracle": res.oracle, "seconds": round(res.seconds, 3),
           "invariant": o.violation.id if o is not None and o.violation is not None else None,
           "exception": o.exception if o is not None else None,
           "op_index": o.op_index if o is not None and kind else None,
           "trace_ops": len(res.trace.ops) if res.trace else None}
    return Hunt(row, res.trace, res.interrupted)


def _save(name: str, trace: Trace, out: str) -> None:
    """The shrunk trace (``<bug>.jsonl`` for a violation) and its finding page, under ``out``."""
    policy = BUGS[name].policy
    path = save_trace(trace, out, f"{name}.jsonl" if trace.finding and trace.finding["kind"] == VIOLATION
                      else finding_name(f"bug:{name}", policy, "claims", trace))
    page_for_trace(trace, path, partial(make_bug_target, name))


def hunt(budget: float, seed: int, names: list[str] | None = None, out: str | None = None,
         quiet: bool = False, workers: int = 1, ray: str | None = None) -> tuple[list[dict[str, Any]], bool]:
    """One row per bug; the flag is True when Ctrl-C stopped the hunt (rows so far returned). One
    worker hunts the bugs in turn and stops at Ctrl-C; more (or Ray) hunt them at once
    (``kvspec.drivers.campaign.map_jobs``). Traces are written here, by the driver."""
    names = names or list(BUGS)
    job = partial(hunt_one, budget, seed, quiet)
    cut = False  # Ctrl-C stopped a hunt outside its search (which keeps its row), or the workers
    hunts: list[Hunt] = []
    if workers == 1 and ray is None:
        for name in names:
            try:
                hunts.append(map_jobs(job, [name], 1)[0])
            except JobsInterrupted:
                cut = True
            if cut or hunts[-1].interrupted:
                break
    else:
        try:
            hunts = map_jobs(job, names, workers, ray)
        except JobsInterrupted as stop:  # Ctrl-C reached this process: the workers stopped with it
            hunts, cut = stop.done(), True
    rows: list[dict[str, Any]] = []
    for h in hunts:
        if out is not None and h.trace is not None:
            _save(h.row["bug"], h.trace, out)
        rows.append(h.row)
    return rows, cut or any(h.interrupted for h in hunts)


def run(args: argparse.Namespace) -> int:
    names = args.only.split(",") if args.only is not None else None
    if names is not None and not any(names):
        raise ConfigError("--only needs at least one bug name (comma-separated); leave it out for every bug")
    for n in names or []:
        if n not in BUGS:
            raise ConfigError(f"unknown bug {n[:60]!r}; known: {', '.join(BUGS)}")
    if args.out is not None:
        check_writable(args.out)
    workers, ray = check_workers(args.workers, args.ray), check_ray(args.ray)
    rows, interrupted = hunt(args.budget, args.seed, names, args.out, args.json or workers > 1 or ray is not None,
                             workers, ray)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{'bug':26} {'found':6} {'kind':10} {'seconds':>8} {'invariant':10} {'trace ops':>9}")
        for r in rows:
            print(f"{r['bug']:26} {'yes' if r['found'] else 'NO':6} {r['kind'] or '-':10} {r['seconds']:8.2f} "
                  f"{r['invariant'] or r['exception'] or '-':10} "
                  f"{r['trace_ops'] if r['trace_ops'] is not None else '-':>9}")
        if interrupted:
            print(f"interrupted after {len(rows)} of {len(names or BUGS)} bugs")
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_CLEAN if all(r["found"] for r in rows) else EXIT_FINDING
