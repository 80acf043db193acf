"""The worked traces T1-T8 of docs/vllm-semantics.md §8, exactly, on the ``baseline`` model.

Each trace drives the scheduler and the pools by hand (hand-built ``SchedulerOutput``s,
no engine, no worker), as the traces were checked on vLLM 0.33.0. Block ids are
concrete: the GPU pool hands out 1, 2, 3, ... in order and the CPU pool 1..N-1, so
the document's g1/c1 are ids 1. Setup: one full-attention group, B = 16, GPU pool 16
blocks (T4: 8), CPU ``num_cpu_blocks`` 5 for T1-T4 and 8 for T5-T8; every store
completes before the next step.
"""

from __future__ import annotations

import pytest
from scenario_kit import (
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
)

from kvspec.oracle.catalogue import check


def test_t1_eager_roundtrip() -> None:
    s = make("baseline", cpu=5)
    r = req("R", 2, extra=1)
    g = alloc(s, r, 3)  # g1, g2 hashed; g3 holds the extra token
    assert g == [1, 2, 3]
    assert s.gpu_pool.block_hash[3] is None
    s.update_state_after_alloc(r, (g,), 0)
    m = s.build_connector_meta(out(new=[("R", g)], sched={"R": 33}))
    assert m.store_event == -1  # nothing confirmed yet
    r.num_computed_tokens = 33
    # 1. ready = 33 // 16 = 2: g1, g2 -> c1, c2, event 0, cursor 2
    m = s.build_connector_meta(out(cached=[("R", None)]))
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (0, [1, 2], [1, 2])
    assert s.reqs_to_store["R"].num_stored_blocks == [2]
    assert s.in_flight_store_gpu_blocks == {1, 2}
    assert s.gpu_pool.ref_cnt[1:4] == [2, 2, 1]
    assert s.cpu_pool.block_hash[1] is None and s.cpu_pool.block_hash[2] is None  # unhashed in flight
    assert s.cpu_pool.ref_cnt[1:3] == [1, 1]
    assert cpu_queue(s) == [3, 4]
    assert_clean(s)
    # 2. completion 0: registered under H1, H2; MRU tail
    complete(s, 0)
    assert cpu_map(s) == {r.block_hashes[0]: [1], r.block_hashes[1]: [2]}
    assert cpu_queue(s) == [3, 4, 1, 2]
    assert s.gpu_pool.ref_cnt[1:4] == [1, 1, 1]
    assert s.in_flight_store_gpu_blocks == set()
    # 3. R2, same tokens: hit 32 (max_len = 33 - 1), async, c1 c2 pinned
    r2 = req("R2", 2, extra=1)
    r2.tokens, r2.block_hashes = r.tokens, r.block_hashes
    assert s.get_num_new_matched_tokens(r2, 0) == (32, True)
    assert s.cpu_pool.ref_cnt[1:3] == [1, 1]
    assert cpu_queue(s) == [3, 4]
    # 4. update_state_after_alloc: load pairs d1<-c1, d2<-c2
    d = s.gpu_pool.get_new_blocks(3)
    assert d == [4, 5, 6]
    s.update_state_after_alloc(r2, (d,), 32)
    assert s.cpu_pool.ref_cnt[1:3] == [1, 1]  # touched (2), pin released (1)
    assert s.gpu_pool.ref_cnt[4:7] == [2, 2, 1]  # owner + load
    ls = s.reqs_to_load["R2"]
    assert (ls.transfer.gpu_ids, ls.transfer.cpu_ids, ls.load_event) == ([4, 5], [1, 2], None)
    assert "R2" not in s.pending_cpu_hits
    # 5. next build: load event 0
    m = s.build_connector_meta(out())
    assert (m.load_event, m.load_gpu_blocks, m.load_cpu_blocks) == (0, [4, 5], [1, 2])
    assert m.load_event_to_reqs == {0: ["R2"]}
    assert m.store_event == -1
    # 6. finished_recving
    load_done(s, "R2")
    assert s.cpu_pool.ref_cnt[1:3] == [0, 0]
    assert cpu_queue(s) == [3, 4, 1, 2]
    assert s.gpu_pool.ref_cnt[4:7] == [1, 1, 1]
    assert s.load_event_to_reqs == {}
    assert s.reqs_to_load == {}
    assert_clean(s)


