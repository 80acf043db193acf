"""Hazards of the #47235 fix (docs/vllm-semantics.md §12.2, H1-H8) and traces T2, T3, on every policy.

Each scenario runs through the engine model on ``baseline`` (vLLM 0.33.0),
``signal-rescan`` (PR #47235) and ``repair`` (kvspec's policy) and asserts, per
policy, exactly which catalogue properties are violated at some point of the run
and at its end, plus what the hazard is about (hit lengths, copies per step,
cursors, duplicates). Properties not listed hold. In short:

* ``baseline`` loses completeness (C1, and C2 since it keeps no records) whenever the
  CPU evicts below a cursor, and never repairs it.
* ``signal-rescan`` repairs only what its one flag lets it see: it fails H1 (flag
  consumed by another request), H2/T3 (victim finishes first), H3 (rescan out of
  space, flag gone), H4 (stores a block another request owns now: I10), H5
  (duplicate re-stores: C3), H6 (thrash: copies every step, hit oscillates) and H8
  (re-stores starve new blocks: the cursor stalls).
* ``repair`` keeps C2, C3 and I1-I15 everywhere; C1 may lag only while a record is
  pending, and holds at the end whenever the CPU can hold the live working set.

The last section re-expresses the four tests PR #47235 adds, on ``signal-rescan``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from scenario_kit import SYNC, alloc, complete, cpu_hit, cpu_map, make, out, req

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.types import SchedulerOutput
from kvspec.drivers.engine import Engine, prompt_tokens
from kvspec.model import make_scheduler
from kvspec.model.block_pool import BlockPool
from kvspec.model.hashing import block_hashes
from kvspec.model.hit_search import find_longest_cache_hit
from kvspec.model.rules import GroupScan, Rescan, rescan_group, scan_group
from kvspec.model.scheduler import OffloadScheduler
from kvspec.model.signal_rescan import SignalRescanOptions, SignalRescanPolicy
from kvspec.oracle.catalogue import check

POLICIES = ("baseline", "signal-rescan", "repair")
DRAIN = "drain"


class Run:
    """An engine run that records every catalogue violation seen after each operation."""

    def __init__(self, policy: str, **cfg: Any) -> None:
        self.e = Engine(make_scheduler(OffloadConfig(policy=policy, **{**SYNC, **cfg})))
        self.seen: set[str] = set()
        self.stores: list[list[int]] = []  # GPU ids stored by each step

    def do(self, ops: Iterable[Any], keep: frozenset[int] = frozenset()) -> Run:
        """Apply ops; ``DRAIN`` reports every store event (except ``keep``) and every load."""
        for op in ops:
            if op == DRAIN:
                for ev in sorted(self.e.reports_left):
                    if ev not in keep:
                        self.e.apply({"op": "report", "event": ev, "count": self.e.reports_left[ev]})
                for rid in sorted(self.e.loads_shipped):
                    self.e.apply({"op": "load_done", "rid": rid})
            else:
                result = self.e.apply(op)
                if op["op"] == "step":
                    self.stores.append(list(result.store_gpu_blocks))
            self.seen |= self.ids()
        return self

    def steps(self, n: int, keep: frozenset[int] = frozenset(), **step: Any) -> Run:
        for _ in range(n):
            self.do([{"op": "step", **step}, DRAIN], keep)
        return self

    def ids(self) -> set[str]:
        return {v.id for v in check(self.e.snapshot())}

    def hit(self, family: int, prompt_len: int) -> int:
        """CPU hit in tokens for a fresh prompt of ``family`` (no pin taken)."""
        hashes = block_hashes(prompt_tokens(family, prompt_len), self.e.B)
        return find_longest_cache_hit(self.e.target.cpu_pool, hashes, prompt_len - 1, self.e.config.groups,
                                      self.e.B)[1]

    @property
    def sched(self) -> Any:
        return self.e.target


def add(rid: str, family: int, prompt_len: int, max_tokens: int = 40) -> dict[str, Any]:
    return {"op": "add", "rid": rid, "family": family, "prompt_len": prompt_len, "max_tokens": max_tokens}


def step(**kw: Any) -> dict[str, Any]:
    return {"op": "step", **kw}


def finish(rid: str) -> dict[str, Any]:
    return {"op": "finish", "rid": rid}


C12 = {"C1", "C2"}


def assert_outcome(run: Run, policy: str, seen: dict[str, set[str]], end: dict[str, set[str]]) -> None:
    assert (run.seen, run.ids()) == (seen[policy], end[policy])


# -- T2: mid-request eviction by another request; the best hit comes back under repair --------


def t2_by_another(policy: str) -> Run:
    """R (6 blocks + 1 token) is stored; Q's 3-block store evicts R's H1 and H2 while R
    decodes; Q then finishes, so its entries stop being live."""
    r = Run(policy, num_cpu_blocks=8)
    r.do([add("R", 1, 97), step(admit=["R"], chunk=64), step(), DRAIN, step(), DRAIN])
    assert r.hit(1, 97) == 96
    r.do([add("Q", 2, 49, 2), step(admit=["Q"]), DRAIN, step(), DRAIN, step(), DRAIN, finish("Q"), DRAIN])
    return r


@pytest.mark.parametrize("policy", POLICIES)
def test_t2_eviction_by_another_request(policy: str) -> None:
    r = t2_by_another(policy)
    r.steps(4)
    # 7 usable CPU blocks hold all 6 full blocks of R's prompt, so the best possible hit for
    # a new request with R's prompt is the whole cap: num_tokens - 1 = 96 tokens (6 blocks).
    best = {"baseline": 0, "signal-rescan": 96, "repair": 96}
    assert r.hit(1, 97) == best[policy]
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12, "repair": {"C1"}},
                   end={"baseline": C12, "signal-rescan": set(), "repair": set()})


def test_t2_repair_gives_the_full_hit_to_the_same_prompt() -> None:
    r = t2_by_another("repair").steps(2)
    r.do([add("R2", 1, 97)])
    r2 = r.e.requests["R2"]
    assert r.sched.get_num_new_matched_tokens(r2, 0) == (96, True)  # every full block of the prompt
    assert [b for g in r.sched.pending_cpu_hits["R2"].blocks for b in g] == [
        r.sched.cpu_pool.get_one_block((h, 0)) for h in r2.block_hashes[:6]]
    assert not r.ids() - {"C1"}


# -- T3 / H2: same-step self-eviction -------------------------------------------------------------


def t3(policy: str, finish_at_once: bool) -> Run:
    """X (family 7) and Y (family 8) stored their 2 blocks and finished: CPU [a0, a1, b0, b1].
    A (family 7, 4 blocks + 1 token) judges a0, a1 already cached and stores its blocks 2, 3."""
    r = Run(policy, num_cpu_blocks=5)
    r.do([add("X", 7, 33, 1), add("Y", 8, 33, 1),
          step(admit=["X"]), finish("X"), step(), DRAIN,
          step(admit=["Y"]), finish("Y"), step(), DRAIN,
          add("A", 7, 65, 3), step(admit=["A"]), step(), DRAIN])
    if finish_at_once:  # A's state is gone before any later step could look back
        r.do([finish("A"), step(), DRAIN])
    else:
        r.steps(2)
    return r


@pytest.mark.parametrize("finish_at_once", [True, False], ids=["victim-finishes", "victim-runs-on"])
@pytest.mark.parametrize("policy", POLICIES)
def test_t3_h2_same_step_self_eviction(policy: str, finish_at_once: bool) -> None:
    r = t3(policy, finish_at_once)
    # A's prompt has 65 tokens: the best hit is 4 blocks (64 tokens), and 4 CPU blocks hold it
    if finish_at_once:
        hits = {"baseline": 0, "signal-rescan": 0, "repair": 64}
        end: dict[str, set[str]] = {"baseline": set(), "signal-rescan": set(), "repair": set()}
    else:
        hits = {"baseline": 0, "signal-rescan": 64, "repair": 64}
        end = {"baseline": C12, "signal-rescan": set(), "repair": set()}
    assert r.hit(7, 65) == hits[policy]
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12, "repair": set()}, end=end)
    if policy == "repair":
        assert r.e.snapshot()["scheduler"]["policy_state"]["self_evictions"] == 0


# -- H1: the flag is consumed by whoever is scheduled ---------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_h1_flag_consumed_by_another_request(policy: str) -> None:
    r = Run(policy, num_cpu_blocks=7)
    r.do([add("R1", 1, 49, 1), add("X", 3, 33, 1), step(admit=["R1", "X"]), DRAIN, step(), DRAIN,
          finish("X"), step(), DRAIN])
    # R1 is done generating but not finished: from now on it is never scheduled
    assert r.e.requests["R1"].num_computed_tokens == r.e.requests["R1"].num_tokens
    r.do([add("R2", 2, 49, 30), step(admit=["R2"]), DRAIN,
          step(), DRAIN])  # R2's store evicts R1's first entries
    r.steps(4)  # R2 is scheduled every step; R1 never is
    if policy == "signal-rescan":
        assert r.sched.policy.eviction_flag is False  # consumed by R2's step
    assert r.hit(1, 49) == {"baseline": 0, "signal-rescan": 0, "repair": 48}[policy]
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12, "repair": set()},
                   end={"baseline": C12, "signal-rescan": C12, "repair": set()})


# -- H3: Phase 1a runs out of space; the flag is gone --------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_h3_rescan_out_of_space(policy: str) -> None:
    r = Run(policy, num_cpu_blocks=5)
    r.do([add("R", 1, 33, 12), add("Y", 8, 33, 1),
          step(admit=["R"]), step(), DRAIN,
          step(admit=["Y"]), finish("Y"), step(), DRAIN,
          add("Z", 2, 33, 6), add("W", 3, 33, 6), step(admit=["Z", "W"]),
          step(),  # Z's and W's stores take all 4 CPU blocks: R's H1, H2 are evicted
          step()])  # both stores are still in flight: the CPU free count is 0 for R's rescan
    if policy == "signal-rescan":
        assert r.sched.policy.eviction_flag is False
        assert r.stores[-1] == []
    r.do([DRAIN]).steps(2)
    r.do([finish("Z"), finish("W")]).steps(2)  # space comes back, but no new eviction
    assert r.hit(1, 33) == {"baseline": 0, "signal-rescan": 0, "repair": 32}[policy]
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12, "repair": {"C1"}},
                   end={"baseline": C12, "signal-rescan": C12, "repair": set()})


# -- H4: stale sliding-window ids below the cursor (ownership) ------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_h4_stale_sliding_window_id_owned_by_another_request(policy: str) -> None:
    r = Run(policy, num_cpu_blocks=7, num_gpu_blocks=13, groups=(KVGroup(), KVGroup("sliding", 16)))
    r.do([add("R", 1, 65, 10), add("Q", 2, 17, 3),
          step(admit=["R"]), step(), DRAIN, step(), DRAIN])
    # R's sliding positions 0..2 left the window and were freed; the connector still lists them
    assert r.e.requests["R"].table[1][:3] == [0, 0, 0]
    stale = set(r.sched.reqs_to_store["R"].block_ids[1][:3])
    r.do([step(admit=["Q"])])  # Q gets stale blocks and hashes them for its own positions
    reused = stale & set(r.e.requests["Q"].table[1])
    assert reused
    stored_stale = reused & set(r.stores[-1])
    assert bool(stored_stale) == (policy == "signal-rescan")
    i10 = [v for v in check(r.e.snapshot()) if v.id == "I10"]
    assert sorted(v.blocks for v in i10) == sorted((b,) for b in stored_stale)
    r.do([DRAIN]).steps(1)
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12 | {"I10"}, "repair": {"C1"}},
                   end={"baseline": C12, "signal-rescan": C12, "repair": {"C1"}})
    if policy == "repair":
        assert not r.ids() - {"C1"}  # what C1 misses is recorded for repair (C2)


# -- H5: duplicate hashes across requests ---------------------------------------------------------


def _dup_keys(r: Run) -> int:
    return sum(1 for ids in r.e.snapshot()["cpu_pool"]["cached"].values() if len(ids) > 1)


@pytest.mark.parametrize("policy", POLICIES)
def test_h5_duplicate_hashes_across_requests(policy: str) -> None:
    """R1 and R2 share a prompt; R2 joins mid-prefill, so both hold *different* GPU blocks for
    H3, H4 (the GPU map allows it). CPU pressure evicts those keys."""
    r = Run(policy, num_cpu_blocks=5, num_gpu_blocks=32)
    r.do([add("R1", 1, 97, 30), add("R2", 1, 97, 30), step(admit=["R1", "R2"], chunk=32)])
    t1, t2 = r.e.requests["R1"].table[0], r.e.requests["R2"].table[0]
    assert t1[:2] == t2[:2]
    r.steps(1, chunk=32)
    assert r.e.requests["R1"].table[0][2:4] != r.e.requests["R2"].table[0][2:4]
    max_dup = 0
    for _ in range(7):
        r.do([step(chunk=32)])
        max_dup = max(max_dup, _dup_keys(r))
        r.do([DRAIN])
        max_dup = max(max_dup, _dup_keys(r))
    # signal-rescan re-stores one key from two GPU blocks in one event (C3) and the CPU
    # map then holds the key twice; the others store a key once
    assert (max_dup > 0) == (policy == "signal-rescan")
    # ... and the engine sees its scan's allocations evict entries it passed as cached (C5) and
    # live, reachable ones (C6)
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12 | {"C3", "C5", "C6"},
                                    "repair": {"C1"}},
                   end={"baseline": C12, "signal-rescan": C12, "repair": {"C1"}})


# -- H6: thrash (T2 continued, 4 usable CPU blocks, a 6-block decoding request) -------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_h6_thrash(policy: str) -> None:
    r = Run(policy, num_cpu_blocks=5)
    r.do([add("R", 1, 97), step(admit=["R"], chunk=64), step(), DRAIN, step(), DRAIN])  # T2 t1..t3
    hits, copies = [], []
    for _ in range(9):
        r.steps(1)
        hits.append(r.hit(1, 97) // 16)
        copies.append(len(r.stores[-1]))
    if policy == "baseline":  # {H3..H6} on the CPU, hit 0, no traffic
        assert (hits, copies) == ([0] * 9, [0] * 9)
    elif policy == "signal-rescan":  # period-3 cycle, 2 copies every step, forever
        assert (hits, copies) == ([2, 4, 0] * 3, [2] * 9)
    else:  # converges to the best hit 4 CPU blocks allow (H1..H4), then no traffic
        assert hits[-1] == 4 and hits == sorted(hits)
        assert copies[-4:] == [0] * 4 and sum(copies) <= 4
        assert sorted(k.partition(":")[0] for k in r.e.snapshot()["cpu_pool"]["cached"]) == sorted(
            r.e.requests["R"].block_hashes[:4])
    # the cycle is what the engine sees as C6: re-stores evict live, reachable entries
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12 | {"C6"}, "repair": {"C1"}},
                   end={"baseline": C12, "signal-rescan": C12, "repair": {"C1"}})


# -- H7: cost ---------------------------------------------------------------------------------------


def _visits_under_churn(policy: str, stored_blocks: int) -> int:
    """Visits of the planning step right after a churn request evicted 2 entries, with
    ``stored_blocks`` blocks stored below the cursors of decoding requests."""
    n_req = 4
    per = stored_blocks // n_req
    cpu = stored_blocks + 4
    r = Run(policy, num_cpu_blocks=cpu, num_gpu_blocks=stored_blocks + 64,
            max_num_batched_tokens=1 << 20)
    for i in range(n_req):
        r.do([add(f"R{i}", 10 + i, per * 16 + 1, 60)])
    r.do([step(admit=[f"R{i}" for i in range(n_req)], chunk=per * 16 + 1), DRAIN, step(), DRAIN])
    for k in range(3):  # each churn request stores 2 blocks: 2 evictions per step
        r.do([add(f"C{k}", 100 + k, 33, 1), step(admit=[f"C{k}"]), finish(f"C{k}"), DRAIN])
    r.do([step()])
    return int(r.sched.policy.visits_last_plan)


@pytest.mark.parametrize("policy", ["signal-rescan", "repair"])
def test_h7_visits_per_step(policy: str) -> None:
    small, large = _visits_under_churn(policy, 64), _visits_under_churn(policy, 512)
    if policy == "signal-rescan":  # rescans every cursor: grows with what is stored
        assert large >= 512 - 8 and large > 4 * small
    else:  # pending records and the few new positions only
        assert large == small and large <= 32


def test_h7_the_visit_count_is_the_last_plans_own() -> None:
    """``visits_last_plan`` counts what the last planning step looked at: nothing before any plan,
    and a plan that scans nothing after one that scanned counts nothing."""
    r = Run("signal-rescan")
    assert r.sched.policy.visits_last_plan == 0
    r.do([add("A", 1, 40), step(admit=["A"]), step()])  # the second build sees A's 2 confirmed blocks
    assert r.sched.policy.visits_last_plan == 2
    r.sched.build_connector_meta(SchedulerOutput())
    assert r.sched.policy.visits_last_plan == 0


@pytest.mark.parametrize("clears", [False, True])
def test_signal_rescan_reset_keeps_the_flag_unless_told(clears: bool) -> None:
    """PR #47235's open detail ``reset_clears_flag``: by default a reset leaves the eviction flag
    set (one spurious rescan follows); with the option it clears it. A reset never sets it."""
    sched = OffloadScheduler(OffloadConfig(policy="signal-rescan", **SYNC), BlockPool(16, "gpu", 1),
                             lambda s: SignalRescanPolicy(s, SignalRescanOptions(reset_clears_flag=clears)))
    sched.reset()
    assert sched.policy.eviction_flag is False
    sched.policy.eviction_flag = True
    sched.reset()
    assert sched.policy.eviction_flag is not clears


def test_h7_a_phase_visits_what_it_passes_and_where_it_stops() -> None:
    """The visit count behind the H7 figures, exactly: a scan passes the positions before its stop
    and looks at the one it stops at (``stopped``); each of PR #47235's two phases counts so."""
    assert scan_group([False, True, True], taken=0, free=1) == GroupScan([1], 2, True)
    assert scan_group([True, False], taken=0, free=5) == GroupScan([0], 2, False)
    # Phase 1a passes position 0 and stops at 1 (2 visits), Phase 1b stops at once (1)
    assert rescan_group([True, True], [True], taken=0, free=1, oos_stops_scan=False).visits == 3
    assert rescan_group([True, False], [True], taken=0, free=5, oos_stops_scan=False).visits == 3  # no stop
    assert rescan_group([True, True], [True], taken=0, free=1, oos_stops_scan=True) == Rescan([0], [], 0, 2)


