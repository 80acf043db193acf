"""``kvspec verify``: the main job on the embedded default configuration.

Runs, in order: the proofs (``kvspec prove``, both managers), a conformance campaign
(the stateful harness on the model's correct policies, and the implementation
against the model when it is installed), the known-bug catalogue, and the vLLM
conformance when vLLM is importable; then the same for the second manager (the
OffloadingConnector's ``CPUOffloadingManager``): its model fuzzed with O1-O10, its
implementation and vLLM's own manager (when importable) in lockstep with the model, its
known-bug variants. Prints a summary table (or ``--json``) and
exits non-zero on any failure. Ctrl-C stops the stage running (the proofs inside a Z3 check
too), runs no further stage, prints the rows so far (the stopped stage's says how far it got)
and exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvspec.adapters.targets import get_factory
from kvspec.commands.fuzz import add_ray_argument, add_workers_argument, budget_seconds
from kvspec.contract.errors import EXIT_INTERRUPTED, ConfigError, exit_codes
from kvspec.drivers.campaign import JobsInterrupted, Partial, check_ray, check_workers, map_jobs
from kvspec.drivers.harness import default_oracle, generate, run_ops
from kvspec.drivers.opgen import RandomChoices, random_config
from kvspec.model import make_scheduler

NAME = "verify"
HELP = ("the main job: proofs, conformance campaigns, the known-bug catalogues (and vLLM when installed), "
        "for both managers")
EPILOG = exit_codes("every stage passed or was skipped with a reason", "a stage failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--budget", type=budget_seconds, default=60.0,
                   help="seconds for the conformance campaign (default 60)")
    p.add_argument("--bug-budget", type=budget_seconds, default=5.0, help="seconds per known bug (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of every campaign (default 0)")
    add_workers_argument(p, "processes running stages at once; the stages' results do not depend on it")
    add_ray_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Stage:
    """A stage: its name, a module-level check and the check's arguments (picklable: a campaign job)."""

    name: str
    check: Callable[..., tuple[bool | None, str]]
    args: tuple[Any, ...] = ()


INTERRUPTED = "interrupted"


def run_stage(quiet: bool, stage: Stage) -> dict[str, Any]:
    """Run one stage; its row (result pass / FAIL / skipped, seconds, detail)."""
    if not quiet:
        print(f"[verify] {stage.name} ...", file=sys.stderr)
    t = time.monotonic()
    try:
        ok, detail = stage.check(*stage.args)
    except KeyboardInterrupt as exc:  # the row says how far the stage got; no later stage runs
        detail = str(exc.result) if isinstance(exc, Partial) else "stopped by Ctrl-C"
        raise Partial({"stage": stage.name, "result": INTERRUPTED, "seconds": round(time.monotonic() - t, 2),
                       "detail": detail}) from None
    return {"stage": stage.name, "result": {True: "pass", False: "FAIL", None: "skipped"}[ok],
            "seconds": round(time.monotonic() - t, 2), "detail": detail}


def _campaign(policy: str, target: str, reference: bool, budget: float, seed: int) -> tuple[bool | None, str]:
    """Random traces (drawn on the model) replayed on ``target``, against the model when
    ``reference``, judged by ``policy``'s claims, until ``budget`` seconds are spent or a finding is
    made; skipped when the target is not available here."""
    try:
        factory = get_factory(target)
    except ConfigError as exc:
        return None, f"{target} is not available ({exc})"
    rng = random.Random(seed)
    end = time.monotonic() + budget
    traces = ops = 0
    while time.monotonic() < end:
        cfg = random_config(RandomChoices(rng), policy)
        trace_ops, _ = generate(cfg, make_scheduler, rng, 60, ())
        out = run_ops(cfg, trace_ops, factory, default_oracle(cfg), make_scheduler if reference else None)
        traces += 1
        ops += out.ops_run
        if out.failed:
            return False, f"{traces} traces; {out.describe()}"
    return True, f"{traces} traces, {ops} operations, no finding (oracle: claims of {policy})"


def _proofs() -> tuple[bool | None, str]:
    from kvspec.specs.obligations import Interrupted, catalogue, run_all

    obs = catalogue()
    try:
        results = run_all(obs, lambda ob, res: None)
    except Interrupted as stop:  # a Ctrl-C inside a Z3 check included (encoding.check_sat)
        bad = [r.name for r in stop.results if not r.ok]
        raise Partial(f"interrupted after {len(stop.results)} of {len(obs)} obligations, "
                      f"{len(stop.results) - len(bad)} of them as expected"
                      + (f"; not: {', '.join(bad)}" if bad else "")) from None
    bad = [r.name for r in results if not r.ok]
    return not bad, f"{len(results) - len(bad)}/{len(results)} obligations as expected" + (
        f"; not: {', '.join(bad)}" if bad else "")


def _known_bugs(budget: float) -> tuple[bool, str]:
    from kvspec.commands.bugs import hunt

    found, interrupted = hunt(budget, 1, quiet=True)
    if interrupted:
        raise Partial(f"interrupted after {len(found)} bugs, {sum(r['found'] for r in found)} found")
    missed = [r["bug"] for r in found if not r["found"]]
    return not missed, f"{len(found) - len(missed)}/{len(found)} known bugs found as violations" + (
        f"; missed {', '.join(missed)}" if missed else "")


