"""Verdicts on real vLLM: a refusal by kvspec's adapter changes nothing, and ``raw`` targets let vLLM act.

* **The error contract on vLLM** (``contract_kit.ErrorContract``, every case the model and the
  implementation pass), observed also in vLLM's own objects (``vllm_objects``: its requests as
  the adapter mirrors them, every block of both pools with its free-list links, the manager's
  fields), plus the cases only the adapter has: a request view vLLM cannot mirror (fewer tokens
  than vLLM saw, a hash that is not hex) is refused before any vLLM object or mirror changes.
* **A load into the null block** (a 1-token sliding window): the adapter refuses
  ``update_state_after_alloc`` before vLLM changes; on ``raw:vllm`` the call reaches vLLM,
  which registers a load into GPU block 0. vLLM's own scheduler never makes that call: with a
  1-token window it caches no sliding-window block, so no CPU hit has one
  (``test_vllm_scheduler_never_loads_into_the_null_block``).
* **Raw targets**: a negative count to ``get_new_blocks`` reaches vLLM 0.33.0, which returns no
  block and counts one more free block than its queue holds; invariant I1 reports it.

Marked ``vllm``; skipped, with the reason, where vLLM 0.33.0 cannot be imported (the vLLM CI
stage, ``scripts/ci-vllm-stage.sh``, runs this file).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
from contract_kit import BLOCK, Case, ErrorContract, FakeRequest, Scene, check_refused

from kvspec.adapters.targets import get_factory
from kvspec.adapters.vllm import vllm_available
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import InvalidOperationError, KVSpecError
from kvspec.drivers.engine import Engine
from kvspec.oracle.catalogue import check

VLLM_OK, VLLM_WHY = vllm_available()
if os.environ.get("KVSPEC_REQUIRE_VLLM") == "1" and not VLLM_OK:
    raise RuntimeError(f"KVSPEC_REQUIRE_VLLM=1 but {VLLM_WHY}")

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")]


def _vllm(config: OffloadConfig) -> Any:
    return get_factory("vllm")(replace(config, policy="baseline"))


def _raw_vllm(config: OffloadConfig) -> Any:
    return get_factory("raw:vllm")(replace(config, policy="baseline"))


# -- what a refused call must leave as it was, read from vLLM's own objects ---------------------------


def _blocks(pool: Any) -> list[tuple[Any, ...]]:
    """Every block of a vLLM ``BlockPool``: id, ref count, hash, free-list neighbours; and the count."""
    def link(b: Any) -> int | None:
        return None if b is None else int(b.block_id)

    rows: list[tuple[Any, ...]] = [(b.block_id, b.ref_cnt, b.block_hash, link(b.prev_free_block),
                                    link(b.next_free_block)) for b in pool.blocks]
    rows.append(("free", pool.free_block_queue.num_free_blocks))
    return rows


def vllm_objects(target: Any) -> dict[str, Any]:
    """What the adapter and vLLM hold, read from their objects (not from the snapshot): each
    mirrored vLLM ``Request`` and the view it mirrors, the lookup-time counts, both pools' blocks,
    and the manager's fields as plain values."""
    mgr = target.manager
    return {
        "requests": {rid: (id(m.view), m.request.num_tokens, list(m.request.all_token_ids),
                           m.request.num_computed_tokens, m.request.num_output_placeholders,
                           list(m.request.block_hashes), m.request.skip_reading_prefix_cache)
                     for rid, m in target._mirrors.items()},
        "lookup_local": dict(target._lookup_local),
        "gpu": _blocks(target.gpu_pool.pool),
        "cpu": _blocks(mgr.cpu_block_pool),
        "pins": {r: (pin[1], [[b.block_id for b in g] for g in pin[0]]) for r, pin in mgr._pending_cpu_hits.items()},
        "loads": {r: (st.transfer_meta.gpu_block_ids, st.transfer_meta.cpu_block_ids, st.load_event)
                  for r, st in mgr._reqs_to_load.items()},
        "stores": {r: ([list(g) for g in st.block_ids], list(st.num_stored_blocks), sorted(st.store_events))
                   for r, st in mgr._reqs_to_store.items()},
        "events": sorted(mgr._store_event_to_blocks), "counters": (mgr._load_event_counter, mgr._store_event_counter),
        "cursor": None if mgr._cursor is None else mgr._cursor.block_id,
    }


def _observe(scene: Scene) -> dict[str, Any]:
    return vllm_objects(scene.target)


