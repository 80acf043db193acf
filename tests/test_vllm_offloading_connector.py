"""vLLM 0.33.0's real scheduler with the real OffloadingConnector (scheduler role), judged by
O11-O15 (kvspec/adapters/vllm_offloading_connector.py). The break-on-purpose tests mutate a
real snapshot by hand; they and the driver tests need the vLLM venv."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvspec.adapters.vllm_offloading_connector import connector_driver_available
from kvspec.oracle.catalogue import OFFLOADING_CATALOGUE, check

VLLM_OK, VLLM_WHY = connector_driver_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")]

PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def _scheduler(async_scheduling: bool = False, num_gpu_blocks: int = 16, **kw: Any) -> Any:
    from kvspec.adapters.vllm_offloading_connector import ConnectorConfig, VllmConnectorScheduler
    from kvspec.adapters.vllm_scheduler import SchedulerOptions

    return VllmConnectorScheduler(ConnectorConfig(num_gpu_blocks=num_gpu_blocks, **kw),
                                  SchedulerOptions(async_scheduling=async_scheduling, auto_finish=True),
                                  lambda rid, n: 50 + n % 3)


def _step(s: Any) -> dict[str, Any]:
    s.step([r.request_id for r in s.scheduler.waiting], 64, [], "mrv1")
    snap = s.step_snapshot
    assert snap is not None
    return dict(snap)


def _store_then_load() -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """r0 stores its prompt, finishes; r1 fills the GPU pool so r0's blocks are evicted; r2
    (r0's prefix) then loads from the CPU. The step snapshots of the store and of the load."""
    s = _scheduler(num_gpu_blocks=8, num_chunks=10)
    s.add_request("r0", [*PREFIX, 30], 1)
    store_snap = _step(s)
    assert [j["kind"] for j in store_snap["connector"]["jobs"].values()] == ["store"]
    s.finish_jobs(list(s.jobs))
    for _ in range(3):
        _step(s)
    s.add_request("r1", [40 + i for i in range(26)], 1)
    while s.scheduler.has_requests():
        s.finish_jobs(list(s.jobs))
        _step(s)
    s.add_request("r2", [*PREFIX, 31], 1)
    load_snap = _step(s)
    return s, store_snap, load_snap


def test_construction_is_vllms_own_connector_and_manager() -> None:
    s = _scheduler(num_chunks=5, eviction_policy="arc")
    assert type(s.scheduler.connector).__name__ == "OffloadingConnector"
    assert type(s.offload_manager).__name__ == "CPUOffloadingManager"
    assert s.offload_manager._num_chunks == 5
    snap = s.snapshot()
    assert snap["manager"] == "offloading" and "arc" in snap["policy"]
    assert check(snap) == []


def test_store_and_load_are_observed_and_clean() -> None:
    s, store_snap, load_snap = _store_then_load()
    (store,) = store_snap["connector"]["jobs"].values()
    assert store["req"] == "r0" and len(store["gpu"]) == 3 and None not in store["keys"]
    assert check(store_snap) == []
    loads = [j for j in load_snap["connector"]["jobs"].values() if j["kind"] == "load"]
    assert [j["req"] for j in loads] == ["r2"]
    assert sorted(loads[0]["keys"]) == sorted(store["keys"])  # r2 loads what r0 stored
    assert check(load_snap) == []
    assert s.phase("r2").status == "WAITING_FOR_REMOTE_KVS"
    s.finish_jobs(list(s.jobs))
    for _ in range(4):
        _step(s)
    assert s.requests["r2"].is_finished()
    assert check(s.snapshot()) == []


def _ids(snap: dict[str, Any]) -> set[str]:
    return {v.id for v in check(snap)}


def test_o11_fires_on_a_store_source_handed_out_unflushed() -> None:
    _, store_snap, _ = _store_then_load()
    snap = copy.deepcopy(store_snap)
    (jid, job), = snap["connector"]["jobs"].items()
    snap["connector"]["step"] = job["issued"] + 1  # a later step hands a source block to r9
    snap["connector"]["fresh"] = {str(job["gpu"][0]): ["r9"]}
    assert "O11" in _ids(snap)
    snap["connector"]["flush"] = [int(jid)]
    snap["connector"]["jobs"][jid]["flushed"] = job["issued"] + 1  # flushed in that step: fine
    assert "O11" not in _ids(snap)


def test_o12_fires_on_a_load_into_a_foreign_or_freed_block() -> None:
    _, _, load_snap = _store_then_load()
    snap = copy.deepcopy(load_snap)
    _jid, job = next((j, x) for j, x in snap["connector"]["jobs"].items() if x["kind"] == "load")
    block = job["gpu"][0]
    snap["connector"]["requests"]["r9"] = {"finished": False, "table": [[block]], "positions": {}, "hashes": []}
    assert "O12" in _ids(snap)
    snap = copy.deepcopy(load_snap)
    snap["connector"]["gpu_refs"][block] = 0
    assert "O12" in _ids(snap)


def test_o13_fires_on_a_chunk_without_a_key() -> None:
    _, store_snap, _ = _store_then_load()
    snap = copy.deepcopy(store_snap)
    next(iter(snap["connector"]["jobs"].values()))["keys"][0] = None
    assert "O13" in _ids(snap)


def test_o14_fires_on_a_store_under_the_wrong_key() -> None:
    _, store_snap, _ = _store_then_load()
    snap = copy.deepcopy(store_snap)
    job = next(iter(snap["connector"]["jobs"].values()))
    job["keys"][0], job["keys"][1] = job["keys"][1], job["keys"][0]  # same keys, other order: fine
    assert "O14" not in _ids(snap)
    job["keys"][0] = "0123456789abcdef:0"
    assert "O14" in _ids(snap)


def test_o15_fires_on_a_misplaced_load_and_an_unflushed_reset() -> None:
    _, _, load_snap = _store_then_load()
    snap = copy.deepcopy(load_snap)
    job = next(x for x in snap["connector"]["jobs"].values() if x["kind"] == "load")
    job["keys"][0] = "0123456789abcdef:0"
    assert "O15" in _ids(snap)
    snap = copy.deepcopy(load_snap)
    snap["connector"]["reset_unflushed"] = [999]
    assert "O15" in _ids(snap)


def test_reset_flushes_jobs_in_flight() -> None:
    s = _scheduler(async_scheduling=True)
    s.add_request("r0", [*PREFIX, 30], 2)
    _step(s)
    assert s.jobs and s.reset() is False  # r0 still holds GPU blocks; the connector resets anyway
    snap = _step(s)
    assert snap["connector"]["reset_unflushed"] and set(snap["connector"]["reset_unflushed"]) <= set(
        snap["connector"]["flush"])
    assert check(snap) == []


def test_a_short_campaign_is_clean_but_for_the_double_reset() -> None:
    """Both schedulers; the one finding kind known in 0.33.0 is the crash of two cache resets
    without a schedule() between them while jobs are in flight (see the report)."""
    from kvspec.drivers.offloading_connector_fuzz import ConnectorConfig, run_trace

    results = [run_trace(ConnectorConfig(num_gpu_blocks=10, num_chunks=4, eviction_policy=p), a, seed, 40)
               for seed, (p, a) in enumerate([("lru", False), ("arc", True), ("lru", True), ("arc", False)])]
    assert sum(r.steps for r in results) > 20
    for r in results:
        assert r.finding is None or "_current_batch_jobs_to_flush" in "\n".join(r.finding["violations"]), r.finding


def test_connector_invariants_are_registered() -> None:
    for id_ in ("O11", "O12", "O13", "O14", "O15"):
        inv = OFFLOADING_CATALOGUE[id_]
        assert inv.needs_engine and inv.manager == "offloading"


def test_vllm_crashes_on_two_connector_resets_without_a_step_between() -> None:
    """The crash the campaigns find in vLLM 0.33.0: the first reset leaves every job in flight
    queued for flushing (``_current_batch_jobs_to_flush``, emptied only by the next
    ``build_connector_meta``); a second reset before the next ``schedule()`` trips the connector's
    ``assert not self._current_batch_jobs_to_flush``. Two reset requests queued at the engine core
    are handled back to back, with no step between."""
    s = _scheduler(async_scheduling=False)
    s.add_request("r0", [*PREFIX, 30], 2)
    _step(s)
    assert s.jobs
    s.reset()
    with pytest.raises(AssertionError) as raised:
        s.reset()
    where = raised.traceback[-1]
    assert where.path.name == "scheduler.py" and "offloading" in str(where.path)
    assert "_current_batch_jobs_to_flush" in str(where.statement)


def test_a_trace_replays_from_its_operations_and_shrinks() -> None:
    """A drawn trace's recorded operations replay to the same finding (or none), and shrinking
    keeps the finding's signature with fewer operations: the double reset, built by hand."""
    from kvspec.drivers.offloading_connector_fuzz import ConnectorConfig, run_ops, run_trace, shrink, signature

    config = ConnectorConfig(num_gpu_blocks=10, num_chunks=4, sliding_window=8)
    drawn = run_trace(config, True, 5, 40, "window")
    assert signature(run_ops(config, True, drawn.ops, "window").finding) == signature(drawn.finding)
    ops = [{"op": "add", "rid": "r0", "prompt": [*PREFIX, 30], "max_tokens": 2},
           {"op": "add", "rid": "r1", "prompt": [40, 41, 42], "max_tokens": 1},
           {"op": "step", "chunk": 64}, {"op": "work", "req": "r1", "kind": "load"},
           {"op": "reset"}, {"op": "reset"}]
    full = run_ops(ConnectorConfig(), False, ops)
    wanted = signature(full.finding)
    assert wanted is not None and "_current_batch_jobs_to_flush" in wanted
    shrunk, best = shrink(ConnectorConfig(), False, ops, wanted)
    assert signature(best.finding) == wanted and len(shrunk) < len(ops)
    assert [o["op"] for o in shrunk][-2:] == ["reset", "reset"]


def test_a_job_is_reported_only_on_a_batch_from_its_step_on() -> None:
    """Under async scheduling the output of batch N-1 is processed after batch N is scheduled;
    a job of N's metadata (issued or flushed there) cannot be reported on it: the worker meets
    the job only when it runs batch N."""
    s = _scheduler(async_scheduling=True)
    s.add_request("r0", [*PREFIX, 30], 3)
    _step(s)  # schedules batch 0, its store in flight; no output processed yet
    (job,) = s.jobs.values()
    job.done_at = job.issued + 1  # as if it were finished only in the next batch
    s._output_step = job.issued
    assert s._take_output() is None  # not on batch 0's output
    s._output_step = job.issued + 1
    out = s._take_output()
    assert out is not None and job.job_id in out.kv_connector_worker_meta.completed_jobs


def test_an_error_of_kvspec_is_not_a_finding() -> None:
    """Only what vLLM raised is a crash finding; a bad configuration (kvspec's ConfigError) or a
    bug of the harness propagates."""
    from kvspec.contract.errors import ConfigError
    from kvspec.drivers.offloading_connector_fuzz import ConnectorConfig, run_ops

    with pytest.raises(ConfigError, match="block_size"):
        run_ops(ConnectorConfig(block_size=0), False, [{"op": "add", "rid": "r0", "prompt": [1, 2], "max_tokens": 1}])
    with pytest.raises(ValueError, match="unknown connector operation"):
        run_ops(ConnectorConfig(), False, [{"op": "add", "rid": "r0", "prompt": [1, 2], "max_tokens": 1},
                                           {"op": "teleport"}])


def test_a_long_queue_drains_to_the_end_without_a_stuck_finding() -> None:
    """30 requests on a 9-block pool are served one at a time, for more steps than the drain's
    base allowance: the drain's allowance grows with the queue, and only a state that stops
    changing is a stall (this trace was once reported stuck)."""
    from kvspec.drivers.offloading_connector_fuzz import ConnectorConfig, run_trace

    config = ConnectorConfig(block_size=4, num_gpu_blocks=9, num_chunks=5)
    r = run_trace(config, True, 1478124824, 60, "preempt")
    assert sum(op["op"] == "add" for op in r.ops) >= 25
    assert r.finding is None, r.finding


def test_a_swarm_trace_keeps_its_mix_and_replays_from_its_operations() -> None:
    """Under swarm testing a trace records the mix it was drawn under, draws only what the mix
    weighs above zero, and its recorded operations replay to the same finding (or none): the mix
    shapes the drawing only. A trace drawn without swarm records no mix."""
    from kvspec.drivers.offloading_connector_fuzz import KINDS, ConnectorConfig, run_ops, run_trace, signature

    config = ConnectorConfig(block_size=2, num_gpu_blocks=12, num_chunks=6, sliding_window=4)
    left_out = 0
    for seed in range(12):
        r = run_trace(config, seed % 2 == 0, seed, 40, "mixed", swarm=True)
        assert r.mix is not None and set(r.mix["weights"]) == set(KINDS)
        drawn = {op["op"] for op in r.ops}
        absent = {k for k, w in r.mix["weights"].items() if w == 0}
        assert not drawn & absent, (r.mix, drawn)
        left_out += bool(absent)
        assert all(op["chunk"] in r.mix["chunks"] for op in r.ops if op["op"] == "step")
        assert signature(run_ops(config, seed % 2 == 0, r.ops, "mixed").finding) == signature(r.finding)
    assert left_out > 0  # some mix left a kind out in 12 traces (each kind but step: 1 in 3 or 4)
    assert run_trace(config, True, 0, 20, "mixed").mix is None
