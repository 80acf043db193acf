"""Real vLLM 0.33.0 with kvspec's patches, in lockstep with the policies they implement.

``patches/vllm-0.33.0/pr47235.diff`` is PR #47235 as its description states it; the model's
``signal-rescan`` policy is the same change. ``patches/vllm-0.33.0/repair.diff`` writes the
model's ``repair`` policy into vLLM (target ``vllm+repair``, venv ``.vllm-repair-venv``); the
lockstep and hazard tests below run for it the same way, its policy state being the
manager's lost records, hashes in flight and repair counters. Here the patched vLLM (target ``vllm+pr47235``,
run from the venv ``scripts/setup-vllm-patched.sh pr47235`` builds) and the model must agree
after every operation, down to the snapshot's JSON text, including the policy state (the CPU
pool's eviction flag, read from vLLM's own ``BlockPool``):

* on random engine traces generated for the policy (``KVSPEC_VLLM_PATCHED_TRACES`` per
  configuration, default 12: 72 traces of 300 operations);
* through every hazard scenario of ``tests/test_hazards.py`` (T2, T3, H1-H8 and the PR's own
  four tests), each call made on both sides (``Tandem``), the scenario's own assertions
  unchanged;
* and the fuzzer's shrunk findings (``tests/traces/vllm_patched/``) reproduce the PR's
  completeness failure (C1) in vLLM's own code.

A model whose one open detail of §9.2 is decided differently diverges from the patch, so
the comparison sees the flag. Tests carry the ``vllm`` marker and are skipped, with the
reason, unless the running vLLM carries the patch; ``KVSPEC_REQUIRE_VLLM_PATCH=pr47235``
turns that into an error. ``scripts/lockstep_vllm_patched.py`` runs the long count.
"""

from __future__ import annotations

import inspect
import json
import os
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kept_kit import stale_snapshots
from test_vllm_conformance import CONFIGS as BASELINE_CONFIGS

from kvspec.adapters.targets import get_factory
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, KVSpecError
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import Run, first_difference, generate, replay
from kvspec.drivers.opgen import OpMix
from kvspec.model import make_scheduler
from kvspec.model.scheduler import OffloadScheduler
from kvspec.model.signal_rescan import SignalRescanOptions, SignalRescanPolicy


def _running_patch() -> tuple[str | None, str]:
    try:
        from kvspec.adapters.vllm_patched import running_patch

        got = running_patch()
    except ImportError as exc:
        return None, f"vLLM is not importable here: {exc}"
    if got[0] != got[1]:
        return None, f"the two vLLM modules carry different patches: {got}"
    return got[0], "" if got[0] else "the running vLLM 0.33.0 is not patched"


PATCH, PATCH_WHY = _running_patch()
REQUIRED = os.environ.get("KVSPEC_REQUIRE_VLLM_PATCH")
if REQUIRED and PATCH != REQUIRED:
    raise RuntimeError(f"KVSPEC_REQUIRE_VLLM_PATCH={REQUIRED} but {PATCH_WHY or f'vLLM carries {PATCH}'}")

PR = pytest.mark.skipif(PATCH != "pr47235", reason=f"needs vLLM + pr47235 ({PATCH_WHY or f'running {PATCH}'}); "
                        "build it with scripts/setup-vllm-patched.sh pr47235")
REPAIR = pytest.mark.skipif(PATCH != "repair", reason=f"needs vLLM + repair ({PATCH_WHY or f'running {PATCH}'}); "
                            "build it with scripts/setup-vllm-patched.sh repair")
TRACES = int(os.environ.get("KVSPEC_VLLM_PATCHED_TRACES", "12"))
OPS_PER_TRACE = 300
TRACE_DIR = Path(__file__).parent / "traces" / "vllm_patched"


# The eager configurations of the baseline conformance test (lazy offload has no re-store
# policy), with the policy of the patch under test.
CONFIGS: dict[str, OffloadConfig] = {name: replace(config, policy="signal-rescan")
                                     for name, config in BASELINE_CONFIGS.items() if not config.lazy_offload}