class TestVllmErrorContract(ErrorContract):
    """Every bad call of the contract refused by the adapter, in vLLM's state, as the model refuses
    it, and vLLM's own objects unchanged."""

    factory = _vllm
    policy = "baseline"
    observe = staticmethod(_observe)


def _grown(scene: Scene, rid: str, hashes: list[str]) -> FakeRequest:
    """``rid``'s view with one more block of tokens, whose hashes are ``hashes``."""
    r = scene.req(rid)
    return FakeRequest(request_id=rid, num_tokens=r.num_tokens + BLOCK, num_computed_tokens=r.num_computed_tokens,
                       block_hashes=hashes)


#: Refusals only the adapter has: the request views vLLM would read cannot be mirrored.
MIRROR_CASES = [
    Case("lookup: fewer tokens than vLLM saw", lambda s: s.target.get_num_new_matched_tokens(
        FakeRequest(request_id="a", num_tokens=1), 0), InvalidOperationError,
         r"\ba: 1 tokens, fewer than the \d+ vLLM already saw"),
    Case("alloc: a running request's new hash is not hex", lambda s: s.target.update_state_after_alloc(
        _grown(s, "c", [*s.req("c").block_hashes, "not-hex"]), ([], []), 0), InvalidOperationError,
         r"block hash 'not-hex' is not hex text"),
    Case("finish all: fewer tokens than vLLM saw", lambda s: s.target.request_finished_all_groups(
        FakeRequest(request_id="c", num_tokens=2), ([], [])), InvalidOperationError,
         r"\bc: 2 tokens, fewer than the \d+ vLLM already saw"),
]


@pytest.mark.parametrize("case", MIRROR_CASES, ids=[c.name for c in MIRROR_CASES])
def test_a_view_vllm_cannot_mirror_is_refused_before_vllm_changes(case: Case) -> None:
    check_refused(Scene(_vllm, "baseline"), case, _observe)


# -- a load into the null block: a 1-token sliding window ----------------------------------------------

WINDOW_OF_ONE = OffloadConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=16, policy="baseline",
                              groups=(KVGroup(), KVGroup("sliding", 1)))
_C_AFTER_A_AND_B = [
    {"op": "add", "rid": "A", "family": 0, "prompt_len": 9, "max_tokens": 1},
    {"op": "step", "admit": ["A"], "chunk": 64},
    {"op": "finish", "rid": "A"},
    {"op": "step", "admit": []},
    {"op": "report", "event": 0, "count": 1},
    {"op": "add", "rid": "B", "family": 1, "prompt_len": 20, "max_tokens": 1},
    {"op": "step", "admit": ["B"], "chunk": 64},
    {"op": "finish", "rid": "B"},
    {"op": "step", "admit": []},
    {"op": "report", "event": 1, "count": 1},
    {"op": "add", "rid": "C", "family": 0, "prompt_len": 9, "max_tokens": 1},
    {"op": "step", "admit": ["C"]},
]


