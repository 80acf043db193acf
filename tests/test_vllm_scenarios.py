"""vLLM's own scheduler tests (docs/vllm-semantics.md §11), re-expressed on kvspec's API.

Each test below is one scenario of ``tests/v1/simple_kv_offload/test_scheduler.py`` with
the outcome that file asserts (as re-checked against 0.33.0 in §11), driven on the
``baseline`` model the way vLLM's test drives the real manager: hand-built scheduler
outputs, GPU blocks allocated and registered by hand, worker completions by hand.
Names keep vLLM's test names, numbered as in §11.

Scenarios that do not apply (19-22): ``test_cp_block_size_scaling``,
``test_cp_eager_store_and_load_roundtrip``, ``test_cp_effective_block_size_store_and_load``
and ``test_cp_lazy_target_blocks_scaling`` exercise decode/prefill context parallelism
(the virtual block size ``16 * dcp``, physical copy counts per rank, the lazy target
shrinking with dcp). kvspec models one block size for every group and no context
parallelism (``OffloadConfig`` has no dcp/pcp), so they have no counterpart here.
All others use one full-attention group with block size 16 and apply.
"""

from __future__ import annotations

from scenario_kit import (
    Req,
    alloc,
    assert_clean,
    complete,
    cpu_hit,
    cpu_map,
    cpu_queue,
    gpu_queue,
    load_done,
    make,
    out,
    req,
    tokens,
)

from kvspec.model.scheduler import OffloadScheduler


def _same(r: Req, rid: str) -> Req:
    return Req(rid, list(r.tokens))


def _store(s: OffloadScheduler, r: Req, n_blocks: int, confirmed: int) -> list[int]:
    """Register ``r`` with ``n_blocks`` GPU blocks, confirm ``confirmed`` tokens, store, complete."""
    g = alloc(s, r, n_blocks)
    r.num_computed_tokens = confirmed
    s.update_state_after_alloc(r, (g,), 0)
    m = s.build_connector_meta(out(new=[(r.request_id, g)]))
    if m.store_event >= 0:
        complete(s, m.store_event)
    return g


def _pinned_load(s: OffloadScheduler, r: Req, n_gpu: int, ext: int) -> list[int]:
    """Lookup, allocate ``n_gpu`` GPU blocks and register a load of ``ext`` tokens."""
    s.get_num_new_matched_tokens(r, 0)
    d = s.gpu_pool.get_new_blocks(n_gpu)
    s.update_state_after_alloc(r, (d,), ext)
    return d


# 1
def test_eager_store_and_load_roundtrip() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    _store(s, a, 3, 33)
    b = _same(a, "B")
    assert s.get_num_new_matched_tokens(b, 0) == (32, True)
    d = s.gpu_pool.get_new_blocks(3)
    s.update_state_after_alloc(b, (d,), 32)
    m = s.build_connector_meta(out())
    assert m.load_event == 0 and m.load_event_to_reqs == {0: ["B"]}
    assert len(m.load_gpu_blocks) == len(m.load_cpu_blocks) == 2
    assert m.load_gpu_blocks == d[:2]
    assert_clean(s)


# 2
def test_max_hit_len_cap_drops_last_full_block() -> None:
    s = make(cpu=5)
    a = req("A", 3, extra=0)  # exactly 48 tokens
    _store(s, a, 3, 48)
    assert len(cpu_map(s)) == 3  # all three blocks are on the CPU
    assert s.get_num_new_matched_tokens(_same(a, "B"), 0) == (32, True)  # max_len = 47


# 3
def test_lazy_store_and_load_roundtrip() -> None:
    s = make(cpu=5, gpu=8, lazy_offload=True)
    a = req("A", 2)
    g = alloc(s, a, 3)
    s.gpu_pool.free_blocks(list(reversed(g)))
    fillers = s.gpu_pool.get_new_blocks(5)  # fillers push A's hashed blocks to the LRU head
    m = s.build_connector_meta(out())
    assert sorted(m.store_gpu_blocks) == g[:2]
    complete(s, m.store_event)
    s.gpu_pool.free_blocks(fillers)
    b = _same(a, "B")
    assert s.get_num_new_matched_tokens(b, 0) == (32, True)
    d = s.gpu_pool.get_new_blocks(3)
    s.update_state_after_alloc(b, (d,), 32)
    m = s.build_connector_meta(out())
    assert m.load_event == 0 and len(m.load_gpu_blocks) == len(m.load_cpu_blocks) == 2
    assert_clean(s)