def policy_trace(config: OffloadConfig, seed: int, n_ops: int = OPS_PER_TRACE) -> list[dict[str, Any]]:
    """A random valid trace for ``config`` generated on the model of ``config.policy`` itself (a
    trace generated on the baseline is not valid for a policy whose loads hit differently)."""
    rng = random.Random(seed)
    mix = OpMix(rng.choice([1, 2, 3, 4]), 0.03, readmit_preempted=True)
    ops, out = generate(config, make_scheduler, rng, n_ops, (), mix=mix, strict=True)
    assert not out.failed, out.describe()
    return ops


def lockstep(config: OffloadConfig, ops: list[dict[str, Any]], target: str,
             reference: Callable[[OffloadConfig], Any] = make_scheduler) -> tuple[int, str] | None:
    """Apply ``ops`` to ``target`` with ``reference`` alongside (same outcome, same snapshot after
    every operation); the first disagreement as (operation index, what), or None."""
    run = Run(config, get_factory(target), (), reference=reference)
    for i, op in enumerate(ops):
        found = run.apply(op)
        if found is not None:
            return i, found.describe()
    return None


def _write(config: OffloadConfig, seed: int, ops: list[dict[str, Any]], at: int, what: str, tmp_path: Path,
           target: str) -> Path:
    out = Path(os.environ.get("KVSPEC_VLLM_TRACE_DIR", tmp_path))
    path = out / f"{target.replace('+', '-')}-divergence-seed{seed}.jsonl"
    trace_io.Trace(config, ops[: at + 1], target=target, seed=seed,
                   note=f"model {config.policy} vs {target} diverge at operation {at}: {what}").write(path)
    return path


# -- lockstep on random traces -------------------------------------------------------------------


def _lockstep_on_random_traces(name: str, policy: str, target: str, tmp_path: Path) -> None:
    """``TRACES`` random traces of configuration ``name`` under ``policy``: the model and ``target``
    agree after every operation; a disagreement is written as a trace and fails the test."""
    config = replace(CONFIGS[name], policy=policy)
    ops_done = 0
    for seed in range(TRACES):
        ops = policy_trace(config, seed)
        d = lockstep(config, ops, target)
        if d is not None:
            path = _write(config, seed, ops, d[0], d[1], tmp_path, target)
            pytest.fail(f"{name} seed {seed}: operation {d[0]}: {d[1]}\ntrace: {path}")
        ops_done += len(ops)
    print(f"\n[{target} lockstep] {name}: {TRACES} traces, {ops_done} operations in agreement")
    assert ops_done == TRACES * OPS_PER_TRACE


@pytest.mark.vllm
@PR
@pytest.mark.parametrize("name", list(CONFIGS))
def test_signal_rescan_model_agrees_with_vllm_pr47235(name: str, tmp_path: Path) -> None:
    _lockstep_on_random_traces(name, "signal-rescan", "vllm+pr47235", tmp_path)


@pytest.mark.vllm
@REPAIR
@pytest.mark.parametrize("name", list(CONFIGS))
def test_repair_model_agrees_with_vllm_repair(name: str, tmp_path: Path) -> None:
    _lockstep_on_random_traces(name, "repair", "vllm+repair", tmp_path)


@pytest.mark.vllm
@pytest.mark.parametrize(("target", "policy"), [pytest.param("vllm+pr47235", "signal-rescan", marks=PR),
                                                pytest.param("vllm+repair", "repair", marks=REPAIR)])
def test_kept_snapshots_of_patched_vllm_are_current(target: str, policy: str) -> None:
    """The fuzzer's engine keeps patched vLLM's snapshot between the calls that may change it;
    every kept snapshot it serves equals a fresh one (``kept_kit``)."""
    stale, served = stale_snapshots(target, policy, range(6))
    assert stale == []
    assert served > 0


