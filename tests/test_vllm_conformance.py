"""Conformance of the model's ``baseline`` policy with real vLLM 0.33.0.

The same random engine traces (``kvspec.drivers.tracegen.random_ops``) run on
``Engine(VllmTarget)`` with ``Engine(model baseline)`` as the reference, through the harness'
run loop (``kvspec.drivers.harness.Run``). After every operation both must agree on the
outcome (result, or the ``KVSpecError`` class of a rejection) and on the whole snapshot, down
to its JSON text (key order included): both pools, the scheduler state and the engine's view.
Direct calls with bad input are the error contract's, run on vLLM by
tests/test_vllm_verdicts.py (``contract_kit.ErrorContract``, the same cases as for the model and
the implementation, observed in vLLM's own objects too). A failing trace is written in the trace
format (``kvspec replay`` reads it) under ``KVSPEC_VLLM_TRACE_DIR`` (default: pytest's tmp dir).

Tests that need vLLM carry the ``vllm`` marker and are skipped, with the reason, where
vLLM 0.33.0 cannot be imported; run them with ``scripts/ci-vllm-stage.sh``.
``KVSPEC_VLLM_TRACES`` scales the number of traces per configuration (default 12);
``KVSPEC_REQUIRE_VLLM=1`` (set by the CI stage) makes a missing vLLM an error.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from kept_kit import stale_snapshots

from kvspec.adapters.vllm import vllm_available
from kvspec.adapters.vllm_compat import installed_version
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import ConfigError, KVSpecError
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import Run, first_difference, run_ops
from kvspec.drivers.trace import Trace
from kvspec.drivers.tracegen import random_ops
from kvspec.model import make_scheduler
from kvspec.model.baseline import BaselinePolicy
from kvspec.model.scheduler import OffloadScheduler

VLLM_OK, VLLM_WHY = vllm_available()
if os.environ.get("KVSPEC_REQUIRE_VLLM") == "1" and not VLLM_OK:
    raise RuntimeError(f"KVSPEC_REQUIRE_VLLM=1 but {VLLM_WHY}")

TRACES = int(os.environ.get("KVSPEC_VLLM_TRACES", "12"))
OPS_PER_TRACE = 300


def _cfg(**kw: Any) -> OffloadConfig:
    return OffloadConfig(policy="baseline", **kw)


CONFIGS: dict[str, OffloadConfig] = {
    "full-ws1": _cfg(block_size=4, num_gpu_blocks=16, num_cpu_blocks=5),
    "full-ws1-bigcpu": _cfg(block_size=4, num_gpu_blocks=14, num_cpu_blocks=16),
    "full-ws2": _cfg(block_size=4, num_gpu_blocks=16, num_cpu_blocks=6, world_size=2),
    "two-full-ws2": _cfg(block_size=2, num_gpu_blocks=30, num_cpu_blocks=9, groups=(KVGroup(), KVGroup()),
                         world_size=2),
    "full+sliding-ws1": _cfg(block_size=4, num_gpu_blocks=24, num_cpu_blocks=7,
                             groups=(KVGroup(), KVGroup("sliding", 6))),
    "sliding+full+sliding-ws2": _cfg(block_size=3, num_gpu_blocks=40, num_cpu_blocks=12, world_size=2,
                                     groups=(KVGroup("sliding", 2), KVGroup(), KVGroup("sliding", 13))),
    "lazy-full-ws1": _cfg(block_size=4, num_gpu_blocks=16, num_cpu_blocks=6, lazy_offload=True,
                          max_num_batched_tokens=16),
    "lazy-full+sliding-ws2": _cfg(block_size=4, num_gpu_blocks=30, num_cpu_blocks=8, world_size=2,
                                  groups=(KVGroup(), KVGroup("sliding", 5)), lazy_offload=True,
                                  max_num_batched_tokens=8),
}


# -- the side-by-side runner ------------------------------------------------------------------


@dataclass
class Tally:
    traces: int = 0
    ops: int = 0
    rejected: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


@dataclass
class Divergence:
    op_index: int
    op: dict[str, Any]
    what: str


def run_side_by_side(config: OffloadConfig, ops: list[dict[str, Any]],
                     reference: Callable[[OffloadConfig], Any], target: Callable[[OffloadConfig], Any],
                     tally: Tally | None = None) -> Divergence | None:
    """Apply ``ops`` to the target with the reference alongside (``harness.Run``: the same outcome
    and the same snapshot, key order included, after every operation; an operation marked
    ``"expect": "error"`` rejected); the first disagreement, or None."""
    run = Run(config, target, (), reference=reference)
    for i, op in enumerate(ops):
        found = run.apply(op)
        if found is not None:
            return Divergence(i, op, found.describe())
        if tally is not None:
            tally.ops += 1
            tally.by_op[op["op"]] = tally.by_op.get(op["op"], 0) + 1
    if tally is not None:
        tally.rejected += run.rejected
    return None


def trace_for(config: OffloadConfig, seed: int, n_ops: int = OPS_PER_TRACE) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    families = rng.choice([1, 2, 3, 4])
    return random_ops(config, rng, n_ops, num_families=families, invalid_rate=0.03)


def _vllm_factory(config: OffloadConfig) -> Any:
    from kvspec.adapters.vllm import make_vllm_target

    return make_vllm_target(config)


def _write_failure(config: OffloadConfig, seed: int, ops: list[dict[str, Any]], d: Divergence,
                   tmp_path: Path, name: str) -> Path:
    out = Path(os.environ.get("KVSPEC_VLLM_TRACE_DIR", tmp_path))
    path = out / f"vllm-divergence-{name}-seed{seed}.jsonl"
    Trace(config, ops[: d.op_index + 1], target="vllm", seed=seed,
          note=f"model baseline vs vLLM 0.33.0 diverge at operation {d.op_index}: {d.what}").write(path)
    return path


# -- kept snapshots (the fuzzer's engine) -----------------------------------------------------


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
@pytest.mark.parametrize("target", ["vllm", "raw:vllm"])
def test_kept_snapshots_of_vllm_are_current(target: str) -> None:
    """The fuzzer's engine keeps vLLM's snapshot between the calls that may change it (vLLM's
    manager and GPU pool); every kept snapshot it serves equals a fresh one (``kept_kit``)."""
    stale, served = stale_snapshots(target, "baseline", range(6))
    assert stale == []
    assert served > 0


# -- conformance over random traces ------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_model_baseline_agrees_with_vllm_after_every_operation(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name]
    tally = Tally()
    for seed in range(TRACES):
        ops = trace_for(config, seed)
        d = run_side_by_side(config, ops, make_scheduler, _vllm_factory, tally)
        if d is not None:
            path = _write_failure(config, seed, ops, d, tmp_path, name)
            pytest.fail(f"{name} seed {seed}: operation {d.op_index} {d.op}: {d.what}\ntrace: {path}")
        tally.traces += 1
    print(f"\n[vllm conformance] {name}: {tally.traces} traces, {tally.ops} operations in agreement "
          f"({tally.rejected} rejected by both); {dict(sorted(tally.by_op.items()))}")
    assert tally.ops == TRACES * OPS_PER_TRACE


def random_config(rng: random.Random) -> OffloadConfig:
    """Block sizes 1-16, up to three groups (full or sliding windows of 2 tokens and up),
    world sizes 1-3, eager or lazy, small and large pools."""
    bs = rng.choice([1, 2, 3, 4, 5, 8, 16])
    groups = [KVGroup()]
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        groups.append(KVGroup("sliding", rng.randint(2, 4 * bs + 3)) if rng.random() < 0.8 else KVGroup())
    rng.shuffle(groups)
    return _cfg(block_size=bs, num_gpu_blocks=rng.randint(6, 40) * len(groups), num_cpu_blocks=rng.randint(2, 30),
                groups=tuple(groups), world_size=rng.choice([1, 1, 2, 3]), lazy_offload=rng.random() < 0.25,
                max_num_batched_tokens=rng.choice([bs, 4 * bs, 64]))


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_random_configurations_agree(tmp_path: Path) -> None:
    tally = Tally()
    for seed in range(2 * TRACES):
        rng = random.Random(50_000 + seed)
        config = random_config(rng)
        ops = random_ops(config, rng, 200, num_families=rng.choice([1, 2, 3]), invalid_rate=0.03)
        d = run_side_by_side(config, ops, make_scheduler, _vllm_factory, tally)
        if d is not None:
            path = _write_failure(config, seed, ops, d, tmp_path, "random")
            pytest.fail(f"{config.to_json()}: operation {d.op_index} {d.op}: {d.what}\ntrace: {path}")
        tally.traces += 1
    print(f"\n[vllm conformance] random configurations: {tally.traces} traces, {tally.ops} operations in agreement")
    assert tally.ops == 2 * TRACES * 200


# -- the Hypothesis state machine: vLLM as target, the model as reference ---------------------------------


if VLLM_OK:
    from kvspec.drivers.harness import make_state_machine

    _VllmMachine = make_state_machine(_vllm_factory, reference=make_scheduler, policy="baseline",
                                      trace_dir=os.environ.get("KVSPEC_VLLM_TRACE_DIR"))
    # Hypothesis drives vLLM; after every step the snapshots must equal the model's and the
    # baseline's claimed invariants must hold. A failure is shrunk and written as a trace.
    TestVllmStateMachine = pytest.mark.vllm(_VllmMachine.TestCase)
    _VllmLazyMachine = make_state_machine(_vllm_factory, reference=make_scheduler, policy="baseline", lazy=True,
                                          trace_dir=os.environ.get("KVSPEC_VLLM_TRACE_DIR"))
    TestVllmLazyStateMachine = pytest.mark.vllm(_VllmLazyMachine.TestCase)


# -- the comparison can fail -----------------------------------------------------------------------


class _FlushFromZeroPolicy(BaselinePolicy):
    """Not vLLM: the finish flush scans each group from position 0 instead of the cursor."""

    def finish_flush(self, request: Any, block_ids: list[list[int]]) -> None:
        st = self.sched.reqs_to_store[request.request_id]
        saved = st.num_stored_blocks
        st.num_stored_blocks = [0] * len(saved)
        try:
            super().finish_flush(request, block_ids)
        finally:
            st.num_stored_blocks = saved


class _FlushFromZero(OffloadScheduler):
    def __init__(self, config: OffloadConfig, gpu_pool: Any) -> None:
        super().__init__(config, gpu_pool, _FlushFromZeroPolicy)


class _PinReleasedBackwards(OffloadScheduler):
    """Not vLLM: a Phase-A pin is released in reverse order (changes the CPU LRU order)."""

    def _free_pending_cpu_hit(self, pending: Any) -> None:
        self.cpu_pool.free_blocks(list(reversed([b for g in pending.blocks for b in g if b != 0])))


@pytest.mark.parametrize("variant", [_FlushFromZero, _PinReleasedBackwards])
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_a_model_that_is_not_vllm_is_caught(variant: type[OffloadScheduler]) -> None:
    """The side-by-side comparison is not vacuous: small departures from vLLM are found."""
    from kvspec.model.block_pool import BlockPool

    config = CONFIGS["full-ws1-bigcpu"]

    def reference(cfg: OffloadConfig) -> OffloadScheduler:
        return variant(cfg, BlockPool(cfg.num_gpu_blocks, "gpu"))

    found = None
    for seed in range(40):
        found = run_side_by_side(config, trace_for(config, seed), reference, _vllm_factory)
        if found is not None:
            break
    assert found is not None, f"{variant.__name__} agreed with vLLM on 40 traces"


# -- the hand-driven scenarios (T1-T8, vLLM's own tests) in lockstep ------------------------------------


_TARGET_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished_all_groups", "request_finished", "reset",
                 "has_pending_stores")
_POOL_CALLS = ("get_new_blocks", "touch", "free_blocks", "insert_block_hash", "reset_prefix_cache",
               "get_num_free_blocks", "get_cached_block", "get_one_block", "evict_blocks")


class LockstepDivergence(AssertionError):
    pass


class Lockstep:
    """The model and vLLM driven by the same direct calls; every call's outcome and the
    snapshots after it must agree. Everything else is read from the model."""

    def __init__(self, model: Any, vllm: Any) -> None:
        self._model, self._vllm = model, vllm
        self.calls = 0
        self.gpu_pool = _LockstepPool(self, "gpu_pool")
        self.cpu_pool = _LockstepPool(self, "cpu_pool")

    def __getattr__(self, name: str) -> Any:
        if name in _TARGET_CALLS:
            return lambda *a, **k: self._both(name, lambda t: getattr(t, name)(*a, **k))
        return getattr(self._model, name)

    def _both(self, what: str, call: Callable[[Any], Any]) -> Any:
        results = []
        for t in (self._model, self._vllm):
            try:
                results.append(("ok", call(t), None))
            except KVSpecError as exc:
                results.append(("rejected", type(exc).__name__, exc))
        (kind, value, exc), (v_kind, v_value, _) = results
        if (kind, value) != (v_kind, v_value):
            raise LockstepDivergence(f"{what}: model {kind} {value!r}, vLLM {v_kind} {v_value!r}")
        diff = first_difference(self._model.snapshot(), self._vllm.snapshot())
        if diff is not None:
            raise LockstepDivergence(f"after {what}: {diff}")
        self.calls += 1
        if exc is not None:
            raise exc
        return value


class _LockstepPool:
    def __init__(self, owner: Lockstep, which: str) -> None:
        self._owner, self._which = owner, which

    def __getattr__(self, name: str) -> Any:
        if name in _POOL_CALLS:
            return lambda *a, **k: self._owner._both(
                f"{self._which}.{name}", lambda t: getattr(getattr(t, self._which), name)(*a, **k))
        return getattr(getattr(self._owner._model, self._which), name)


def _scenario_cases() -> list[Any]:
    import importlib
    import inspect

    cases = []
    for modname in ("test_traces_t1_t8", "test_vllm_scenarios"):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name, fn in sorted(vars(mod).items()):
            if not name.startswith("test_") or not callable(fn) or not hasattr(mod, "make"):
                continue
            params = list(inspect.signature(fn).parameters)
            marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
            if not params:
                cases.append(pytest.param(modname, name, {}, id=f"{modname}::{name}"))
            elif len(marks) == 1 and [marks[0].args[0]] == params:
                for v in marks[0].args[1]:
                    cases.append(pytest.param(modname, name, {params[0]: v}, id=f"{modname}::{name}[{v}]"))
    return cases


@pytest.mark.parametrize(("modname", "name", "kwargs"), _scenario_cases())
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_hand_driven_scenarios_agree_call_by_call(modname: str, name: str, kwargs: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The worked traces T1-T8 and vLLM's own scheduler scenarios, run on the model and on
    vLLM at once: each direct call (scheduler and GPU pool) must agree, then the test's own
    assertions run as written."""
    import importlib

    mod = importlib.import_module(modname)
    made: list[Lockstep] = []

    def make(policy: str = "baseline", cpu: int = 5, gpu: int = 16, **kw: Any) -> Any:
        config = OffloadConfig(num_cpu_blocks=cpu, num_gpu_blocks=gpu, policy=policy, **kw)
        if policy != "baseline":
            return make_scheduler(config)
        made.append(Lockstep(make_scheduler(config), _vllm_factory(config)))
        return made[-1]

    monkeypatch.setattr(mod, "make", make)
    getattr(mod, name)(**kwargs)
    assert made and sum(s.calls for s in made) > 0