# 4
def test_eager_duplicate_store_skipped() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    _store(s, a, 3, 33)
    free = s.cpu_pool.get_num_free_blocks()
    b = _same(a, "B")  # same hashes, different GPU blocks
    gb = alloc(s, b, 3)
    assert set(gb).isdisjoint(range(1, 4))
    b.num_computed_tokens = 33
    s.update_state_after_alloc(b, (gb,), 0)
    m = s.build_connector_meta(out(new=[("B", gb)]))
    assert m.store_event == -1 and m.store_gpu_blocks == []
    assert s.cpu_pool.get_num_free_blocks() == free
    assert s.reqs_to_store["B"].num_stored_blocks == [2]  # passed as already cached


# 5
def test_eager_in_flight_store_dedup_across_steps() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    ga = alloc(s, a, 3)
    a.num_computed_tokens = 33
    s.update_state_after_alloc(a, (ga,), 0)
    ma = s.build_connector_meta(out(new=[("A", ga)]))
    assert ma.store_gpu_blocks == ga[:2]
    free = s.cpu_pool.get_num_free_blocks()
    b = _same(a, "B")  # hits A's GPU blocks: same ids, still in flight
    s.gpu_pool.touch(ga[:2])
    gb = ga[:2] + s.gpu_pool.get_new_blocks(1)
    b.num_computed_tokens = 33
    s.update_state_after_alloc(b, (gb,), 0)
    mb = s.build_connector_meta(out(new=[("B", gb)]))
    assert mb.store_event == -1
    assert s.cpu_pool.get_num_free_blocks() == free
    assert s.in_flight_store_gpu_blocks == set(ga[:2])
    complete(s, ma.store_event)
    assert s.in_flight_store_gpu_blocks == set()
    assert_clean(s)


# 6
def test_lazy_duplicate_store_skipped() -> None:
    s = make(cpu=5, gpu=8, lazy_offload=True)
    a = req("A", 2)
    g = alloc(s, a, 3)
    s.gpu_pool.free_blocks(list(reversed(g)))
    fillers = s.gpu_pool.get_new_blocks(5)
    complete(s, s.build_connector_meta(out()).store_event)
    free = s.cpu_pool.get_num_free_blocks()
    # B has A's tokens in other GPU blocks; once freed they sit where the walk looks next
    s.gpu_pool.free_blocks(fillers)
    b = _same(a, "B")
    gb = alloc(s, b, 3)
    assert set(gb).isdisjoint(g[:2])
    s.gpu_pool.free_blocks(list(reversed(gb)))
    walked = list(s.gpu_pool.free_queue.iter_after(s.lazy_cursor))
    assert set(gb[:2]) <= set(walked)
    m = s.build_connector_meta(out())
    assert m.store_event == -1
    assert s.cpu_pool.get_num_free_blocks() == free
    assert_clean(s)


# 7
def test_lru_eviction_order() -> None:
    s = make(cpu=5)
    a, b, c = req("A", 2), req("B", 2), req("C", 2)
    for r in (a, b, c):
        _store(s, r, 3, 33)
    assert cpu_hit(s, a) == 0
    assert cpu_hit(s, b) == 32 and cpu_hit(s, c) == 32
    assert set(cpu_map(s)) == set(b.block_hashes + c.block_hashes)


# 8
def test_touched_blocks_survive_eviction() -> None:
    s = make(cpu=5)
    a, b, c = req("A", 2), req("B", 2), req("C", 2)
    _store(s, a, 3, 33)
    _store(s, b, 3, 33)
    a_cpu = [s.cpu_pool.get_one_block((h, 0)) for h in a.block_hashes]
    s.cpu_pool.touch(a_cpu)
    s.cpu_pool.free_blocks(a_cpu)  # A's entries move to the MRU end
    assert cpu_queue(s)[-2:] == a_cpu
    _store(s, c, 3, 33)
    assert cpu_hit(s, a) == 32 and cpu_hit(s, c) == 32
    assert cpu_hit(s, b) == 0


