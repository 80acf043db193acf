"""The implementation against the model: random engine traces, snapshot equality after every op.

Each trace (``kvspec.drivers.tracegen.random_ops``, seeded, some operations deliberately invalid)
runs on ``Engine(model)`` and ``Engine(impl)`` side by side. After every operation both
must have raised the same ``KVSpecError`` subclass or neither, and ``engine.snapshot()``
(both pools, the scheduler, the engine's view) must be equal, and the implementation's
``_check()`` (every structure's own invariants) must hold. After every completed
load and store the implementation's payload tensors must hold the data the engine's
content model says was copied (data fidelity). Direct calls with bad input are the error
contract's (tests/contract_kit.py, run on both by tests/test_errors.py).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import KVSpecError
from kvspec.drivers import trace as trace_io
from kvspec.drivers.engine import Engine
from kvspec.drivers.harness import replay
from kvspec.drivers.tracegen import random_ops
from kvspec.impl import make_scheduler as make_impl
from kvspec.impl.payload import expected_payload
from kvspec.model import make_scheduler as make_model

N_OPS = 140

BASE = OffloadConfig(block_size=4, num_gpu_blocks=24, num_cpu_blocks=8, max_num_batched_tokens=16)
CONFIGS: dict[str, OffloadConfig] = {}
for _policy in ("baseline", "signal-rescan", "repair"):
    CONFIGS[f"full-{_policy}"] = replace(BASE, policy=_policy)
    CONFIGS[f"sliding-{_policy}"] = replace(BASE, num_gpu_blocks=32, num_cpu_blocks=10, policy=_policy,
                                            groups=(KVGroup(), KVGroup("sliding", 6)))
    CONFIGS[f"ws2-{_policy}"] = replace(BASE, num_cpu_blocks=6, world_size=2, policy=_policy)
    CONFIGS[f"loads-{_policy}"] = replace(BASE, num_gpu_blocks=12, num_cpu_blocks=16, policy=_policy)
CONFIGS["loads-sliding-repair"] = replace(BASE, num_gpu_blocks=16, num_cpu_blocks=16, policy="repair",
                                          groups=(KVGroup(), KVGroup("sliding", 6)))
for _name in [n for n in CONFIGS if n.startswith("loads-")]:  # the rest are async only (the default)
    CONFIGS[f"{_name}-sync"] = replace(CONFIGS[_name], async_scheduling=False)
CONFIGS["lazy-baseline"] = replace(BASE, lazy_offload=True, policy="baseline")
CONFIGS["lazy-sliding-baseline"] = replace(BASE, lazy_offload=True, policy="baseline", num_gpu_blocks=32,
                                           groups=(KVGroup(), KVGroup("sliding", 6)))
SEEDS = (0, 1, 2)


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}.{k}: present on one side only"
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        if list(a) != list(b):
            return f"{path}: key order {list(a)} vs {list(b)}"
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def _apply(engine: Engine, op: dict[str, Any]) -> type | None:
    try:
        engine.apply(op)
    except KVSpecError as exc:
        return type(exc)
    return None


def _check_payload(impl_engine: Engine, before: dict[str, Any], op: dict[str, Any]) -> tuple[int, int]:
    """(loaded, stored) blocks whose copied payload was compared after a completed load or store."""
    target = impl_engine.target
    loaded = stored = 0
    sched = before["scheduler"]
    if op["op"] == "load_done":
        load = sched["reqs_to_load"].get(op["rid"]) or sched["abandoned_reqs_to_load"].get(op["rid"])
        for g in load["gpu"] if load else ():
            data = impl_engine.gpu_data[g]
            if data is not None:
                assert torch.equal(target.payload.gpu[g], expected_payload(data)), f"load into GPU block {g}"
                loaded += 1
    if op["op"] == "report" and str(op["event"]) in sched["store_events"] \
            and op["event"] not in impl_engine.reports_left:
        for c in sched["store_events"][str(op["event"])]["cpu"]:
            data = impl_engine.cpu_data[c]
            if data is not None:
                assert torch.equal(target.payload.cpu[c], expected_payload(data)), f"store into CPU block {c}"
                stored += 1
    return loaded, stored


def run_side_by_side(config: OffloadConfig, seed: int, n_ops: int = N_OPS) -> dict[str, int]:
    ops = random_ops(config, random.Random(seed), n_ops, invalid_rate=0.05)
    model, impl = Engine(make_model(config)), Engine(make_impl(config))
    stats = {"ops": 0, "rejected": 0, "loaded_blocks": 0, "stored_blocks": 0}
    for i, op in enumerate(ops):
        before = impl.target.snapshot()
        err_model, err_impl = _apply(model, op), _apply(impl, op)
        assert err_model is err_impl, f"op {i} {op}: model raised {err_model}, impl raised {err_impl}"
        diff = first_difference(model.snapshot(), impl.snapshot())
        assert diff is None, f"op {i} {op}: snapshots differ at {diff}"
        impl.target._check()  # every structure's own invariants
        stats["ops"] += 1
        if err_model is not None:
            stats["rejected"] += 1
            continue
        loaded, stored = _check_payload(impl, before, op)
        stats["loaded_blocks"] += loaded
        stats["stored_blocks"] += stored
    return stats


@pytest.mark.parametrize("seeds", [SEEDS[:1], pytest.param(SEEDS[1:], marks=pytest.mark.deep)],
                         ids=["seed0", "more-seeds"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_traces_agree(name: str, seeds: tuple[int, ...]) -> None:
    """Random traces of every configuration agree (one seed in the default run, two more ``deep``)."""
    config = CONFIGS[name]
    totals = {"ops": 0, "rejected": 0, "loaded_blocks": 0, "stored_blocks": 0}
    for seed in seeds:
        for k, v in run_side_by_side(config, seed).items():
            totals[k] += v
    assert totals["ops"] == N_OPS * len(seeds)
    assert totals["rejected"] > 0  # the traces did exercise rejection


def test_payload_fidelity_is_exercised() -> None:
    """Loads and stores complete in these traces, under either scheduling, so the payload checks
    above compare data."""
    for name in ("loads-repair", "loads-repair-sync"):
        totals = {"loaded_blocks": 0, "stored_blocks": 0}
        for seed in (7, 8, 9):
            stats = run_side_by_side(CONFIGS[name], seed, 200)
            for key in totals:
                totals[key] += stats[key]
        assert totals["loaded_blocks"] > 0 and totals["stored_blocks"] > 0, (name, totals)


@pytest.mark.parametrize("name", ["full-repair", "sliding-repair"])
def test_the_hash_id_copy_path_agrees(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The traces here are small, so the repair scan looks the few new positions' hash ids up one by
    one; with the threshold at 0 the same traces go through the copied hash-id table instead."""
    from kvspec.impl import request_table

    monkeypatch.setattr(request_table, "FEW_SHORT", 0)
    for seed in SEEDS:
        run_side_by_side(CONFIGS[name], seed)