@pytest.mark.vllm
@pytest.mark.parametrize(("target", "policy"), [pytest.param("vllm+pr47235", "signal-rescan", marks=PR),
                                                pytest.param("vllm+repair", "repair", marks=REPAIR)])
def test_fuzz_takes_the_patch_s_own_policy_by_default(target: str, policy: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``kvspec fuzz --target vllm+PATCH`` without ``--policy`` fuzzes under the policy the patch
    implements (any other is refused), and runs."""
    from kvspec.cli import main

    code = main(["fuzz", "--target", target, "--budget", "1", "--out", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code in (0, 1) and out["policy"] == policy and out["ops"] > 0


@pytest.mark.vllm
@REPAIR
def test_repair_lockstep_exercises_restores() -> None:
    """The repair traces reach the re-store path: lost records and planned re-stores show in the
    policy state that the lockstep compares, on the patched vLLM itself."""
    config = replace(CONFIGS["full-ws1"], policy="repair")
    seen_lost = seen_restores = 0
    run = Run(config, get_factory("vllm+repair"), ())
    for op in policy_trace(config, 0):
        run.apply(op)
        state = run.engine.snapshot()["scheduler"]["policy_state"]
        seen_lost += bool(state["lost"])
        seen_restores += state["restores_last_plan"] > 0
    assert seen_lost and seen_restores, (seen_lost, seen_restores)


@pytest.mark.vllm
@REPAIR
def test_repair_lockstep_exercises_retained_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sliding-window trace stores positions the request does not own from retained copies (R3:
    freed sliding-window pages, null slots), and the patched vLLM agrees after every operation."""
    import kvspec.model.repair as repair_module
    from kvspec.model.rules import RETAINED, SELECT, RepairScan

    scan = repair_module.repair_scan
    retained = 0

    def counting(kinds: list[str], keys: list[int], entry_free: list[bool], taken: int, free: int
                 ) -> RepairScan:
        nonlocal retained
        out = scan(kinds, keys, entry_free, taken, free)
        retained += sum(1 for k, step in zip(kinds, out.steps, strict=False) if k == RETAINED and step == SELECT)
        return out

    monkeypatch.setattr(repair_module, "repair_scan", counting)
    config = replace(CONFIGS["full+sliding-ws1"], policy="repair")
    assert lockstep(config, policy_trace(config, 0), "vllm+repair") is None
    assert retained > 0


def _model_with(options: SignalRescanOptions) -> Callable[[OffloadConfig], OffloadScheduler]:
    from kvspec.model.block_pool import BlockPool

    def make(config: OffloadConfig) -> OffloadScheduler:
        return OffloadScheduler(config, BlockPool(config.num_gpu_blocks, "gpu", config.num_groups),
                                lambda s: SignalRescanPolicy(s, options))

    return make


@pytest.mark.vllm
@PR
@pytest.mark.parametrize("options", [SignalRescanOptions(reset_clears_flag=True),
                                     SignalRescanOptions(rescan_oos_stops_scan=True),
                                     SignalRescanOptions(flush_rescans=True)])
def test_a_model_deciding_an_open_detail_otherwise_diverges(options: SignalRescanOptions) -> None:
    """The lockstep compares the flag and the rescan: a model that clears the flag on reset, skips
    Phase 1b after Phase 1a ran out of space, or rescans in the finish flush is caught against the
    patch on some trace."""
    for asynchronous in (True, False):
        config = replace(CONFIGS["full-ws1"], async_scheduling=asynchronous)
        for seed in range(160):
            ops = policy_trace(config, seed)
            if lockstep(config, ops, "vllm+pr47235", reference=_model_with(options)) is not None:
                return
    pytest.fail(f"no trace told the patch from a model with {options}")


# -- the factory checks what it runs ----------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.skipif(PATCH_WHY.startswith("vLLM is not importable"), reason=PATCH_WHY)
def test_factory_refuses_a_vllm_without_the_patch() -> None:
    config = CONFIGS["full-ws1"]
    if PATCH == "pr47235":
        assert get_factory("vllm+pr47235")(config).snapshot()["scheduler"]["policy_state"] == {
            "eviction_flag": False}
        with pytest.raises(ConfigError, match="implements the 'signal-rescan' policy"):
            get_factory("vllm+pr47235")(replace(config, policy="baseline"))
    else:
        with pytest.raises(ConfigError, match=r"setup-vllm-patched\.sh pr47235"):
            get_factory("vllm+pr47235")(config)
    repair = replace(config, policy="repair")
    if PATCH == "repair":
        assert get_factory("vllm+repair")(repair).snapshot()["scheduler"]["policy_state"] == (
            make_scheduler(repair).snapshot()["scheduler"]["policy_state"])
        with pytest.raises(ConfigError, match="implements the 'repair' policy"):
            get_factory("vllm+repair")(config)
    else:
        with pytest.raises(ConfigError, match=r"setup-vllm-patched\.sh repair"):
            get_factory("vllm+repair")(repair)


@pytest.mark.vllm
@pytest.mark.skipif(PATCH_WHY.startswith("vLLM is not importable"), reason=PATCH_WHY)
def test_plain_vllm_targets_refuse_a_patched_vllm() -> None:
    """``vllm`` and ``vllm@0.33.0`` judge vLLM's own code: in a patched venv they refuse to build,
    so a verdict on patched code is never reported as one on vLLM 0.33.0."""
    config = replace(CONFIGS["full-ws1"], policy="baseline")
    for name in ("vllm", "vllm@0.33.0"):
        if PATCH is not None:
            with pytest.raises(ConfigError, match=f"patched with '{PATCH}'"):
                get_factory(name)(config)
        else:
            assert get_factory(name)(config).snapshot()["scheduler"]["policy"] == "baseline"


# -- the hazard scenarios, each call made on the model and on the patched vLLM -------------------------


class Tandem:
    """The model and a target side by side behind the model's interface: every method call is
    made on both, and must give the same result (or the same error class) and leave the same
    snapshot; attributes that are not methods are the model's. Pools are tandems too."""

    def __init__(self, model: Any, real: Any, root: Tandem | None = None) -> None:
        self._model, self._real, self._root = model, real, root or self

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if name in ("gpu_pool", "cpu_pool"):
            return Tandem(attr, getattr(self._real, name), self._root)
        if not callable(attr) or name.startswith("_") or not hasattr(self._real, name):
            return attr
        return lambda *args, **kw: self._both(name, args, kw)

    def _both(self, name: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        got: list[tuple[str, Any]] = []
        for side in (self._model, self._real):
            try:
                got.append(("ok", getattr(side, name)(*[_unwrap(a) for a in args], **kw)))
            except KVSpecError as exc:
                got.append(("error", exc))
        (kind_m, value_m), (kind_r, value_r) = got
        if kind_m == "error" or kind_r == "error":
            assert (kind_m, type(value_m)) == (kind_r, type(value_r)), f"{name}: {value_m!r} vs {value_r!r}"
        else:
            value_m, value_r = _plain(value_m), _plain(value_r)
            assert value_m == value_r, f"{name}{args}: {value_m!r} vs {value_r!r}"
        root = self._root
        diff = first_difference(root._model.snapshot(), root._real.snapshot())
        assert diff is None, f"after {name}{args}: {diff}"
        if kind_m == "error":
            raise value_m
        return value_m


def _unwrap(value: Any) -> Any:
    return value._model if isinstance(value, Tandem) else value


def _plain(value: Any) -> Any:
    """Results in comparable form (iterators and generators as lists)."""
    if isinstance(value, (list, tuple)) or not hasattr(value, "__iter__") or isinstance(value, (str, dict)):
        return value
    return list(value)


def _hazard_tests(policy: str = "signal-rescan") -> list[tuple[str, dict[str, Any]]]:
    """The hazard tests that run on ``policy``: those taking a ``policy`` parameter whose
    parametrization lists it, and the policy's own scenarios (``test_pr_*`` for
    ``signal-rescan``, names with ``repair`` for ``repair``)."""
    import test_hazards

    own = {"signal-rescan": "test_pr_", "repair": "_repair_"}[policy]
    cases = []
    for name, fn in inspect.getmembers(test_hazards, inspect.isfunction):
        if not name.startswith("test_"):
            continue
        params = inspect.signature(fn).parameters
        if "policy" in params:
            marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize" and m.args[0] == "policy"]
            if marks and policy not in marks[0].args[1]:
                continue
        elif own not in name:
            continue  # a scenario of another policy only
        kw: dict[str, Any] = {"policy": policy} if "policy" in params else {}
        for finish_at_once in ((False, True) if "finish_at_once" in params else (None,)):
            cases.append((name, kw if finish_at_once is None else {**kw, "finish_at_once": finish_at_once}))
    return cases


def _hazard_in_tandem(target: str, name: str, kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run hazard test ``name`` of ``tests/test_hazards.py`` with every model scheduler it builds
    paired with a ``target`` (``Tandem``), so vLLM must agree with the model after every call."""
    import scenario_kit
    import test_hazards

    real = get_factory(target)
    built: list[Tandem] = []

    def paired(config: OffloadConfig) -> Any:
        t = Tandem(make_scheduler(config), real(config))
        built.append(t)
        return t

    monkeypatch.setattr(test_hazards, "make_scheduler", paired)
    monkeypatch.setattr(scenario_kit, "make_scheduler", paired)
    getattr(test_hazards, name)(**kw)
    assert built, f"{name} built no scheduler"


@pytest.mark.vllm
@PR
@pytest.mark.parametrize(("name", "kw"), _hazard_tests(), ids=lambda v: v if isinstance(v, str) else "")
def test_hazard_scenarios_on_vllm_pr47235(name: str, kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hazard test of ``tests/test_hazards.py`` on ``signal-rescan`` runs with every model
    scheduler it builds paired with a ``vllm+pr47235`` target (``Tandem``): its own assertions
    hold and vLLM agrees with the model after every call, so the outcomes are the model's."""
    _hazard_in_tandem("vllm+pr47235", name, kw, monkeypatch)


@pytest.mark.vllm
@REPAIR
@pytest.mark.parametrize(("name", "kw"), _hazard_tests("repair"), ids=lambda v: v if isinstance(v, str) else "")
def test_hazard_scenarios_on_vllm_repair(name: str, kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hazard test of ``tests/test_hazards.py`` on ``repair`` runs with every model scheduler
    it builds paired with a ``vllm+repair`` target (``Tandem``): its own assertions (the repair
    outcomes: full hits after T2, T3, H1, H3; no thrash, H6; new blocks first, H8) hold and vLLM
    agrees with the model after every call."""
    _hazard_in_tandem("vllm+repair", name, kw, monkeypatch)


# -- the fuzzer's findings replay on the patched vLLM ----------------------------------------------------


@pytest.mark.vllm
@PR
@pytest.mark.parametrize("path", sorted(TRACE_DIR.glob("vllm-pr47235-*.jsonl")), ids=lambda p: p.stem)
def test_saved_findings_reproduce_on_vllm_pr47235(path: Path) -> None:
    """Each saved trace was found and shrunk by ``kvspec fuzz --target vllm+pr47235 --oracle C1``;
    replayed on the patch it breaks completeness (C1) where it says, and the model agrees."""
    trace = trace_io.read(path)
    outcome = replay(trace, get_factory("vllm+pr47235"), ("C1",))
    assert outcome.failed and outcome.signature() == ("violation", "C1"), outcome.describe()
    on_model = replay(trace, make_scheduler, ("C1",))
    assert on_model.signature() == outcome.signature()


def test_saved_findings_exist() -> None:
    assert sorted(TRACE_DIR.glob("vllm-pr47235-*.jsonl")), f"no saved vllm+pr47235 finding in {TRACE_DIR}"