def test_a_load_into_the_null_block_is_refused_before_vllm_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine (which caches 1-token-window blocks, unlike vLLM's scheduler) admits C with a CPU
    hit whose sliding-window block sits where its table holds the null block: the adapter refuses
    ``update_state_after_alloc`` and neither the target's snapshot nor vLLM's objects change in
    that call (the engine's own step had allocated C's blocks before: the operation as a whole is
    not undone, which is the harness' "rejection changed the state")."""
    engine = Engine(_vllm(WINDOW_OF_ONE))
    target = engine.target
    seen: list[tuple[Any, Any]] = []
    original = type(target).update_state_after_alloc

    def watched(self: Any, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        before = (self.snapshot(), vllm_objects(self))
        try:
            original(self, request, block_ids, num_external_tokens)
        except KVSpecError:
            seen.append((before, (self.snapshot(), vllm_objects(self))))
            raise

    monkeypatch.setattr(type(target), "update_state_after_alloc", watched)
    for op in _C_AFTER_A_AND_B[:-1]:
        engine.apply(op)
    with pytest.raises(InvalidOperationError, match="group 1 has no allocated GPU block at position"):
        engine.apply(_C_AFTER_A_AND_B[-1])
    assert len(seen) == 1
    before, after = seen[0]
    assert after == before


def test_on_raw_vllm_the_load_into_the_null_block_reaches_vllm() -> None:
    """The same operations on ``raw:vllm``: vLLM accepts the call and registers a load whose GPU
    destinations include block 0, the null block every request shares."""
    engine = Engine(_raw_vllm(WINDOW_OF_ONE))
    for op in _C_AFTER_A_AND_B:
        meta = engine.apply(op)
    assert 0 in meta.load_gpu_blocks
    assert 0 in engine.target.snapshot()["scheduler"]["reqs_to_load"]["C"]["gpu"]


@pytest.mark.parametrize("window", [1, 2])
def test_vllm_scheduler_never_loads_into_the_null_block(window: int) -> None:
    """vLLM 0.33.0's own ``Scheduler`` (synchronous) on the same operations: with a 1-token window
    no sliding-window block is ever hashed on the GPU or stored on the CPU, so C's CPU hit is empty
    and nothing loads; with a 2-token window C loads, into real blocks. The load into block 0 is
    the manager's answer to a table vLLM's scheduler does not build."""
    from kvspec.adapters.vllm_scheduler import SchedulerOptions
    from kvspec.drivers.lockstep import VllmSide

    config = replace(WINDOW_OF_ONE, groups=(KVGroup(), KVGroup("sliding", window)))
    side = VllmSide(config, SchedulerOptions(async_scheduling=False))
    hashed: set[str] = set()
    for op in _C_AFTER_A_AND_B:
        side.apply(op)
        hashed.update(h for h in side.state()["gpu_pool"]["block_hash"] if h is not None)
    loads = side.observed_step().metadata["load_gpu_blocks"]
    stored = side.state()["cpu_pool"]["cached"]
    if window == 1:
        assert not any(h.endswith(":1") for h in hashed) and not any(k.endswith(":1") for k in stored)
        assert loads == []
    else:
        assert any(k.endswith(":1") for k in stored)
        assert loads and 0 not in loads


# -- raw targets -----------------------------------------------------------------------------------------


def test_raw_vllm_lets_a_negative_allocation_reach_vllm_and_i1_reports_it() -> None:
    """``get_new_blocks(-1)``: the adapter refuses it (and nothing changes); on ``raw:vllm`` vLLM
    0.33.0 returns no block and adds one to its free count, which the free-queue walk no longer
    matches: I1."""
    config = OffloadConfig(num_gpu_blocks=8, num_cpu_blocks=4, policy="baseline")
    checked = _vllm(config)
    before = checked.snapshot()
    with pytest.raises(KVSpecError, match="cannot allocate -1 blocks"):
        checked.gpu_pool.get_new_blocks(-1)
    assert checked.snapshot() == before
    raw = _raw_vllm(config)
    assert raw.gpu_pool.get_new_blocks(-1) == []
    snap = raw.snapshot()
    assert snap["gpu_pool"]["free_count"] == len(snap["gpu_pool"]["free_queue"]) + 1
    assert [v.id for v in check(snap, ("I1",))] == ["I1"]


def test_raw_vllm_still_refuses_what_names_no_vllm_object() -> None:
    """Raw keeps the checks without which vLLM's arguments cannot be built: a block id that is no
    block of the pool (-1 would otherwise index vLLM's last block) and a count that is no int."""
    raw = _raw_vllm(OffloadConfig(num_gpu_blocks=8, num_cpu_blocks=4, policy="baseline"))
    before = raw.snapshot()
    with pytest.raises(KVSpecError, match="cannot free block -1"):
        raw.gpu_pool.free_blocks([-1])
    with pytest.raises(KVSpecError, match="must be an int"):
        raw.gpu_pool.get_new_blocks("2")
    assert raw.snapshot() == before


def test_raw_vllm_lets_a_double_free_reach_vllm() -> None:
    """A block freed twice: refused by the adapter; on ``raw:vllm`` vLLM takes its ref count below
    zero, which I1 reports."""
    config = OffloadConfig(num_gpu_blocks=8, num_cpu_blocks=4, policy="baseline")
    for factory, refused in ((_vllm, True), (_raw_vllm, False)):
        target = factory(config)
        [b] = target.gpu_pool.get_new_blocks(1)
        if refused:
            with pytest.raises(KVSpecError, match="freed 2 time"):
                target.gpu_pool.free_blocks([b, b])
            assert check(target.snapshot(), ("I1",)) == []
        else:
            target.gpu_pool.free_blocks([b, b])
            assert [v.id for v in check(target.snapshot(), ("I1",))] == ["I1"]
