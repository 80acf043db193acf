"""The connector model (kvspec.model.offloading.connector) on its own, no vLLM: a store, a
finish, a load and a delayed lookup by hand with ``_check()`` after every call, and refusals
that change nothing."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvspec.contract.errors import ConfigError, InvalidOperationError
from kvspec.contract.offloading import OffloadingConfig
from kvspec.model.offloading.connector import (
    ConnectorModelConfig,
    OffloadingConnectorModel,
    ReqView,
    StepInput,
)
from kvspec.model.offloading.manager import snapshot_of


def _model(**kw: Any) -> OffloadingConnectorModel:
    return OffloadingConnectorModel(ConnectorModelConfig(block_size=2, manager=OffloadingConfig(num_chunks=4), **kw))


def _state(m: OffloadingConnectorModel) -> Any:
    """Everything the model holds, as comparable values."""
    rest = {k: copy.deepcopy(v) for k, v in vars(m).items() if k not in ("manager", "config")}
    return snapshot_of(m.manager), rest


def _checked(m: OffloadingConnectorModel, value: Any = None) -> Any:
    m._check()
    return value


def _r0(m: OffloadingConnectorModel) -> ReqView:
    """r0 (prompt of 5 tokens: two full blocks) stored by its first step and reported done."""
    v = ReqView("r0", ("h0", "h1"), 5, 5, 0)
    m.on_new_request(v)
    _checked(m)
    assert _checked(m, m.get_num_new_matched_tokens(v, 0)) == (0, False)
    m.update_state_after_alloc(v, [[(1, False), (2, False), (3, False)]], 0)
    _checked(m)
    meta = _checked(m, m.build_connector_meta(StepInput((("r0", ((1, 2, 3),), True),), (("r0", 5),)), {"r0": v}))
    (job,) = meta.store_jobs.values()
    assert (job.kind, job.gpu, job.group_sizes, job.chunks) == ("store", (1, 2), (1 * 2,), (0, 1))
    assert job.keys == {("h0", 0), ("h1", 0)} and not meta.load_jobs and not meta.jobs_to_flush
    assert snapshot_of(m.manager)["chunks"]["h0:0"]["ref_cnt"] == -1  # being stored
    m.update_connector_output({0: 1}, {"r0": v})
    _checked(m)
    assert snapshot_of(m.manager)["chunks"]["h0:0"]["ref_cnt"] == 0
    return v


def test_store_finish_load_and_a_delayed_lookup_keep_the_invariants() -> None:
    m = _model()
    _r0(m)
    done = ReqView("r0", ("h0", "h1"), 6, 5, 5, finished=True)
    assert _checked(m, m.request_finished(done)) == (False, None)
    meta = _checked(m, m.build_connector_meta(StepInput(finished=("r0",)), {"r0": done}))
    assert not meta.store_jobs and "r0" not in m.reqs  # nothing left to store: forgotten
    v1 = ReqView("r1", ("h0", "h1", "x2"), 7, 7, 0)
    m.on_new_request(v1)
    _checked(m)
    assert _checked(m, m.get_num_new_matched_tokens(v1, 0)) == (4, True)  # two chunks, loaded async
    m.update_state_after_alloc(v1, [[(4, False), (5, False), (6, False), (7, False)]], 4)
    _checked(m)
    v2 = ReqView("r2", ("h0", "h1"), 5, 5, 0)
    m.on_new_request(v2)
    _checked(m)
    assert _checked(m, m.get_num_new_matched_tokens(v2, 0)) == (None, False)  # its chunks are being loaded
    meta = _checked(m, m.build_connector_meta(StepInput((("r1", ((4, 5, 6, 7),), True),), (("r1", 3),)),
                                              {"r1": v1, "r2": v2}))
    (load,) = meta.load_jobs.values()
    assert (load.kind, load.req, load.gpu, load.chunks) == ("load", "r1", (4, 5), (0, 1))
    assert snapshot_of(m.manager)["chunks"]["h1:0"]["ref_cnt"] == 1
    m.update_connector_output({1: 1}, {"r1": v1, "r2": v2})
    _checked(m)
    assert _checked(m, m.get_num_new_matched_tokens(v2, 0)) == (4, True)  # loaded: no longer delayed


def test_a_preempted_request_flushes_its_store_and_a_reset_flushes_everything() -> None:
    m = _model()
    v = ReqView("r0", ("h0", "h1"), 5, 5, 0)
    m.on_new_request(v)
    m.get_num_new_matched_tokens(v, 0)
    m.build_connector_meta(StepInput((("r0", ((1, 2, 3),), True),), (("r0", 5),)), {"r0": v})
    meta = _checked(m, m.build_connector_meta(StepInput(preempted=("r0",)), {"r0": v}))
    assert meta.jobs_to_flush == {0}
    m.reset_cache({"r0": v})
    _checked(m)
    assert m.jobs == {} and m.reset_fence == {0: 1} and m.reqs["r0"].groups[0].next_stored == 0
    meta = _checked(m, m.build_connector_meta(StepInput(), {"r0": v}))
    assert meta.jobs_to_flush == {0}
    m.update_connector_output({0: 1}, {"r0": v})  # a stale report: only the fence counts down
    _checked(m)
    assert m.reset_fence == {} and snapshot_of(m.manager)["chunks"] == {}


@pytest.mark.parametrize("feature, kw", [
    ("recurrent", {"recurrent_groups": 1}), ("EAGLE", {"eagle": True}), ("tiering", {"tiering": True}),
    ("decode context parallelism", {"dcp_world_size": 2}), ("canonical layout", {"canonical_layout": True}),
    ("sync_load_budget_bytes", {"sync_load_budget_bytes": 1 << 20}),
    ("retention_interval", {"retention_interval": None}), ("retention_interval", {"retention_interval": 8}),
    ("blocks_per_chunk > 1", {"sliding_window": 4, "blocks_per_chunk": 2}),
])
def test_features_not_modelled_are_refused_by_name(feature: str, kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=feature):
        _model(**kw)


def test_blocks_per_chunk_without_a_window_is_modelled() -> None:
    m = _model(blocks_per_chunk=2)
    v = ReqView("r0", ("h0", "h1", "h2", "h3"), 9, 9, 0)
    m.on_new_request(v)
    m.get_num_new_matched_tokens(v, 0)
    meta = _checked(m, m.build_connector_meta(StepInput((("r0", ((1, 2, 3, 4, 5),), True),), (("r0", 9),)),
                                              {"r0": v}))
    (job,) = meta.store_jobs.values()
    assert job.keys == {("h1", 0), ("h3", 0)} and job.gpu == (1, 2, 3, 4)  # a chunk is keyed by its last block


@pytest.mark.parametrize("param", ["max_load_tokens", "max_offload_tokens", "kv_load_tiers"])
def test_a_request_asking_for_a_feature_not_modelled_is_refused_and_changes_nothing(param: str) -> None:
    m = _model()
    _r0(m)
    before = _state(m)
    with pytest.raises(ConfigError, match=param):
        m.on_new_request(ReqView("r1", ("h0",), 3, 3, 0, kv_transfer_params={param: 2}))
    assert _state(m) == before
    _checked(m)


def test_a_second_reset_before_a_step_is_refused_and_changes_nothing() -> None:
    """vLLM asserts there (tests/test_vllm_offloading_connector.py shows the crash); the model
    refuses it."""
    m = _model()
    v = ReqView("r0", ("h0", "h1"), 5, 5, 0)
    m.on_new_request(v)
    m.get_num_new_matched_tokens(v, 0)
    m.build_connector_meta(StepInput((("r0", ((1, 2, 3),), True),), (("r0", 5),)), {"r0": v})
    m.reset_cache({"r0": v})
    before = _state(m)
    with pytest.raises(InvalidOperationError):
        m.reset_cache({"r0": v})
    assert _state(m) == before
    _checked(m)


def test_after_a_reset_a_stale_sliding_window_block_is_stored_as_vllm_does() -> None:
    """0.33.0's rule, kept as vLLM has it (tests/traces/connector_findings/ shows vLLM doing it):
    a sliding-window block freed and handed back to the request at a later position is zeroed
    in the block list only from the store cursor on; a reset puts the cursor back to 0, so the
    stale entry is stored under the key of its old position."""
    m = _model(sliding_window=4)
    v = ReqView("r0", ("a", "b"), 4, 4, 0)
    m.on_new_request(v)
    m.get_num_new_matched_tokens(v, 0)
    meta = m.build_connector_meta(StepInput((("r0", ((1, 2), (3, 4)), True),), (("r0", 4),)), {"r0": v})
    (job,) = meta.store_jobs.values()
    assert job.gpu == (1, 2, 3) and job.keys == {("a", 0), ("b", 0), ("a", 1)}  # window chunk 0 only
    m.update_connector_output({0: 1}, {"r0": v})
    v = ReqView("r0", ("a", "b"), 5, 4, 4)
    _checked(m, m.build_connector_meta(StepInput((("r0", ((5,), (3,)), False),), (("r0", 1),)), {"r0": v}))
    assert m.reqs["r0"].groups[1].block_ids == [3, 4, 3]  # position 0's entry is stale, not zeroed
    m.reset_cache({"r0": v})
    _checked(m)
    v = ReqView("r0", ("a", "b"), 6, 4, 5)
    meta = _checked(m, m.build_connector_meta(StepInput((("r0", None, False),), (("r0", 1),)), {"r0": v}))
    (job,) = meta.store_jobs.values()
    assert job.gpu == (1, 2, 3) and ("a", 1) in job.keys  # block 3 now holds position 2
