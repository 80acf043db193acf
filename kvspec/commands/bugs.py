"""``kvspec bugs``: fuzz every known-bug variant with the invariant catalogue as the only oracle.

A bug counts as *found* only when a named invariant of its oracle breaks (kind
``violation``); a crash of the variant is reported (kind ``crash``) but is not a find,
since a crash says nothing about the rule the variant breaks. No reference model runs. With
``--out``, each shrunk trace is saved with its finding page beside it (the same name, ``.html``).

Time to find: with ``--seeds K`` every bug is hunted with seeds ``seed .. seed+K-1`` and the row
gives the median over them of the seconds of searching and of the operations applied until the
first finding (``kvspec.drivers.findtime``; a seed that found nothing within ``--budget`` counts
as longer than any that did). The first seed's finding is shrunk (the row's invariant, trace
length and ``--out`` trace); the others are only timed. A bug is found when every seed found it.
``--json`` rows keep every field of one seed's row and add ``seeds``, ``found_seeds``,
``median_seconds``, ``median_ops`` and ``per_seed``.

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
from kvspec.drivers.findtime import Sample, describe, time_to_find
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
    p.add_argument("--seeds", type=seed_count, default=1,
                   help="hunts per bug, seeds SEED..SEED+K-1; the table gives the medians (default 1)")
    p.add_argument("--only", default=None, help="comma-separated bug names (default: every known bug)")
    p.add_argument("--out", default=None, help="directory for the shrunk traces (default: none written)")
    add_workers_argument(p, "processes hunting different bugs at once; the rows do not depend on it")
    add_ray_argument(p)
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--manager", choices=("simple", "offloading"), default="simple",
                   help="simple: SimpleCPUOffload's variants (default); offloading: the OffloadingConnector "
                        "manager's (kvspec.model.offloading.bugs)")


MAX_SEEDS = 1000


def seed_count(text: str) -> int:
    """An argparse type: a number of seeds in 1..MAX_SEEDS."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of seeds, got {text[:40]!r}") from None
    if not 1 <= value <= MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_SEEDS}, got {text[:40]!r}")
    return value


@dataclass
class Hunt:
    """One bug's hunt: its row, the shrunk finding, and whether Ctrl-C cut it short."""

    row: dict[str, Any]
    trace: Trace | None
    interrupted: bool


def hunt_one(budget: float, quiet: bool, job: tuple[str, int, bool]) -> Hunt:
    """Fuzz bug ``name`` with ``seed`` for ``budget`` seconds, shrinking the finding when asked (a
    campaign job: picklable, prints only progress). The row's ``search_seconds`` and ``search_ops``
    run until the first finding (or the end of the budget)."""
    name, seed, shrink = job
    bug = BUGS[name]
    if not quiet:
        print(f"  hunting {name} (seed {seed}) ...", file=sys.stderr)
    res = fuzz(partial(make_bug_target, name), bug.policy, budget, seed, target_name=f"bug:{name}", bug=name,
               shrink_finding=shrink)
    kind = res.kind
    o = res.outcome
    row = {"bug": name, "source": bug.source, "found": kind == VIOLATION, "kind": kind,
           "oracle": res.oracle, "seconds": round(res.seconds, 3), "seed": seed,
           "search_seconds": round(res.search_seconds, 3), "search_ops": res.ops + res.rejected,
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
         quiet: bool = False, workers: int = 1, ray: str | None = None,
         seeds: int = 1) -> tuple[list[dict[str, Any]], bool]:
    """One row per bug; the flag is True when Ctrl-C stopped the hunt (rows so far returned). Each
    bug is hunted with ``seeds`` seeds from ``seed`` on; the row is the first seed's, with the
    medians over all of them (``kvspec.drivers.findtime``). One worker hunts in turn and stops at
    Ctrl-C; more (or Ray) hunt at once (``kvspec.drivers.campaign.map_jobs``). Traces are written
    here, by the driver."""
    names = names or list(BUGS)
    run_job = partial(hunt_one, budget, quiet)
    jobs = [(name, seed + k, k == 0) for name in names for k in range(seeds)]
    cut = False  # Ctrl-C stopped a hunt outside its search (which keeps its row), or the workers
    hunts: list[Hunt] = []
    if workers == 1 and ray is None:
        for job in jobs:
            try:
                hunts.append(map_jobs(run_job, [job], 1)[0])
            except JobsInterrupted:
                cut = True
            if cut or hunts[-1].interrupted:
                break
    else:
        try:
            hunts = map_jobs(run_job, jobs, workers, ray)
        except JobsInterrupted as stop:  # Ctrl-C reached this process: the workers stopped with it
            hunts, cut = stop.done(), True
    rows: list[dict[str, Any]] = []
    for i in range(0, len(hunts), seeds):
        mine = hunts[i:i + seeds]
        first = mine[0]
        if out is not None and first.trace is not None:
            _save(first.row["bug"], first.trace, out)
        if any(h.interrupted for h in mine) or len(mine) < seeds:
            return rows, True
        t = time_to_find([Sample(h.row["seed"], h.row["found"], h.row["search_seconds"], h.row["search_ops"])
                          for h in mine])
        rows.append({**first.row, **t.to_json(), "found": all(h.row["found"] for h in mine)})
    return rows, cut


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        check_writable(args.out)
    names: list[str] | None
    if args.manager == "offloading":
        from kvspec.commands import _offloading

        rows, names = _offloading.hunt_bugs(args)
        interrupted = False
    else:
        names = args.only.split(",") if args.only is not None else None
        if names is not None and not any(names):
            raise ConfigError("--only needs at least one bug name (comma-separated); leave it out for every bug")
        for n in names or []:
            if n not in BUGS:
                from kvspec.model.offloading.bugs import OFFLOADING_BUGS

                hint = " (an offloading manager variant: add --manager offloading)" if n in OFFLOADING_BUGS else ""
                raise ConfigError(f"unknown bug {n[:60]!r}{hint}; known: {', '.join(BUGS)}")
        workers, ray = check_workers(args.workers, args.ray), check_ray(args.ray)
        rows, interrupted = hunt(args.budget, args.seed, names, args.out, args.json or workers > 1 or ray is not None,
                                 workers, ray, args.seeds)
    if args.json:
        print(json.dumps(rows))
    else:
        w = max([26, *(len(r["bug"]) for r in rows)])
        print(f"{'bug':{w}} {'found':6} {'kind':10} {'invariant':10} {'trace ops':>9} {'seeds':>6} "
              f"{'median s':>9} {'median ops':>10}")
        for r in rows:
            secs, ops = describe(time_to_find([Sample(**p) for p in r["per_seed"]]), args.budget)
            print(f"{r['bug']:{w}} {'yes' if r['found'] else 'NO':6} {r['kind'] or '-':10} "
                  f"{r['invariant'] or r['exception'] or '-':10} "
                  f"{r['trace_ops'] if r['trace_ops'] is not None else '-':>9} "
                  f"{r['found_seeds']}/{r['seeds']:<4} {secs:>9} {ops:>10}")
        if interrupted:
            print(f"interrupted after {len(rows)} of {len(names or BUGS)} bugs")
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_CLEAN if all(r["found"] for r in rows) else EXIT_FINDING
