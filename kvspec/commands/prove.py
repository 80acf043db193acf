"""``kvspec prove``: discharge the Z3 proof obligations and show a table.

Exit 0 only when every proof and bounded check holds, every expected counterexample is
found (and each completeness counterexample becomes an engine trace that reaches its
pre-state and reproduces its holes, each convergence counterexample one that reaches its
pre-state and leaves its pending set, ``kvspec.drivers.synthesis``), every vacuity check
passes, every existence check holds, every witness is reached and every mutation is caught
(the second manager's, ``kvspec.specs.offloading_obligations``); 1 otherwise; 130 on Ctrl-C
(Z3's own handler included: ``encoding.check_sat``), after the table of the obligations done
so far; 2 for bad usage (``-k`` empty or matching no obligation, with or without ``--list``; a
``--traces`` directory that cannot be made). ``--list --json`` prints the list as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvspec.contract.errors import EXIT_INTERRUPTED, ConfigError, echo

if TYPE_CHECKING:
    from kvspec.specs.obligations import Result

NAME = "prove"
HELP = "run the Z3 proof obligations (proofs, bounded cross-checks, counterexamples, vacuity checks)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list of results on stdout")
    parser.add_argument("--quick", action="store_true",
                        help="one KV group only (drop the two-group duplicates)")
    parser.add_argument("--profile", default="default", choices=("default", "nightly"),
                        help="default: the obligations of every run (under a minute); nightly: also the "
                             "bounded checks at larger sizes (N <= 12, two groups N <= 3)")
    parser.add_argument("-k", dest="select", default=None, metavar="TEXT",
                        help="only obligations whose name contains TEXT or whose policy is TEXT "
                             "(no match: exit 2)")
    parser.add_argument("--traces", default=None, metavar="DIR",
                        help="write the engine trace synthesised from each completeness or convergence "
                             "counterexample to DIR (one .jsonl per obligation and policy, as kvspec replay reads it)")
    parser.add_argument("--list", action="store_true",
                        help="list the obligations (as a JSON list with --json) and exit")


def run(args: argparse.Namespace) -> int:
    from kvspec.drivers.synthesis import realise
    from kvspec.specs.obligations import Interrupted, Obligation, catalogue, run_all

    obs = catalogue(quick=args.quick, profile=args.profile)
    if args.select is not None:
        if not args.select.strip():
            raise ConfigError("-k needs a non-empty TEXT (a part of an obligation name, or a policy)")
        obs = [ob for ob in obs if args.select in ob.name or args.select == ob.policy]
        if not obs:
            raise ConfigError(f"-k {echo(args.select)} matches no obligation"
                              f"{' (of the --quick catalogue)' if args.quick else ''}; "
                              "see kvspec prove --list")
    if args.list:
        if args.json:
            print(json.dumps([{"name": ob.name, "policy": ob.policy, "kind": ob.kind, "statement": ob.statement}
                              for ob in obs], indent=2))
            return 0
        for ob in obs:
            print(f"{ob.name}\t{ob.policy}\t{ob.kind}\t{ob.statement}")
        return 0
    traces = None if args.traces is None else Path(args.traces)
    if traces is not None:
        try:
            traces.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--traces {echo(args.traces)}: cannot make the directory: "
                              f"{exc.strerror or exc}") from None
    total = len(obs)
    done = 0
    t0 = time.perf_counter()

    def progress(ob: Obligation, res: Result | None) -> None:
        nonlocal done
        if res is None:
            print(f"[{done + 1}/{total}] {ob.name} ({ob.policy}) ...", end="", file=sys.stderr, flush=True)
            return
        done += 1
        realise(res, traces)
        mark = "ok" if res.ok else "FAILED"
        print(f" {res.result} ({res.seconds:.2f}s) {mark}", file=sys.stderr, flush=True)

    try:
        results = run_all(obs, progress)
    except Interrupted as stop:
        print(file=sys.stderr)  # ends the progress line of the obligation that was stopped
        _show(args, stop.results, time.perf_counter() - t0, total)
        return EXIT_INTERRUPTED
    return _show(args, results, time.perf_counter() - t0, total)


def _show(args: argparse.Namespace, results: list[Result], elapsed: float, total: int) -> int:
    """The table (or JSON list) of ``results``; the exit code when they are all of the run (1 if
    any is not as expected)."""
    from kvspec.specs.obligations import PASS

    failed = [r for r in results if not r.ok]
    cut = len(results) < total
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        w = max((len(r.name) for r in results), default=len("obligation"))
        print(f"{'obligation':<{w}}  {'policy':<13}  {'kind':<14}  {'result':<9}  {'expected':<9}  seconds")
        for r in results:
            row = f"{r.name:<{w}}  {r.policy:<13}  {r.kind:<14}  {r.result:<9}  {PASS[r.kind]:<9}"
            row += f"  {r.seconds:7.2f}"
            note = f"   <- {r.detail}" if not r.ok else f"   {r.detail}" if r.kind == "counterexample" else ""
            print(row + note)
        done = f" (interrupted: {len(results)} of {total} obligations done)" if cut else ""
        print(f"{len(results) - len(failed)}/{len(results)} as expected in {elapsed:.1f}s{done}")
    state = f", interrupted after {len(results)} of {total}" if cut else ""
    print(f"kvspec prove: {len(results) - len(failed)}/{len(results)} as expected, {elapsed:.1f}s{state}",
          file=sys.stderr)
    return 1 if failed else 0