def _t2_prefix(policy: str = "baseline"):  # type: ignore[no-untyped-def]
    """T2 up to the completion of the t3 store: returns (scheduler, R, R's GPU table)."""
    s = make(policy, cpu=5)
    r = req("R", 6, extra=1)
    g = alloc(s, r, 4)
    s.update_state_after_alloc(r, (g,), 0)
    s.build_connector_meta(out(new=[("R", g)], sched={"R": 64}))  # t1: 4 blocks prefilled
    r.num_computed_tokens = 64
    g2 = alloc(s, r, 3, first_pos=4)
    # t2: confirmed 64 -> g1..g4 -> c1..c4, cursor 4
    m = s.build_connector_meta(out(cached=[("R", g2)], sched={"R": 33}))
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (0, [1, 2, 3, 4], [1, 2, 3, 4])
    assert s.reqs_to_store["R"].num_stored_blocks == [4]
    r.num_computed_tokens = 97
    complete(s, 0)
    assert cpu_queue(s) == [1, 2, 3, 4]
    assert cpu_map(s) == {r.block_hashes[i]: [i + 1] for i in range(4)}
    # t3 (decode): confirmed 97 -> ready 6 -> g5, g6 -> pops c1, c2 -> evicts H1, H2
    m = s.build_connector_meta(out(cached=[("R", None)], sched={"R": 1}))
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (1, [5, 6], [1, 2])
    assert s.reqs_to_store["R"].num_stored_blocks == [6]
    assert s.cpu_pool.take_evicted() == []  # the scheduler consumed the eviction record
    r.num_computed_tokens = 98
    complete(s, 1)
    return s, r, g + g2


def test_t2_mid_request_cpu_eviction_fixme() -> None:
    s, r, table = _t2_prefix()
    h = r.block_hashes
    assert cpu_map(s) == {h[2]: [3], h[3]: [4], h[4]: [1], h[5]: [2]}
    assert cpu_queue(s) == [3, 4, 1, 2]
    # R finishes: the flush scans [6, ready=6) and selects nothing
    s.request_finished_all_groups(r, (table[:7],))
    assert s.pending_finished_stores == []
    assert "R" not in s.reqs_to_store
    assert not s.has_pending_stores()
    # a new request with the same prompt: H1 missing breaks the chain
    r2 = req("R2", 6, extra=1)
    r2.tokens, r2.block_hashes = r.tokens, list(h)
    assert s.get_num_new_matched_tokens(r2, 0) == (0, False)
    assert cpu_hit(s, r2) == 0
    assert_clean(s)


