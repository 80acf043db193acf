"""``kvspec verify``: the main job on the embedded default configuration.

Runs, in order: the proofs (``kvspec prove``), a conformance campaign
(the stateful harness on the model's correct policies, and the implementation
against the model when it is installed), the known-bug catalogue, and the vLLM
conformance when vLLM is importable. Prints a summary table (or ``--json``) and
exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import time
from typing import Any, Protocol

from kvspec.adapters.targets import get_factory
from kvspec.commands.fuzz import budget_seconds
from kvspec.contract.errors import ConfigError
from kvspec.drivers.harness import default_oracle, generate, run_ops
from kvspec.drivers.opgen import RandomChoices, random_config
from kvspec.model import make_scheduler

NAME = "verify"
HELP = "the main job: proofs, a conformance campaign, the known-bug catalogue (and vLLM when installed)"
EPILOG = ("exit codes: 0 every stage passed or was skipped with a reason, 1 a stage failed, 2 bad usage, "
          "3 internal error")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--budget", type=budget_seconds, default=60.0,
                   help="seconds for the conformance campaign (default 60)")
    p.add_argument("--bug-budget", type=budget_seconds, default=5.0, help="seconds per known bug (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


class _Check(Protocol):
    """A stage's check, called with no arguments (the lambdas below bind their loop variable as a default)."""

    def __call__(self) -> tuple[bool | None, str]: ...


def _stage(rows: list[dict[str, Any]], name: str, fn: _Check, quiet: bool) -> None:
    if not quiet:
        print(f"[verify] {name} ...", file=sys.stderr)
    t = time.monotonic()
    ok, detail = fn()
    rows.append({"stage": name, "result": {True: "pass", False: "FAIL", None: "skipped"}[ok],
                 "seconds": round(time.monotonic() - t, 2), "detail": detail})


def _campaign(policy: str, factory: Any, reference: Any, budget: float, seed: int) -> tuple[bool, str]:
    """Random traces (drawn on the model) replayed on ``factory``, against ``reference`` when given,
    judged by ``policy``'s claims, until ``budget`` seconds are spent or a finding is made."""
    rng = random.Random(seed)
    end = time.monotonic() + budget
    traces = ops = 0
    while time.monotonic() < end:
        cfg = random_config(RandomChoices(rng), policy)
        trace_ops, _ = generate(cfg, make_scheduler, rng, 60, ())
        out = run_ops(cfg, trace_ops, factory, default_oracle(cfg), reference)
        traces += 1
        ops += out.ops_run
        if out.failed:
            return False, f"{traces} traces; {out.describe()}"
    return True, f"{traces} traces, {ops} operations, no finding (oracle: claims of {policy})"


def _proofs() -> tuple[bool | None, str]:
    from kvspec.specs.obligations import catalogue, run_all

    results = run_all(catalogue(), lambda ob, res: None)
    bad = [r.name for r in results if not r.ok]
    return not bad, f"{len(results) - len(bad)}/{len(results)} obligations as expected" + (
        f"; not: {', '.join(bad)}" if bad else "")


def _known_bugs(budget: float) -> tuple[bool, str]:
    from kvspec.commands.bugs import hunt

    found, _ = hunt(budget, 1, quiet=True)
    missed = [r["bug"] for r in found if not r["found"]]
    return not missed, f"{len(found) - len(missed)}/{len(found)} known bugs found as violations" + (
        f"; missed {', '.join(missed)}" if missed else "")


def _vllm(budget: float, seed: int) -> tuple[bool | None, str]:
    try:
        factory = get_factory("vllm")
        importlib.import_module("vllm")
    except (ConfigError, ImportError) as exc:
        return None, f"vLLM not installed here ({exc.__class__.__name__})"
    return _campaign("baseline", factory, make_scheduler, budget, seed)


def _impl_factory() -> Any:
    try:
        return get_factory("impl")
    except ConfigError:
        return None


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    quiet = args.json
    _stage(rows, "proofs", _proofs, quiet)
    share = args.budget / 3
    for policy in ("baseline", "repair"):
        _stage(rows, f"conformance model/{policy}",
               lambda p=policy: _campaign(p, make_scheduler, None, share / 2, args.seed), quiet)
    impl = _impl_factory()
    for policy in ("baseline", "signal-rescan", "repair"):
        if impl is None:
            _stage(rows, f"impl vs model/{policy}", lambda: (None, "kvspec.impl is not available"), quiet)
        else:
            _stage(rows, f"impl vs model/{policy}",
                   lambda p=policy: _campaign(p, impl, make_scheduler, share / 3, args.seed), quiet)
    _stage(rows, "known-bug catalogue", lambda: _known_bugs(args.bug_budget), quiet)
    _stage(rows, "vLLM 0.33.0 vs model/baseline", lambda: _vllm(share, args.seed), quiet)
    failed = any(r["result"] == "FAIL" for r in rows)
    if args.json:
        print(json.dumps({"ok": not failed, "stages": rows}))
    else:
        print(f"{'stage':34} {'result':8} {'seconds':>8}  detail")
        for r in rows:
            print(f"{r['stage']:34} {r['result']:8} {r['seconds']:8.1f}  {r['detail']}")
        print("verify: " + ("FAILED" if failed else "all stages passed or were skipped with a reason"))
    return 1 if failed else 0