# -- H8: priority inversion -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_h8_restores_starve_new_blocks(policy: str) -> None:
    """W's store never completes (its 2 CPU blocks stay pinned), leaving 4 usable. R
    (12 blocks + 1 token) prefills 4 blocks per step; its own stores evict its prefix."""
    r = Run(policy, num_cpu_blocks=7, num_gpu_blocks=32)
    keep = frozenset({0})
    r.do([add("W", 2, 33), add("R", 1, 193), step(admit=["W"]), step()])
    assert r.stores[-1] and r.e.reports_left == {0: 1}
    r.do([step(admit=["R"], chunk=64)])
    cursors, hits = [], []
    for _ in range(9):
        r.steps(1, keep=keep, chunk=64)
        cursors.append(r.sched.reqs_to_store["R"].num_stored_blocks[0])
        hits.append(r.hit(1, 193) // 16)
    assert r.e.requests["R"].num_computed_tokens // 16 == 12
    if policy == "signal-rescan":  # Phase 1a takes the space first every step: stuck at 8 of 12
        assert cursors[-5:] == [8] * 5
        assert all(len(s) == 4 for s in r.stores[-5:])  # 4 re-store copies every step
        assert hits[-4:] in ([0, 4, 0, 4], [4, 0, 4, 0])  # and the prefix comes and goes
    else:
        assert cursors[-5:] == [12] * 5
    if policy == "baseline":
        assert hits[-3:] == [0, 0, 0]
    if policy == "repair":  # new blocks first, then the prefix, as far as 4 free blocks go
        assert hits[-3:] == [4, 4, 4] and r.stores[-2:] == [[], []]
    # Phase 1a's re-stores evict live, reachable entries of the new blocks (C6)
    assert_outcome(r, policy, seen={"baseline": C12, "signal-rescan": C12 | {"C6"}, "repair": {"C1"}},
                   end={"baseline": C12, "signal-rescan": C12, "repair": {"C1"}})


# -- PR #47235's own tests, on our API (signal-rescan) -----------------------------------------------


def test_pr_eviction_signal_set_and_consumed() -> None:
    s = make("signal-rescan", cpu=5)
    a, b, c = req("A", 2), req("B", 2), req("C", 2)
    for rq in (a, b):
        g = alloc(s, rq, 3)
        rq.num_computed_tokens = 33
        s.update_state_after_alloc(rq, (g,), 0)
        complete(s, s.build_connector_meta(out(new=[(rq.request_id, g)])).store_event)
    assert s.policy.eviction_flag is False  # fresh CPU blocks: nothing evicted
    gc = alloc(s, c, 3)
    c.num_computed_tokens = 33
    s.update_state_after_alloc(c, (gc,), 0)
    s.cpu_pool.take_evicted()
    s.allocate_cpu(2)  # what C's store would allocate: pops A's two entries
    assert s.policy.eviction_flag is True
    assert s.policy.consume_eviction_signal() is True
    assert s.policy.consume_eviction_signal() is False
    assert s.policy.eviction_flag is False


def test_pr_phase1a_restore_enables_cache_hit() -> None:
    s = make("signal-rescan", cpu=5)
    a, b = req("A", 2), req("B", 2)
    ga, gb = alloc(s, a, 3), alloc(s, b, 3)
    a.num_computed_tokens = b.num_computed_tokens = 33
    for rq, g in ((a, ga), (b, gb)):
        s.update_state_after_alloc(rq, (g,), 0)
    complete(s, s.build_connector_meta(out(new=[("A", ga), ("B", gb)])).store_event)
    c = req("C", 2)
    gc = alloc(s, c, 3)
    c.num_computed_tokens = 33
    s.update_state_after_alloc(c, (gc,), 0)
    complete(s, s.build_connector_meta(out(new=[("C", gc)], cached=[("A", None)])).store_event)
    assert cpu_hit(s, a) == 0  # C's store evicted A's entries (the LRU head)
    m = s.build_connector_meta(out(cached=[("A", None)]))  # flag consumed: Phase 1a
    assert m.store_gpu_blocks == ga[:2]
    complete(s, m.store_event)
    same = req("A2", 2)
    same.tokens, same.block_hashes = a.tokens, a.block_hashes
    assert s.get_num_new_matched_tokens(same, 0) == (32, True)  # a full CPU hit: no re-prefill
    assert s.reqs_to_store["A"].num_stored_blocks == [2]


def test_pr_in_flight_store_protected() -> None:
    s = make("signal-rescan", cpu=5)
    a, b = req("A", 2), req("B", 3)
    ga = alloc(s, a, 3)
    a.num_computed_tokens = 33
    s.update_state_after_alloc(a, (ga,), 0)
    ma = s.build_connector_meta(out(new=[("A", ga)]))  # in flight, not completed
    gb = alloc(s, b, 4)
    b.num_computed_tokens = 49
    s.update_state_after_alloc(b, (gb,), 0)
    mb = s.build_connector_meta(out(new=[("B", gb)]))
    # only the 2 CPU blocks not held by A's store are free: B stores 2, A's destinations stay
    assert set(mb.store_cpu_blocks).isdisjoint(ma.store_cpu_blocks)
    assert len(mb.store_cpu_blocks) == 2
    assert [s.cpu_pool.ref_cnt[c] for c in ma.store_cpu_blocks] == [1, 1]
    complete(s, ma.store_event)
    assert cpu_map(s) == {a.block_hashes[0]: [ma.store_cpu_blocks[0]], a.block_hashes[1]: [ma.store_cpu_blocks[1]]}


def test_pr_active_request_blocks_can_be_evicted() -> None:
    s = make("signal-rescan", cpu=3)
    a, b = req("A", 2), req("B", 2)
    ga = alloc(s, a, 3)
    a.num_computed_tokens = 33
    s.update_state_after_alloc(a, (ga,), 0)
    complete(s, s.build_connector_meta(out(new=[("A", ga)])).store_event)
    assert cpu_hit(s, a) == 32
    gb = alloc(s, b, 3)
    b.num_computed_tokens = 33
    s.update_state_after_alloc(b, (gb,), 0)
    m = s.build_connector_meta(out(new=[("B", gb)]))
    assert m.store_cpu_blocks == [1, 2]  # A's CPU blocks, although A is active
    assert cpu_hit(s, a) == 0
    # A's GPU side is independent: still referenced by A and still hashed
    assert [s.gpu_pool.ref_cnt[g] for g in ga] == [1, 1, 1]
    assert all(s.gpu_pool.block_hash[g] is not None for g in ga[:2])
    assert s.policy.eviction_flag is True


def test_preemption_retires_the_request_keys() -> None:
    """R1/R7 (b): a preempted request owns nothing any more: its records and owner index go, and
    its keys still on the CPU become retired victims, oldest first (as at finish). Found as the
    only survivor of the mutation table (``preempted-keep-records``): records are dropped later
    anyway, so only the victim order would show it."""
    e = Engine(make_scheduler(OffloadConfig(num_cpu_blocks=5, policy="repair")))
    e.op_add("R", family=1, prompt_len=97, max_tokens=8)
    e.op_step(admit=["R"], chunk=64)
    e.op_step(chunk=64)  # R's first 4 blocks stored
    e.op_report(0)
    policy = e.target.policy
    keys = [(h, 0) for h in e.requests["R"].block_hashes[:4]]
    assert policy.owned_keys["R"] == keys and not policy.retired
    e.op_step(preempt=["R"])
    assert "R" not in policy.owned_keys
    assert list(policy.retired) == keys
