"""Kept target snapshots (``Engine(keep_snapshots=True)``, the fuzzer's runs) show what a fresh
snapshot would.

The engine keeps the target's snapshot until it makes a call that may change the target or its
GPU pool. The checks: (1) on random traces of every target here (the model and the
implementation under each policy, every known-bug variant), every time a kept snapshot is
served it equals one taken fresh at that moment (``kept_kit``; the vLLM stages run the same
check on real vLLM); (2) planted mutations (GPU-pool calls, or target calls, no longer drop the
kept snapshot) are caught by (1); (3) the fuzzer's loop (``generate``: kept snapshots, incremental checking)
returns the same verdicts as a run that takes every snapshot fresh and checks in full; (4) a
target whose snapshot changes behind the engine's back (a premise the engine cannot see) never
gets a verdict from a stale snapshot: ``generate`` confirms every violation with fresh snapshots
and compares the kept snapshot with a fresh one at the end of every trace, and replays with fresh
snapshots when either disagrees; (5) the incremental oracle takes identical containers as
unchanged only when the engine served the same kept snapshot, not when a fresh one hands out the
same objects refilled in place, and a planted mutation of that rule is caught; (6) a crash is
reported from its exception, with no snapshot check that a crashed target could break.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from kept_kit import stale_snapshots

from kvspec.adapters import claims as claimed
from kvspec.adapters.targets import get_factory, target_names
from kvspec.contract.config import POLICIES, OffloadConfig
from kvspec.drivers import harness
from kvspec.drivers.engine import Engine
from kvspec.drivers.harness import generate, run_ops
from kvspec.drivers.opgen import OpGenerator, RandomChoices, random_config
from kvspec.model.bugs import BUGS
from kvspec.oracle.incremental import IncrementalOracle

TARGETS = [(t, p) for t in ("model", "impl") for p in POLICIES] + [
    (name, BUGS[name[4:]].policy) for name in target_names() if name.startswith("bug:")]  # each bug's own policy


@pytest.mark.parametrize(("target", "policy"), TARGETS)
def test_every_kept_snapshot_served_is_current(target: str, policy: str) -> None:
    stale, served = stale_snapshots(target, policy, range(4 if target == "impl" else 8))
    assert stale == []
    assert served > 0, "no kept snapshot was ever served: the check judged nothing"


@pytest.mark.parametrize("watched", ["_changing_gpu", "_changing_target"])
def test_a_call_that_keeps_the_snapshot_is_caught(monkeypatch: pytest.MonkeyPatch, watched: str) -> None:
    """The planted mutations: calls on the GPU pool, or on the target, no longer drop the kept
    snapshot."""
    raw = "gpu" if watched == "_changing_gpu" else "target"
    monkeypatch.setattr(Engine, watched, property(lambda self: getattr(self, raw)))
    stale, _ = stale_snapshots("model", "repair", range(8))
    assert stale


def _verdicts(target: str, policy: str, seed: int) -> tuple[str, str, bool]:
    """The fuzzer's verdict on one generated trace, that of replaying its operations with fresh
    snapshots and the full oracle after each, and whether the fuzzer's was a violation."""
    rng = random.Random(seed)
    cfg = random_config(RandomChoices(rng), policy, False)
    ids = claimed.resolve(None, cfg, None).ids
    ops, found = generate(cfg, get_factory(target), rng, 60, ids)
    return found.describe(), run_ops(cfg, ops, get_factory(target), ids).describe(), found.violation is not None


@pytest.mark.parametrize(("target", "policy"), [("model", "repair"), ("model", "baseline"), ("impl", "repair"),
                                                ("bug:stale-cursor", "repair"), ("bug:self-eviction", "repair"),
                                                ("bug:final-step-lost", "repair"), ("bug:thrash", "repair"),
                                                ("bug:world-size-ignored", "baseline")])
def test_fuzzer_verdicts_match_fresh_full_replays(target: str, policy: str) -> None:
    found = 0
    for seed in range(8):
        fuzzed, replayed, violation = _verdicts(target, policy, seed)
        assert fuzzed == replayed
        found += violation
    if target.startswith("bug:"):
        assert found, f"{target}: no trace found its bug, so the agreement judged only clean runs"