# 9
def test_preemption_no_cpu_block_leak() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    _store(s, a, 3, 33)
    b = _same(a, "B")
    _pinned_load(s, b, 3, 32)
    m = s.build_connector_meta(out())
    assert m.load_event == 0
    cpu_ids = list(m.load_cpu_blocks)
    assert [s.cpu_pool.ref_cnt[c] for c in cpu_ids] == [1, 1]
    s.request_finished(b)  # preempted/aborted while its load is in flight: deferred
    assert s.reqs_to_load["B"].finished is True
    assert [s.cpu_pool.ref_cnt[c] for c in cpu_ids] == [1, 1]
    load_done(s, "B")
    assert "B" not in s.reqs_to_load
    assert [s.cpu_pool.ref_cnt[c] for c in cpu_ids] == [0, 0]
    assert s.cpu_pool.get_num_free_blocks() == 4
    assert_clean(s)


# 10
def test_eager_store_preemption_cleanup() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    g = alloc(s, a, 3)
    a.num_computed_tokens = 33
    s.update_state_after_alloc(a, (g,), 0)
    m = s.build_connector_meta(out(new=[("A", g)]))
    s.request_finished(a)
    assert s.reqs_to_store["A"].finished is True
    assert s.reqs_to_store["A"].store_events == {m.store_event}
    complete(s, m.store_event)
    assert "A" not in s.reqs_to_store
    assert s.store_event_to_reqs == {}
    assert_clean(s)


# 11
def test_inflight_finish_deferred_cleanup() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    _store(s, a, 3, 33)
    b = _same(a, "B")
    d = _pinned_load(s, b, 3, 32)
    m = s.build_connector_meta(out())
    s.request_finished(b)
    assert s.load_event_to_reqs == {m.load_event: ["B"]}  # still needed for the worker's report
    load_done(s, "B")
    assert s.reqs_to_load == {} and s.load_event_to_reqs == {}
    assert [s.gpu_pool.ref_cnt[x] for x in d] == [1, 1, 1]  # only the owner's refs remain
    assert_clean(s)


# 12
def test_multi_group_null_blocks_skipped() -> None:
    s = make(cpu=5)
    a = req("A", 3)
    g = alloc(s, a, 4)
    table = [0, *g[1:]]  # position 0 is the null block; nothing in the GPU cache has its key
    s.gpu_pool.free_blocks([g[0]])
    s.gpu_pool.evict_blocks([g[0]])
    a.num_computed_tokens = 49
    s.update_state_after_alloc(a, (table,), 0)
    m = s.build_connector_meta(out(new=[("A", table)]))
    assert 0 not in m.store_gpu_blocks
    assert m.store_gpu_blocks == g[1:3]
    assert s.reqs_to_store["A"].num_stored_blocks == [3]  # the null position is passed
    complete(s, m.store_event)
    assert cpu_hit(s, a) == 0  # the chain starts at the missing position 0
    assert_clean(s)


# 13
def test_chunked_prefill_reads_live_block_ids() -> None:
    s = make(cpu=8)
    a = req("A", 4)
    g1 = alloc(s, a, 2)
    a.num_computed_tokens = 32
    s.update_state_after_alloc(a, (g1,), 0)
    m = s.build_connector_meta(out(new=[("A", g1)], sched={"A": 32}))
    assert m.store_gpu_blocks == g1
    complete(s, m.store_event)
    g2 = alloc(s, a, 2, first_pos=2)
    s.update_state_after_alloc(a, (g1 + g2,), 0)  # registration is idempotent
    assert s.reqs_to_store["A"].num_stored_blocks == [2]
    a.num_computed_tokens = 64
    m = s.build_connector_meta(out(cached=[("A", g2)], sched={"A": 32}))
    assert m.store_gpu_blocks == g2  # only the two new blocks
    assert s.reqs_to_store["A"].block_ids == [g1 + g2]
    assert_clean(s)