def _vllm(budget: float, seed: int) -> tuple[bool | None, str]:
    try:
        get_factory("vllm")
        importlib.import_module("vllm")
    except (ConfigError, ImportError) as exc:
        return None, f"vLLM not installed here ({exc.__class__.__name__})"
    return _campaign("baseline", "vllm", True, budget, seed)


def _offloading_campaign(target: str, budget: float, seed: int) -> tuple[bool | None, str]:
    """The second manager: ``target`` in lockstep with its model (``offloading-impl``,
    ``vllm-offloading``: results and snapshots after every call), or the model fuzzed with every
    O-invariant (``offloading``); skipped when the target is not available here."""
    from kvspec.adapters.targets import get_offloading_factory
    from kvspec.drivers import offloading_fuzz as ofz
    from kvspec.oracle.catalogue import MANAGER_INVARIANTS

    try:
        factory = get_offloading_factory(target)
        if target == "vllm-offloading":
            from kvspec.contract.offloading import OffloadingConfig

            factory(OffloadingConfig())
    except ConfigError as exc:
        return None, f"{target} is not available ({exc})"
    model = get_offloading_factory("offloading")
    if target == "offloading":
        res = ofz.fuzz(model, budget, seed, MANAGER_INVARIANTS)
        if res.finding is not None:
            return False, f"{res.traces} traces; {res.finding.kind}: {res.finding.message}"
        return True, f"{res.traces} traces, {res.ops} operations, no finding (oracle: O1-O10)"
    lock = ofz.lockstep(model, factory, budget, seed)
    if lock.divergence is not None:
        return False, f"{lock.traces} traces; diverges at {lock.divergence}"
    return True, f"{lock.traces} traces, {lock.ops} operations, equal to the model after each"


def _offloading_bugs(budget: float) -> tuple[bool, str]:
    """Each of the second manager's known-bug variants found by its own oracle alone."""
    from kvspec.drivers import offloading_fuzz as ofz
    from kvspec.model.offloading.bugs import OFFLOADING_BUGS

    missed = [name for name, bug in OFFLOADING_BUGS.items()
              if (res := ofz.fuzz(bug.manager, budget, 1, bug.oracle, bug.policy)).finding is None
              or res.finding.kind != "violation"]
    n = len(OFFLOADING_BUGS)
    return not missed, f"{n - len(missed)}/{n} known bugs found as violations" + (
        f"; missed {', '.join(missed)}" if missed else "")


def stages(budget: float, bug_budget: float, seed: int) -> list[Stage]:
    """The stages in order, with their shares of the campaign budget."""
    share = budget / 3
    out = [Stage("proofs", _proofs)]
    out += [Stage(f"conformance model/{p}", _campaign, (p, "model", False, share / 2, seed))
            for p in ("baseline", "repair")]
    out += [Stage(f"impl vs model/{p}", _campaign, (p, "impl", True, share / 3, seed))
            for p in ("baseline", "signal-rescan", "repair")]
    out += [Stage("known-bug catalogue", _known_bugs, (bug_budget,)),
            Stage("vLLM 0.33.0 vs model/baseline", _vllm, (share, seed))]
    out += [Stage("offloading: model", _offloading_campaign, ("offloading", share / 6, seed)),
            Stage("offloading: impl vs model", _offloading_campaign, ("offloading-impl", share / 6, seed)),
            Stage("offloading: known bugs", _offloading_bugs, (bug_budget,)),
            Stage("offloading: vLLM 0.33.0 vs model", _offloading_campaign,
                  ("vllm-offloading", share / 3, seed))]
    return out


def run(args: argparse.Namespace) -> int:
    workers, ray = check_workers(args.workers, args.ray), check_ray(args.ray)
    todo = stages(args.budget, args.bug_budget, args.seed)
    interrupted = False
    try:
        rows = map_jobs(partial(run_stage, args.json), todo, workers, ray)
    except JobsInterrupted as stop:  # Ctrl-C: the stages done, the one(s) stopped, no further stage
        interrupted = True
        rows = [r if r is not None else {"stage": st.name, "result": "not run", "seconds": 0.0,
                                         "detail": "not run: interrupted before it started"}
                for st, r in zip(todo, stop.results, strict=True)]
    failed = any(r["result"] == "FAIL" for r in rows)
    if args.json:
        print(json.dumps({"ok": not failed and not interrupted, "interrupted": interrupted, "stages": rows}))
    else:
        print(f"{'stage':34} {'result':11} {'seconds':>8}  detail")
        for r in rows:
            print(f"{r['stage']:34} {r['result']:11} {r['seconds']:8.1f}  {r['detail']}")
        print("verify: " + ("interrupted" if interrupted else "FAILED" if failed
                            else "all stages passed or were skipped with a reason"))
    if interrupted:
        return EXIT_INTERRUPTED
    return 1 if failed else 0