class _Drifting:
    """A target whose snapshot changes without a call: after ``after`` snapshots, each one shows a
    load event counter one higher than the last (a stand-in for a target that mutates state in a
    query, or whose snapshot reads objects the engine changes)."""

    def __init__(self, inner: Any, after: int) -> None:
        self._inner, self._left = inner, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def snapshot(self) -> dict[str, Any]:
        snap = self._inner.snapshot()
        self._left -= 1
        if self._left < 0:
            snap["scheduler"]["load_event_counter"] -= self._left
        return snap


def test_a_snapshot_that_drifts_behind_the_engine_gets_a_fresh_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate`` compares the kept snapshot with a fresh one at the end of every trace; a
    mismatch means the operations are replayed with fresh snapshots, and the outcome says why."""
    replays: list[bool] = []
    real = harness._replayed_in_full

    def spy(*args: Any, **kw: Any) -> Any:
        replays.append(True)
        return real(*args, **kw)

    monkeypatch.setattr(harness, "_replayed_in_full", spy)
    cfg = OffloadConfig(policy="repair", block_size=4, num_gpu_blocks=16, num_cpu_blocks=8)
    ids = claimed.resolve(None, cfg, None).ids
    make = get_factory("model")
    _, steady = generate(cfg, lambda c: _Drifting(make(c), after=10**9), random.Random(1), 40, ids)
    assert replays == [] and steady.replayed is None  # a target that does not drift is never replayed
    _, drifting = generate(cfg, lambda c: _Drifting(make(c), after=5), random.Random(1), 40, ids)
    assert replays == [True] and drifting.replayed == harness.STALE_SNAPSHOT


def test_the_fuzzer_counts_and_explains_replays(capsys: pytest.CaptureFixture[str]) -> None:
    """A campaign on a drifting target says how many traces were judged by a fresh replay, and why."""
    from kvspec.commands.fuzz import _print_report

    make = get_factory("model")
    res = harness.fuzz(lambda c: _Drifting(make(c), after=5), "repair", budget=1.0, seed=0)
    assert res.traces > 0 and res.replays == {harness.STALE_SNAPSHOT: res.traces}
    steady = harness.fuzz(make, "repair", budget=0.5, seed=0)
    assert steady.traces > 0 and steady.replays == {}
    _print_report({"interrupted": False, "workers": 1, "traces": res.traces, "ops": res.ops, "seconds": 1.0,
                   "ops_per_second": 1.0, "target": "model", "policy": "repair", "oracle": "claims", "configs": [],
                   "campaign": {"resumed": False}, "rejected": 0, "rare_paths": {}, "replays": res.replays,
                   "findings": []})
    assert f"WARNING: {res.traces} trace(s) replayed (stale snapshot)" in capsys.readouterr().out


class _Aliasing:
    """A target whose snapshots hand out the same pool lists each time, refilled in place (so a
    list compared with the last snapshot's is the very same object, whatever it now holds)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lists: dict[tuple[str, str], list[Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def snapshot(self) -> dict[str, Any]:
        snap = self._inner.snapshot()
        for section in ("gpu_pool", "cpu_pool"):
            for key, value in snap[section].items():
                if isinstance(value, list):
                    kept = self._lists.setdefault((section, key), [])
                    kept[:] = value
                    snap[section][key] = kept
        return snap


def _i1_reruns(seed: int) -> tuple[int, int]:
    """I1 alone (it reads only the pools: the aliased lists and an unchanging block count), the
    fuzzer's way (lean, incremental, kept snapshots), on a random trace of the aliasing model:
    (operations after which the engine had taken a fresh target snapshot since the last judged
    one and I1 did not run, operations with such a snapshot)."""
    rng = random.Random(seed)
    cfg = random_config(RandomChoices(rng), "repair", False)
    make = get_factory("model")
    run = harness.Run(cfg, lambda c: _Aliasing(make(c)), ("I1",), incremental=True, lean=True, keep=True)
    assert run.incremental is not None
    gen = OpGenerator(cfg, RandomChoices(rng))
    missed = fresh = 0
    run.apply(gen.next_op(run.engine), recorded=False)
    for _ in range(60):
        generation, ran, rejected = run.engine.generation, run.incremental.ran, run.rejected
        assert run.apply(gen.next_op(run.engine), recorded=False) is None
        if run.rejected == rejected and run.engine.served_generation != generation:
            fresh += 1
            missed += run.incremental.ran == ran
    return missed, fresh


def test_identical_lists_from_a_fresh_snapshot_are_rechecked() -> None:
    """The kept-snapshot runs vouch for the target's sections only when the engine served the
    same kept snapshot as last time; identical containers in a fresh one are rechecked."""
    results = [_i1_reruns(seed) for seed in range(4)]
    assert sum(m for m, _ in results) == 0
    assert sum(f for _, f in results) > 0


def test_vouching_for_every_snapshot_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted mutation: the incremental oracle is told every snapshot's target sections are
    unchanged; the check above names it."""
    real = IncrementalOracle.check
    monkeypatch.setattr(IncrementalOracle, "check", lambda self, snap, same_target=False: real(self, snap, True))
    assert sum(m for m, _ in (_i1_reruns(seed) for seed in range(4))) > 0


class _Crashing:
    """A target whose fifth ``has_pending_stores`` (a query, which leaves the engine's kept
    snapshot in place) raises a plain ``RuntimeError`` (a crash), after which its snapshot raises
    too."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.queries, self.crashed = inner, 0, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def has_pending_stores(self) -> bool:
        self.queries += 1
        if self.queries == 5:
            self.crashed = True
            raise RuntimeError("query crashed")
        return bool(self._inner.has_pending_stores())

    def snapshot(self) -> dict[str, Any]:
        if self.crashed:
            raise RuntimeError("no snapshot after the crash")
        return dict(self._inner.snapshot())


def test_a_crash_is_reported_without_a_snapshot_check() -> None:
    """A crash is observed from the exception, not read from a snapshot: ``generate`` reports it
    as it is, without comparing the kept snapshot (which a crashed target may not even give)."""
    cfg = OffloadConfig(policy="repair", block_size=4, num_gpu_blocks=16, num_cpu_blocks=8)
    ids = claimed.resolve(None, cfg, None).ids
    make = get_factory("model")
    outcomes = [generate(cfg, lambda c: _Crashing(make(c)), random.Random(seed), 60, ids)[1] for seed in range(4)]
    crashes = [out for out in outcomes if out.crash is not None]
    assert len(crashes) >= 2, "too few traces reached the crash"
    assert all("query crashed" in out.crash and out.replayed is None for out in crashes)


def test_every_violation_is_confirmed_with_fresh_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A violation the fuzzer's loop finds is replayed once with fresh snapshots before it is
    returned (a plan fact measured from a stale kept snapshot could otherwise raise an alarm that
    the end-of-operation snapshot no longer shows)."""
    calls: list[str] = []
    real = harness._replayed_in_full
    monkeypatch.setattr(harness, "_replayed_in_full", lambda *a, **k: calls.append("replay") or real(*a, **k))
    violations = 0
    for seed in range(6):
        rng = random.Random(seed)
        cfg = random_config(RandomChoices(rng), "repair", False)
        _, out = generate(cfg, get_factory("bug:self-eviction"), rng, 60, claimed.resolve(None, cfg, None).ids)
        violations += out.violation is not None
        assert out.replayed is None
    assert violations and len(calls) == violations


class _LiesOnce:
    """A target whose one snapshot, the ``at``-th taken by the first instance built, shows CPU
    block 1 with ref count -1 (a violation of I1 that its state does not have)."""

    built = 0

    def __init__(self, inner: Any, at: int) -> None:
        _LiesOnce.built += 1
        self._inner, self._left, self._liar = inner, at, _LiesOnce.built == 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def snapshot(self) -> dict[str, Any]:
        snap = self._inner.snapshot()
        self._left -= 1
        if self._liar and self._left == 0:
            snap["cpu_pool"] = {**snap["cpu_pool"], "ref_cnt": [0, -1, *snap["cpu_pool"]["ref_cnt"][2:]]}
        return snap


def test_a_violation_that_fresh_snapshots_do_not_show_is_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = OffloadConfig(policy="repair", block_size=4, num_gpu_blocks=16, num_cpu_blocks=8)
    make = get_factory("model")
    monkeypatch.setattr(_LiesOnce, "built", 0)
    _, out = generate(cfg, lambda c: _LiesOnce(make(c), at=20), random.Random(3), 60, ("I1",))
    assert out.violation is None and out.replayed == harness.STALE_SNAPSHOT