# 14
def test_partial_gpu_prefix_plus_cpu_load() -> None:
    s = make(cpu=8, gpu=24)
    a = Req("A", tokens(5, 97))
    ga = _store(s, a, 7, 96)
    assert len(cpu_map(s)) == 6
    b = _same(a, "B")
    s.gpu_pool.touch(ga[:2])  # |local 2|: B's GPU prefix hit on A's first two blocks
    ext = s.gpu_pool.get_new_blocks(2)
    new = s.gpu_pool.get_new_blocks(3)
    assert s.get_num_new_matched_tokens(b, 32) == (64, True)  # positions 2..5 on the CPU
    s.update_state_after_alloc(b, (ga[:2] + ext + new,), 32)  # the scheduler accepts 32
    ls = s.reqs_to_load["B"]
    assert ls.transfer.gpu_ids == ext
    assert ls.transfer.cpu_ids == [s.cpu_pool.get_one_block((h, 0)) for h in a.block_hashes[2:4]]
    # the pinned blocks not used are released
    assert [s.cpu_pool.ref_cnt[s.cpu_pool.get_one_block((h, 0))] for h in a.block_hashes[2:6]] == [1, 1, 0, 0]
    assert_clean(s)


# 15
def test_toctou_cpu_hit_evicted_between_phases_no_crash() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    _store(s, a, 3, 33)
    b = _same(a, "B")
    assert s.get_num_new_matched_tokens(b, 0) == (32, True)  # Phase A pins A's blocks
    for rid in ("C", "D"):
        _store(s, req(rid, 2), 3, 33)  # 4 more blocks wanted; only 2 are free
    assert cpu_hit(s, a) == 32  # A's entries survived
    d = s.gpu_pool.get_new_blocks(3)
    s.update_state_after_alloc(b, (d,), 32)  # Phase B
    assert len(s.reqs_to_load["B"].transfer.gpu_ids) == 2
    assert_clean(s)


# 16
def test_reset_pending_eager_stores() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    g = alloc(s, a, 3)
    a.num_computed_tokens = 33
    s.update_state_after_alloc(a, (g,), 0)
    m = s.build_connector_meta(out(new=[("A", g)]))
    assert s.reset() is False
    assert list(s.abandoned_store_event_to_blocks) == [m.store_event]
    s.gpu_pool.free_blocks(list(reversed(g)))  # the request goes away
    complete(s, m.store_event)
    assert s.abandoned_store_event_to_blocks == {}
    assert s.gpu_pool.num_blocks - s.gpu_pool.get_num_free_blocks() == 1
    assert s.reset() is True
    assert cpu_map(s) == {}
    assert_clean(s)


# 17
def test_reset_pending_lazy_stores() -> None:
    s = make(cpu=5, gpu=8, lazy_offload=True)
    a = req("A", 2)
    g = alloc(s, a, 3)
    s.gpu_pool.free_blocks(list(reversed(g)))
    fillers = s.gpu_pool.get_new_blocks(5)
    m = s.build_connector_meta(out())
    assert m.store_event == 0
    assert s.reset() is False
    assert s.lazy_cursor is None
    complete(s, m.store_event)
    s.gpu_pool.free_blocks(fillers)
    assert s.gpu_pool.num_blocks - s.gpu_pool.get_num_free_blocks() == 1
    assert s.reset() is True
    assert s.get_num_new_matched_tokens(_same(a, "B"), 0) == (0, False)
    assert gpu_queue(s)  # the GPU side is untouched by the CPU reset
    assert_clean(s)


# 18
def test_reset_pending_loads() -> None:
    s = make(cpu=5)
    a = req("A", 2)
    ga = _store(s, a, 3, 33)
    s.gpu_pool.free_blocks(list(reversed(ga)))
    b = _same(a, "B")
    d = _pinned_load(s, b, 3, 32)
    m = s.build_connector_meta(out())
    assert m.load_event == 0
    assert s.reset() is False
    assert list(s.abandoned_reqs_to_load) == ["B"]
    load_done(s, "B")
    assert s.abandoned_reqs_to_load == {}
    s.gpu_pool.free_blocks(list(reversed(d)))
    assert s.gpu_pool.num_blocks - s.gpu_pool.get_num_free_blocks() == 1
    assert s.reset() is True
    assert_clean(s)