def test_t3_same_step_self_eviction() -> None:
    s = make("baseline", cpu=5)
    x = req("X", 2, extra=1, family=7)  # stores A's prefix Ha0, Ha1 -> c1, c2
    y = req("Y", 2, extra=1, family=8)  # stores b0, b1 -> c3, c4
    for rq in (x, y):
        g = alloc(s, rq, 2)
        rq.num_computed_tokens = 32
        s.update_state_after_alloc(rq, (g,), 0)
        m = s.build_connector_meta(out(new=[(rq.request_id, g)]))
        complete(s, m.store_event)
    a = req("A", 4, extra=1, family=7)
    assert a.block_hashes[:2] == x.block_hashes[:2]
    assert cpu_queue(s) == [1, 2, 3, 4]
    assert cpu_map(s) == {a.block_hashes[0]: [1], a.block_hashes[1]: [2],
                          y.block_hashes[0]: [3], y.block_hashes[1]: [4]}
    ga = alloc(s, a, 5)
    s.update_state_after_alloc(a, (ga,), 0)
    a.num_computed_tokens = 64
    m = s.build_connector_meta(out(new=[("A", ga)]))
    # Ha0, Ha1 "already cached" -> cursor passes them; blocks 2, 3 selected; the
    # allocation pops c1, c2 and evicts Ha0, Ha1
    assert (m.store_gpu_blocks, m.store_cpu_blocks) == ([ga[2], ga[3]], [1, 2])
    assert s.reqs_to_store["A"].num_stored_blocks == [4]
    complete(s, m.store_event)
    assert cpu_map(s) == {y.block_hashes[0]: [3], y.block_hashes[1]: [4],
                          a.block_hashes[2]: [1], a.block_hashes[3]: [2]}
    assert cpu_hit(s, a) == 0
    assert_clean(s)


def test_t4_lazy() -> None:
    s = make("baseline", cpu=5, gpu=8, lazy_offload=True)
    assert s.target_free == 8
    r = req("R", 2, extra=1)
    g = alloc(s, r, 3)
    assert g == [1, 2, 3]
    s.gpu_pool.free_blocks(list(reversed(g)))
    assert gpu_queue(s) == [3, 4, 5, 6, 7, 2, 1]
    fillers = s.gpu_pool.get_new_blocks(5)
    assert fillers == [3, 4, 5, 6, 7]
    assert gpu_queue(s) == [2, 1]
    m = s.build_connector_meta(out())
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (0, [2, 1], [1, 2])
    assert gpu_queue(s) == []
    assert s.lazy_cursor == 1
    assert s.store_event_to_reqs == {}
    assert s.reqs_to_store == {} and s.in_flight_store_gpu_blocks == set()
    complete(s, 0)
    assert gpu_queue(s) == [2, 1]
    assert cpu_map(s) == {r.block_hashes[1]: [1], r.block_hashes[0]: [2]}
    assert cpu_queue(s) == [3, 4, 1, 2]
    # the next walk starts after block 1 and finds nothing
    m = s.build_connector_meta(out())
    assert m.store_event == -1
    assert_clean(s)


def test_t5_finish_time_flush() -> None:
    s = make("baseline", cpu=8)
    r = req("R", 2, extra=1)
    g = alloc(s, r, 3)
    s.update_state_after_alloc(r, (g,), 0)
    m = s.build_connector_meta(out(new=[("R", g)], sched={"R": 33}))
    assert m.store_event == -1  # confirmed 0
    r.num_computed_tokens = 33
    # R stops in update_from_output(t)
    s.request_finished_all_groups(r, (g,))
    assert [(t.gpu_ids, t.cpu_ids) for t in s.pending_finished_stores] == [([1, 2], [1, 2])]
    assert s.in_flight_store_gpu_blocks == {1, 2}
    assert s.gpu_pool.ref_cnt[1:3] == [2, 2]
    assert "R" not in s.reqs_to_store
    s.gpu_pool.free_blocks(list(reversed(g)))
    assert s.gpu_pool.ref_cnt[1:4] == [1, 1, 0]
    assert gpu_queue(s)[0] == 3
    assert cpu_queue(s) == [3, 4, 5, 6, 7]
    assert s.has_pending_stores()
    m = s.build_connector_meta(out())
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (0, [1, 2], [1, 2])
    assert s.store_event_to_reqs == {}
    assert s.pending_finished_stores == []
    complete(s, 0)
    assert cpu_map(s) == {r.block_hashes[0]: [1], r.block_hashes[1]: [2]}
    assert cpu_queue(s) == [3, 4, 5, 6, 7, 1, 2]
    assert s.gpu_pool.ref_cnt[1:3] == [0, 0]
    assert gpu_queue(s)[-2:] == [1, 2]
    assert not s.has_pending_stores()
    assert_clean(s)