# -- the adapter itself ------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_vllm_target_is_registered_and_baseline_only() -> None:
    from kvspec.adapters.targets import get_factory
    from kvspec.contract.types import GpuPool, OffloadTarget

    target = get_factory("vllm")(CONFIGS["full-ws1"])
    assert isinstance(target, OffloadTarget)
    assert isinstance(target.gpu_pool, GpuPool)
    for policy in ("repair", "signal-rescan"):
        with pytest.raises(ConfigError, match="baseline"):
            get_factory("vllm")(replace(CONFIGS["full-ws1"], policy=policy))


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_a_free_queue_whose_links_loop_is_read_to_a_bound() -> None:
    """A block linked into vLLM's free queue twice (#42571, 0.19.1-0.23.0) can make the links
    loop, and vLLM's own walk of the queue never ends; kvspec's reading stops at its bound, and
    the snapshot then shows a queue longer than the pool (I1 fires) instead of eating memory."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    from kvspec.adapters.targets import get_factory
    from kvspec.adapters.vllm_compat import free_blocks_in
    from kvspec.oracle.catalogue import check

    blocks = [KVCacheBlock(block_id=i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in free_blocks_in(queue, 10)] == [0, 1, 2, 3]
    blocks[3].next_free_block = blocks[1]  # the tail's link points back into the queue
    assert [b.block_id for b in free_blocks_in(queue, 5)] == [0, 1, 2, 3, 1]
    target = get_factory("vllm")(CONFIGS["full-ws1"])
    pool = target.gpu_pool.pool
    last = pool.free_block_queue.fake_free_list_tail.prev_free_block
    last.next_free_block = pool.free_block_queue.fake_free_list_head.next_free_block.next_free_block
    found = [v for v in check(target.snapshot()) if v.id == "I1"]
    assert any("queued 2 times" in str(v) for v in found), found


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_vllm_snapshots_follow_the_snapshot_schema() -> None:
    from kvspec.contract.snapshot_io import snapshot_issues

    config = CONFIGS["full+sliding-ws1"]
    run = Run(config, _vllm_factory, ())
    for op in trace_for(config, 7, 120):
        assert run.apply(op) is None
        issues = snapshot_issues(run.snapshot)
        assert not issues, issues[:3]


@pytest.mark.parametrize("name", ["full-ws1", "full-ws2", "full+sliding-ws1"])
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_invariants_alone_find_the_stale_cursor_fixme_in_vllm(name: str) -> None:
    """No model as oracle: random traces on vLLM and the catalogue find C1 (the FIXME) by
    themselves, and the shrunk trace still shows it on vLLM."""
    from kvspec.adapters.vllm import baseline_oracle
    from kvspec.drivers.harness import fuzz_with_invariants

    config = CONFIGS[name]
    for seed in range(3):
        res = fuzz_with_invariants(config, seed=seed, max_traces=20)
        assert res.error is None, res.error
        assert res.found, f"seed {seed}: no violation in {res.ops} operations"
        assert res.violation.id == "C1", str(res.violation)
        assert res.shrunk_violation is not None and res.shrunk_violation.id == "C1"
        assert len(res.shrunk_ops) <= len(res.trace_ops)
        replayed = run_ops(config, res.shrunk_ops, _vllm_factory, baseline_oracle(config))
        assert replayed.violation is not None and replayed.violation.id == "C1", replayed.describe()
        print(f"\n[vllm fixme] {name} seed {seed}: {res.violation} after {res.ops} operations "
              f"({res.traces} trace(s)); shrunk to {len(res.shrunk_ops)} operations")


@pytest.mark.parametrize("name", ["full-ws1", "full+sliding-ws1", "lazy-full-ws1"])
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")
def test_vllm_keeps_what_the_baseline_claims(name: str) -> None:
    """Every invariant the baseline policy claims holds on vLLM along random traces."""
    from kvspec.drivers.harness import fuzz_with_invariants
    from kvspec.model.baseline import BaselinePolicy

    config = CONFIGS[name]
    res = fuzz_with_invariants(config, seed=11, max_traces=8, ops_per_trace=300,
                               oracle=BaselinePolicy.claims(config), shrink=False)
    assert res.error is None, res.error
    assert not res.found, f"{res.violation} at operation {len(res.trace_ops) - 1}: {res.trace_ops}"
    assert res.ops == 8 * 300


def test_without_vllm_the_target_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvspec works without vLLM; asking for the target then says how to get it."""
    import importlib.metadata

    from kvspec.adapters.vllm import make_vllm_target

    real_version = importlib.metadata.version

    def no_vllm(name: str) -> str:
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", no_vllm)
    installed_version.cache_clear()  # a version found earlier in this process is kept; a failure is not
    with pytest.raises(ConfigError, match=r"setup-vllm-venv\.sh"):
        make_vllm_target(CONFIGS["full-ws1"])


