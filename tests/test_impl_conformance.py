"""The implementation against the model: random engine traces, snapshot equality after every op.

Each trace (``kvspec.drivers.tracegen.random_ops``, seeded, some operations deliberately invalid)
runs on ``Engine(model)`` and ``Engine(impl)`` side by side. After every operation both
must have raised the same ``KVSpecError`` subclass or neither, and ``engine.snapshot()``
(both pools, the scheduler, the engine's view) must be equal. After every completed
load and store the implementation's payload tensors must hold the data the engine's
content model says was copied (data fidelity). Direct calls with bad input must be
rejected alike, with the snapshot unchanged.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import KVSpecError
from kvspec.contract.types import CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput
from kvspec.drivers.engine import Engine
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
        stats["ops"] += 1
        if err_model is not None:
            stats["rejected"] += 1
            continue
        loaded, stored = _check_payload(impl, before, op)
        stats["loaded_blocks"] += loaded
        stats["stored_blocks"] += stored
    return stats


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_traces_agree(name: str) -> None:
    config = CONFIGS[name]
    totals = {"ops": 0, "rejected": 0, "loaded_blocks": 0, "stored_blocks": 0}
    for seed in SEEDS:
        for k, v in run_side_by_side(config, seed).items():
            totals[k] += v
    assert totals["ops"] == N_OPS * len(SEEDS)
    assert totals["rejected"] > 0  # the traces did exercise rejection


def test_payload_fidelity_is_exercised() -> None:
    """Loads and stores complete in these traces, so the payload checks above compare data."""
    stats = run_side_by_side(CONFIGS["loads-repair"], 7, 200)
    assert stats["loaded_blocks"] > 0 and stats["stored_blocks"] > 0, stats


def test_a_divergent_implementation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: an implementation whose cursors never move disagrees."""
    from kvspec.impl.request_table import StoreTable

    monkeypatch.setattr(StoreTable, "reset_rows", lambda self, slots, cursors_too: None)
    with pytest.raises(AssertionError, match="snapshots differ"):
        for seed in SEEDS:
            run_side_by_side(CONFIGS["full-baseline"], seed)


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


# -- direct calls with bad input ------------------------------------------------------------------


class _Req:
    def __init__(self, rid: str, hashes: list[str], num_tokens: int) -> None:
        self.request_id = rid
        self.block_hashes = hashes
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.skip_reading_prefix_cache = False
        self._n = num_tokens

    @property
    def num_tokens(self) -> int:
        return self._n


def _bad_calls() -> list[tuple[str, Any]]:
    r = _Req("a", ["h0", "h1"], 9)
    return [
        ("update_state_after_alloc", (r, ([1, 99],), 0)),
        ("update_state_after_alloc", (r, ([1, True],), 0)),
        ("update_state_after_alloc", (r, ([1, 2], [3]), 0)),
        ("update_state_after_alloc", (r, (None,), 0)),
        ("update_state_after_alloc", (r, ([1, 2],), -4)),
        ("get_num_new_matched_tokens", (r, 99)),
        ("build_connector_meta", (SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", ([1, 500],))]),)),
        ("build_connector_meta", (SchedulerOutput(num_scheduled_tokens={"a": -1}),)),
        ("build_connector_meta", (SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [])),)),
        ("update_connector_output", (KVConnectorOutput(finished_recving={"nobody"}),)),
        ("update_connector_output", (KVConnectorOutput(completed_store_events={5: 1}),)),
        ("request_finished_all_groups", (r, ([1, -1],))),
        ("request_finished_all_groups", (r, ([1], [2]))),
    ]


@pytest.mark.parametrize("policy", ["baseline", "repair"])
def test_bad_direct_calls_rejected_alike(policy: str) -> None:
    config = replace(BASE, policy=policy)
    for method, args in _bad_calls():
        outcomes = []
        for target in (make_model(config), make_impl(config)):
            before = target.snapshot()
            try:
                getattr(target, method)(*args)
                outcomes.append(None)
            except KVSpecError as exc:
                outcomes.append(type(exc))
            assert target.snapshot() == before, f"{method}{args}: state changed by a rejected call"
        assert outcomes[0] is not None, f"{method}{args}: the model accepted it"
        assert outcomes[0] is outcomes[1], f"{method}{args}: model {outcomes[0]}, impl {outcomes[1]}"


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