def test_t5_flush_joins_the_event_after_the_scan() -> None:
    s = make("baseline", cpu=8)
    r = req("R", 2, extra=1)
    b = req("Bq", 3, extra=1)
    g = alloc(s, r, 3)
    gb = alloc(s, b, 4)
    assert (g, gb) == ([1, 2, 3], [4, 5, 6, 7])
    s.update_state_after_alloc(r, (g,), 0)
    s.update_state_after_alloc(b, (gb,), 0)
    s.build_connector_meta(out(new=[("R", g), ("Bq", gb)], sched={"R": 33, "Bq": 49}))
    r.num_computed_tokens, b.num_computed_tokens = 33, 49
    s.request_finished_all_groups(r, (g,))
    s.gpu_pool.free_blocks(list(reversed(g)))
    m = s.build_connector_meta(out(cached=[("Bq", None)]))
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (0, [4, 5, 6, 1, 2], [3, 4, 5, 1, 2])
    assert s.store_event_to_reqs == {0: ["Bq"]}
    assert s.reqs_to_store["Bq"].store_events == {0}
    assert_clean(s)


@pytest.mark.parametrize("resume", ["mrv2", "mrv1-same-output"])
def test_t6_resume_after_preemption(resume: str) -> None:
    s = make("baseline", cpu=8)
    r = req("R", 3, extra=1)
    g = alloc(s, r, 2)
    s.update_state_after_alloc(r, (g,), 0)
    s.build_connector_meta(out(new=[("R", g)], sched={"R": 32}))
    r.num_computed_tokens = 32
    g2 = alloc(s, r, 2, first_pos=2)
    m = s.build_connector_meta(out(cached=[("R", g2)], sched={"R": 17}))
    assert (m.store_gpu_blocks, m.store_cpu_blocks) == ([1, 2], [1, 2])
    assert s.reqs_to_store["R"].num_stored_blocks == [2]
    complete(s, m.store_event)
    # preemption: blocks freed in reverse order; the scheduler resets the computed count
    s.gpu_pool.free_blocks(list(reversed(g + g2)))
    r.num_computed_tokens = 0
    n = alloc(s, r, 4)
    assert n == [4, 5, 6, 7]
    if resume == "mrv2":
        m = s.build_connector_meta(out(preempted={"R"}))
        assert m.need_flush
        assert s.reqs_to_store["R"].block_ids == [[]]
        assert s.reqs_to_store["R"].num_stored_blocks == [0]
        m = s.build_connector_meta(out(new=[("R", n)], sched={"R": 49}))
    else:  # preemption and MRV1 resume in one output
        m = s.build_connector_meta(out(cached=[("R", n)], sched={"R": 49}, preempted={"R"}, resumed={"R"}))
        assert m.need_flush
    assert m.store_event == -1  # confirmed 0
    assert s.reqs_to_store["R"].block_ids == [n]
    assert s.reqs_to_store["R"].num_stored_blocks == [0]
    r.num_computed_tokens = 49
    m = s.build_connector_meta(out(cached=[("R", None)]))
    # n0, n1 already cached; n2 selected; cursor 3
    assert (m.store_gpu_blocks, m.store_cpu_blocks) == ([6], [3])
    assert s.reqs_to_store["R"].num_stored_blocks == [3]
    assert_clean(s)