# -- the trace generator (no vLLM needed) ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["full-ws1", "full+sliding-ws1", "lazy-full-ws1"])
def test_random_ops_are_valid_and_reproducible(name: str) -> None:
    config = CONFIGS[name]
    ops = random_ops(config, random.Random(5), 250, invalid_rate=0.05)
    assert ops == random_ops(config, random.Random(5), 250, invalid_rate=0.05)
    assert ops != random_ops(config, random.Random(6), 250, invalid_rate=0.05)
    out = run_ops(config, ops, make_scheduler, ())  # each accepted, or rejected where it says "expect": "error"
    assert not out.failed, out.describe()
    assert out.rejected == sum(op.get("expect") == "error" for op in ops) > 0
    assert {"add", "step", "report", "finish"} <= {op["op"] for op in ops}
    assert trace_io.loads(Trace(config, ops).dumps()).ops == ops  # every operation can be written in a trace


def test_random_ops_reach_every_phase() -> None:
    """Across a few traces: preemption with both resume styles, loads, finishes in every phase."""
    config = CONFIGS["full-ws1-bigcpu"]
    seen: set[str] = set()
    for seed in range(12):
        run = Run(config, make_scheduler, ())
        for op in trace_for(config, seed):
            if op["op"] == "finish" and op.get("expect") != "error":
                seen.add("finish " + run.engine.requests[op["rid"]].status)
            if op["op"] == "step" and op.get("preempt"):
                seen.add("preempt " + op.get("resume", "mrv1"))
            assert run.apply(op) is None
            if op["op"] == "load_done":
                seen.add("load_done")
            if op["op"] == "reset":
                seen.add("reset")
    want = {"finish waiting", "finish running", "finish waiting_for_remote_kvs", "finish loaded",
            "finish preempted", "preempt mrv1", "preempt mrv2", "load_done", "reset"}
    assert want <= seen, want - seen