def test_a_divergent_implementation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: an implementation whose cursors never move disagrees."""
    from kvspec.impl.request_table import StoreTable

    monkeypatch.setattr(StoreTable, "reset_rows", lambda self, slots, cursors_too: None)
    with pytest.raises(AssertionError, match="snapshots differ"):
        for seed in SEEDS:
            run_side_by_side(CONFIGS["full-baseline"], seed)


def test_the_registry_names_the_implementation_policies() -> None:
    """Each ``POLICY_REGISTRY`` entry's ``impl`` names a class implementing ``StorePolicy`` under the
    entry's name, and it is the class the scheduler builds for that policy."""
    import importlib

    from kvspec.contract.policy import POLICY_REGISTRY, StorePolicy

    for name, entry in POLICY_REGISTRY.items():
        module, _, attribute = entry.impl.partition(":")
        policy_class = getattr(importlib.import_module(module), attribute)
        assert isinstance(policy_class, type) and StorePolicy in policy_class.__mro__, entry.impl
        assert policy_class.name == name, entry.impl
        assert type(make_impl(replace(BASE, policy=name)).policy) is policy_class, entry.impl


def test_a_structure_broken_out_of_sight_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-check is not vacuous: an in-flight mirror that forgets its tensor side keeps every
    snapshot equal to the model's, and ``_check`` fails."""
    from kvspec.impl.repair.in_flight import InFlightKeys

    def dict_only(self: InFlightKeys, kids: torch.Tensor) -> None:
        for k in kids.tolist():
            self._counts[k] = self._counts.get(k, 0) + 1

    monkeypatch.setattr(InFlightKeys, "add", dict_only)
    with pytest.raises(AssertionError, match="in-flight keys: the tensor and the dict disagree"):
        run_side_by_side(CONFIGS["full-repair"], 0)