def test_t7_reset_with_pins_in_flight_store_and_queued_flush() -> None:
    s = make("baseline", cpu=8)
    a = req("A", 2, extra=1, family=1)
    ga = alloc(s, a, 3)
    a.num_computed_tokens = 33
    s.update_state_after_alloc(a, (ga,), 0)
    m = s.build_connector_meta(out(new=[("A", ga)]))
    complete(s, m.store_event)
    assert cpu_map(s) == {a.block_hashes[0]: [1], a.block_hashes[1]: [2]}
    assert cpu_queue(s) == [3, 4, 5, 6, 7, 1, 2]
    # B (A's prompt) at Phase A: c1, c2 pinned
    b = req("Bq", 2, extra=1, family=1)
    assert s.get_num_new_matched_tokens(b, 0) == (32, True)
    # C's store event 1 in flight
    c = req("C", 2, extra=1)
    gc = alloc(s, c, 3)
    c.num_computed_tokens = 33
    s.update_state_after_alloc(c, (gc,), 0)
    m = s.build_connector_meta(out(new=[("C", gc)]))
    assert (m.store_event, m.store_gpu_blocks, m.store_cpu_blocks) == (1, gc[:2], [3, 4])
    # D finished with a queued flush
    d = req("D", 2, extra=1)
    gd = alloc(s, d, 3)
    s.update_state_after_alloc(d, (gd,), 0)
    d.num_computed_tokens = 33
    s.request_finished_all_groups(d, (gd,))
    s.gpu_pool.free_blocks(list(reversed(gd)))
    assert [(t.gpu_ids, t.cpu_ids) for t in s.pending_finished_stores] == [(gd[:2], [5, 6])]
    assert cpu_queue(s) == [7]
    assert s.gpu_pool.ref_cnt[gd[0]] == 1 and s.gpu_pool.ref_cnt[gd[1]] == 1
    assert s.reset() is False
    assert cpu_queue(s) == [5, 6, 7, 1, 2]
    assert s.gpu_pool.ref_cnt[gd[0]] == 0 and s.gpu_pool.ref_cnt[gd[1]] == 0
    assert sorted(s.abandoned_store_event_to_blocks) == [1]
    assert s.store_event_to_blocks == {} and s.pending_cpu_hits == {} and s.pending_finished_stores == []
    assert cpu_map(s) == {a.block_hashes[0]: [1], a.block_hashes[1]: [2]}
    complete(s, 1)  # the abandoned event's completion only releases refs
    assert cpu_queue(s) == [3, 4, 5, 6, 7, 1, 2]
    assert cpu_map(s) == {a.block_hashes[0]: [1], a.block_hashes[1]: [2]}
    assert s.abandoned_store_event_to_blocks == {}
    assert s.reset() is True
    assert cpu_map(s) == {}
    assert cpu_queue(s) == [3, 4, 5, 6, 7, 1, 2]
    assert_clean(s)


def test_t8_gpu_block_listed_twice_in_one_store() -> None:
    s = make("baseline", cpu=8)
    a = req("A", 3, extra=1)
    g = alloc(s, a, 4)
    assert g == [1, 2, 3, 4]
    s.update_state_after_alloc(a, (g,), 0)
    stale = [3, 2, 3]  # as a stale sliding-window id would produce; fed by hand
    s.build_connector_meta(out(new=[("A", stale)], sched={"A": 49}))
    a.num_computed_tokens = 49
    m = s.build_connector_meta(out(cached=[("A", None)]))
    assert (m.store_gpu_blocks, m.store_cpu_blocks) == ([3, 2, 3], [1, 2, 3])
    assert (s.gpu_pool.ref_cnt[3], s.gpu_pool.ref_cnt[2]) == (3, 2)
    assert [v.id for v in check(s.snapshot(), ["I8"])] == ["I8"]
    s.gpu_pool.free_blocks([4, 3, 2, 1])  # the owner frees in reverse order
    assert s.gpu_pool.ref_cnt[1:5] == [0, 1, 2, 0]
    complete(s, m.store_event)
    h = a.block_hashes
    assert cpu_map(s) == {h[2]: [1, 3], h[1]: [2]}
    assert gpu_queue(s)[-3:] == [1, 2, 3]
    assert s.gpu_pool.get_num_free_blocks() == 15
    assert s.gpu_pool.ref_cnt[1:5] == [0, 0, 0, 0]
    assert_clean(s)