def test_a_wrong_copy_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Data fidelity can fail: loads that copy from the wrong CPU block are detected."""
    from kvspec.impl.payload import PayloadStore

    original = PayloadStore.load

    def corrupting(self: PayloadStore, gpu_ids: torch.Tensor, cpu_ids: torch.Tensor) -> None:
        original(self, gpu_ids, cpu_ids)
        self.gpu[gpu_ids] = self.gpu[gpu_ids] + 1.0

    monkeypatch.setattr(PayloadStore, "load", corrupting)
    with pytest.raises(AssertionError, match="load into GPU block"):
        for seed in range(6):
            run_side_by_side(CONFIGS["loads-repair"], seed, 200)


# -- the GPU pool face ----------------------------------------------------------------------------


def test_gpu_pool_face_matches_the_model() -> None:
    """The pool operations the engine and the harness call directly, with good and bad input."""
    model_pool = make_model(BASE).gpu_pool
    impl_pool = make_impl(BASE).gpu_pool
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("get_new_blocks", (3,)), ("insert_block_hash", (("x", 0), 1)), ("insert_block_hash", (("y", 0), 2)),
        ("insert_block_hash", (("x", 0), 3)), ("free_blocks", ([3, 1],)), ("touch", ([1],)),
        ("free_blocks", ([1, 1],)), ("free_blocks", ([0],)), ("touch", ([99],)), ("get_new_blocks", (99,)),
        ("insert_block_hash", (("z", 0), 2)), ("insert_block_hash", (("odd", 7), 2)), ("free_blocks", ([2, 1],)),
        ("get_new_blocks", (2,)), ("reset_prefix_cache", ()), ("get_cached_block", ("x", [0])),
        ("get_new_blocks", (-1,)),
    ]
    for name, args in calls:
        results = []
        for pool in (model_pool, impl_pool):
            try:
                results.append(("ok", getattr(pool, name)(*args)))
            except KVSpecError as exc:
                results.append(("err", type(exc)))
        assert results[0] == results[1], f"{name}{args}: {results}"
        assert model_pool.snapshot() == impl_pool.snapshot(), f"after {name}{args}"
        assert [model_pool.block_hash[b] for b in range(BASE.num_gpu_blocks)] == \
            [impl_pool.block_hash[b] for b in range(BASE.num_gpu_blocks)]
        assert list(model_pool.ref_cnt) == list(impl_pool.ref_cnt)


IMPL_TRACES = sorted((Path(__file__).parent / "traces" / "impl").glob("*.jsonl"))


def test_impl_regression_traces_are_shipped() -> None:
    assert IMPL_TRACES, "tests/traces/impl/ holds the implementation's regression traces"


@pytest.mark.parametrize("path", IMPL_TRACES, ids=lambda p: p.stem)
def test_impl_regression_trace_is_clean_and_agrees_with_the_model(path: Path) -> None:
    """Traces the fuzzer shrank against broken forms of the implementation (each header's note says
    which): clean on the implementation under the recorded oracle, and its snapshots equal the
    model's after every operation."""
    tr = trace_io.read(path)
    assert tr.target == "impl" and tr.finding is None and tr.oracle
    out = replay(tr, make_impl, tr.oracle, reference=make_model)
    assert not out.failed, out.describe()
