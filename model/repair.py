"""The ``repair`` policy (kvspec's own, the default): exact records of what the CPU lost.

Terms. A request *owns* position p of group g when the GPU block its list holds at p
carries the request's key for p and is referenced (ref >= 1), and, in a
sliding-window group, p has not left the window (``remove_skipped_blocks`` freed
every position below ``(computed - window + 1) // block_size``; the connector is
not told, so the policy computes it). Null entries are not owned: unlike vLLM's
null recovery, a block found in the GPU prefix cache may have been hashed this
step and not yet computed. A key is *live* when an active
request owns it at a position below its cursor. A CPU entry is *useless* when its
key's parent (the key one position earlier in the chain) is neither cached on CPU
nor being stored: by the chained hash no lookup can reach it.

Rules, each stated once:

* **R1 Exact loss records.** Positions passed by a cursor whose block the request
  owns are indexed by key (``owners``). When a CPU allocation evicts a key that
  is no longer cached anywhere on the CPU, every owner of it gets a *lost record*
  (request, group, position). A record lives until the position is re-stored
  (in flight or cached again) or the request no longer owns it; finishing,
  preemption and reset drop the request's records.
* **R2 Cost.** Planning visits the new positions ``[cursor, ready)`` of scheduled
  requests, the pending lost records and the victims R7 looks at, never
  ``[0, cursor)`` and never the whole CPU pool. Every eviction costs O(owners of the
  key); retiring a key (R7) costs O(1), once per owned position.
* **R3 Soundness.** Only owned, confirmed (below ``ready``), hashed positions are
  stored, under the key the request has for them.
* **R4 Dedup by key.** A key already cached on CPU or being stored (by any
  request, any live transfer, or earlier in this step) is not stored again.
* **R5 Same-step protection (T3).** A CPU entry that the scan judged "already
  cached" is pinned until the planning step (or finish flush) ends, so that
  step's own allocations cannot evict it. The release is an LRU refresh.
* **R6 New work first (H8).** The positional scan allocates first; re-stores use
  only the space left in the step.
* **R7 No thrash (H6), bounded search (H7).** A re-store's CPU block is an
  *acceptable victim*: a free block that is unhashed, not live, or useless; never a
  live, useful entry. For n re-stores, victims are taken in this order: (a) the
  unhashed or not-live entries at the LRU head, up to the first live one; (b)
  *retired* entries, oldest first: keys whose owner finished or was preempted, or
  whose position left a sliding window (a retired key that is owned again is
  dropped; one whose block is pinned or whose store is still in flight waits; an
  evicted key leaves the list); (c) a walk from the head, at most ``2n + 8``
  entries per batch, that refreshes (moves to the MRU end) the live, useful entries
  it meets and takes not-live ones, then, if still short, the useless ones it met
  (their parent is lost, so no lookup reaches them; taken last because the parent
  may come back). A victim not at the head is taken by ``touch`` +
  ``evict_blocks`` (both exist on vLLM's ``BlockPool``), which leaves it exactly as
  an allocation would. Hence a re-store never lowers any request's reachable CPU
  prefix, and the reachable prefix grows with every re-store: no cycle. Re-stores
  per step are bounded by the distinct
  lost keys (C3), and victim search costs O(n + retired keys skipped).
* **R8 Resume (H3).** A record that finds no space or no acceptable victim stays
  pending and is retried at every later planning step, scheduled or not (H1).
* **R9 Finish (H1, H2).** The finish flush stores ``[cursor, ready)`` of the live
  table (with R3-R5), then re-stores the finishing request's own pending records
  with the space left (R6, R7); what still finds no room is dropped with the
  request, which owns nothing afterwards.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.model.block_pool import NULL_BLOCK, BlockPool
from kvspec.model.hashing import BlockKey, key_str
from kvspec.model.rules import window_floor
from kvspec.model.scheduler import (
    ALREADY_CACHED,
    IN_FLIGHT,
    NOT_HASHED,
    READY,
    OffloadScheduler,
    StoreBatch,
    StoreState,
    Transfer,
)

Position = tuple[str, int, int]  # (request id, group, position)
Owners = dict[Position, None]  # ordered, so that records are made in a deterministic order


class RepairScheduler(OffloadScheduler):
    policy_name = "repair"

    @classmethod
    def claims(cls, config: OffloadConfig) -> tuple[str, ...]:
        """Every I-invariant for every configuration, and C2-C7 (C1 only modulo pending repair)."""
        return ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12", "I13", "I14",
                "I15", "C2", "C3", "C4", "C5", "C6", "C7")

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool) -> None:
        super().__init__(config, gpu_pool)
        self.owners: dict[BlockKey, Owners] = {}
        self.lost: dict[Position, BlockKey] = {}
        self.in_flight_keys: dict[BlockKey, int] = {}
        self._held: list[int] = []  # CPU blocks pinned (R5) or refreshed (R7) until the step ends
        self.restores_last_plan = 0
        self.lost_keys_at_repair = 0
        self.visits_last_plan = 0
        self._judged_cached: set[BlockKey] = set()
        self.self_evictions = 0
        self.useful_evicted_by_restores = 0
        self.owned_keys: dict[str, list[BlockKey]] = {}  # per request, keys it was indexed under
        self.window_floor: dict[tuple[str, int], int] = {}  # sliding groups: positions retired so far
        self.retired: OrderedDict[BlockKey, None] = OrderedDict()  # R7 (b), oldest first

    # -- R1: records -------------------------------------------------------------------------

    def _owned_block(self, st: StoreState, ids: list[int], g: int, p: int) -> int | None:
        """The block ``ids[p]`` if the request owns it at (g, p), else None. O(1)."""
        hashes = st.request.block_hashes
        if p >= len(hashes) or p >= len(ids):
            return None
        spec = self.config.groups[g]
        if spec.kind == "sliding":
            computed = st.request.num_computed_tokens
            if p < window_floor(computed, spec.sliding_window, self.block_size):
                return None
        b = ids[p]
        if b == NULL_BLOCK or self.gpu_pool.block_hash[b] != (hashes[p], g) or self.gpu_pool.ref_cnt[b] < 1:
            return None
        return b

    def _is_live(self, key: BlockKey) -> bool:
        """Some active request owns ``key`` below its cursor (stale owners are pruned). O(owners)."""
        owners = self.owners.get(key)
        if not owners:
            return False
        for pos in list(owners):
            rid, g, p = pos
            st = self.reqs_to_store.get(rid)
            if (st is None or st.finished or p >= st.num_stored_blocks[g]
                    or self._owned_block(st, st.block_ids[g], g, p) is None):
                del owners[pos]
        if not owners:
            del self.owners[key]
        return bool(owners)

    def _covered(self, key: BlockKey) -> bool:
        return self.cpu_pool.get_one_block(key) is not None or self.in_flight_keys.get(key, 0) > 0

    def _on_cpu_evictions(self, evicted: list[tuple[int, BlockKey]]) -> None:
        self.self_evictions += sum(1 for _, key in evicted if key in self._judged_cached)
        for _, key in evicted:
            if self.cpu_pool.get_one_block(key) is None:
                self.retired.pop(key, None)
        self._record_losses(evicted)

    def _record_losses(self, evicted: list[tuple[int, BlockKey]]) -> None:
        """R1: owners of an evicted key that the CPU no longer holds get lost records."""
        for _, key in evicted:
            if self.cpu_pool.get_one_block(key) is not None or not self._is_live(key):
                continue
            for pos in self.owners[key]:
                self.lost.setdefault(pos, key)

    def _drop_request(self, rid: str) -> None:
        """The request owns nothing any more: drop its records, retire its keys (R7 b)."""
        for pos in [p for p in self.lost if p[0] == rid]:
            del self.lost[pos]
        for key in self.owned_keys.pop(rid, []):
            self._retire(key)
        for rg in [rg for rg in self.window_floor if rg[0] == rid]:
            del self.window_floor[rg]

    def _retire(self, key: BlockKey) -> None:
        if self._covered(key):  # cached, or cached when its store completes
            self.retired[key] = None

    def _retire_out_of_window(self, st: StoreState, g: int) -> None:
        """Sliding group: keys at positions that left the window since the last call retire."""
        spec = self.config.groups[g]
        if spec.kind != "sliding":
            return
        rid = st.request.request_id
        floor = window_floor(st.request.num_computed_tokens, spec.sliding_window, self.block_size)
        floor = min(floor, st.num_stored_blocks[g], len(st.request.block_hashes))
        for p in range(self.window_floor.get((rid, g), 0), floor):
            self._retire((st.request.block_hashes[p], g))
        self.window_floor[(rid, g)] = max(floor, self.window_floor.get((rid, g), 0))

    # -- scan: R3, R4, R5 ----------------------------------------------------------------------

    def _classify_key(self, gid: int) -> str:
        key = self.gpu_pool.block_hash[gid]
        if key is None:
            return NOT_HASHED
        if self.in_flight_keys.get(key, 0) > 0:
            return IN_FLIGHT
        if self.cpu_pool.get_one_block(key) is not None:
            return ALREADY_CACHED
        return READY

    def _select_eager_blocks_to_store(self, st: StoreState,
                                      ids_by_group: list[list[int]]) -> tuple[list[int], list[int]]:
        selected: list[int] = []
        keys: set[BlockKey] = set()
        advance = [0] * self.num_groups
        rid = st.request.request_id
        for g, ids in enumerate(ids_by_group):
            self._retire_out_of_window(st, g)
            for p in range(st.num_stored_blocks[g], self._ready_blocks(st, ids)):
                self.visits_last_plan += 1
                b = self._owned_block(st, ids, g, p)
                key = None if b is None else self.gpu_pool.block_hash[b]
                if b is None or key is None:  # not owned here, or NOT_HASHED: skipped
                    advance[g] += 1
                    continue
                kind = self._classify_key(b)
                if kind == READY and key in keys:
                    kind = IN_FLIGHT
                free = self.cpu_pool.get_num_free_blocks()
                if kind == READY and len(selected) >= free:
                    break
                if kind == ALREADY_CACHED and self._pin_would_starve(key, len(selected), free):
                    break
                advance[g] += 1
                if kind == NOT_HASHED:
                    continue
                owners = self.owners.setdefault(key, {})
                if (rid, g, p) not in owners:
                    owners[(rid, g, p)] = None
                    self.owned_keys.setdefault(rid, []).append(key)
                if kind == ALREADY_CACHED:
                    self._judged_cached.add(key)
                    cb = self.cpu_pool.get_one_block(key)
                    assert cb is not None, "ALREADY_CACHED: the CPU pool lists the key"
                    self._protect_cached(cb)
                elif kind == READY:
                    selected.append(b)
                    keys.add(key)
        return selected, advance

    def _pin_would_starve(self, key: BlockKey, n_selected: int, free: int) -> bool:
        """Out of space for R5: pinning a free cached entry must leave room for the selection."""
        cb = self.cpu_pool.get_one_block(key)
        return cb in self.cpu_pool.free_queue and free - 1 < n_selected

    def _protect_cached(self, cb: int) -> None:
        """R5: pin a CPU entry judged already cached until the step ends."""
        self.cpu_pool.touch([cb])
        self._held.append(cb)

    # -- planning: R6, R7, R8 ------------------------------------------------------------------

    def _plan_before_scan(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        self.visits_last_plan = 0
        self.restores_last_plan = 0
        for rid in out.preempted_req_ids:
            self._drop_request(rid)

    def _plan_after_scan(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        wanted = self._repair_candidates(None)
        self.lost_keys_at_repair = len({key for _, _, key in wanted})
        done = self._restore(wanted)
        for rid, gid, cid in done:
            batch.req_ids.append(rid)
            batch.gpu_ids.append(gid)
            batch.cpu_ids.append(cid)
        self.restores_last_plan = len(done)
        self._release_held()

    def _repair_candidates(self, finishing: tuple[str, list[list[int]]] | None) -> list[tuple[Position, int, BlockKey]]:
        """Pending records still owned and uncovered, one per key, in record order; drops the
        rest. ``finishing`` = (request, live table) limits them to one request. O(records)."""
        out: list[tuple[Position, int, BlockKey]] = []
        keys: set[BlockKey] = set()
        for pos, key in list(self.lost.items()):
            rid, g, p = pos
            if finishing is not None and rid != finishing[0]:
                continue
            self.visits_last_plan += 1
            st = self.reqs_to_store.get(rid)
            b = None
            if st is not None and not st.finished and p < st.num_stored_blocks[g]:
                ids = finishing[1][g] if finishing is not None else st.block_ids[g]
                b = self._owned_block(st, ids, g, p)
            if b is None or self._covered(key):
                del self.lost[pos]
                continue
            if key not in keys:
                keys.add(key)
                out.append((pos, b, key))
        return out

    def _acceptable_victim(self, cb: int, useless_ok: bool = True) -> bool:
        """R7: a free CPU block may be taken iff it is unhashed, not live, or (when
        ``useless_ok``) useless."""
        key = self.cpu_pool.block_hash[cb]
        if key is None or not self._is_live(key):
            return True
        if not useless_ok:
            return False
        rid, g, p = next(iter(self.owners[key]))  # every owner has the same prefix, so the same parent
        if p == 0:
            return False
        return not self._covered((self.reqs_to_store[rid].request.block_hashes[p - 1], g))

    def _choose_victims(self, n: int) -> list[int]:
        """R7: up to ``n`` acceptable victims, from (a) the head, (b) retired keys, (c) a
        bounded refreshing walk. Refreshed entries stay pinned until the step ends."""
        victims: list[int] = []
        cb: int | None
        for cb in self.cpu_pool.free_queue:  # (a)
            if len(victims) >= n:
                return victims
            self.visits_last_plan += 1
            if not self._acceptable_victim(cb, useless_ok=False):
                break
            victims.append(cb)
        chosen = set(victims)
        deferred: list[BlockKey] = []
        while len(victims) < n and self.retired:  # (b)
            key, _ = self.retired.popitem(last=False)
            self.visits_last_plan += 1
            cb = self.cpu_pool.get_one_block(key)
            if cb is None and self.in_flight_keys.get(key, 0) > 0:
                deferred.append(key)  # its store has not completed yet
                continue
            if cb is None or cb in chosen or self._is_live(key):
                continue
            if self.cpu_pool.ref_cnt[cb] > 0:
                deferred.append(key)
                continue
            victims.append(cb)
            chosen.add(cb)
        for key in deferred:
            self.retired[key] = None
        budget = 2 * n + 8
        useless: list[int] = []  # acceptable only because their parent is lost: taken last
        while len(victims) < n and budget > 0:  # (c)
            cb = next((b for b in self.cpu_pool.free_queue if b not in chosen), None)
            if cb is None:
                break
            budget -= 1
            self.visits_last_plan += 1
            chosen.add(cb)
            if self._acceptable_victim(cb, useless_ok=False):
                victims.append(cb)
            elif self._acceptable_victim(cb):
                useless.append(cb)
            else:
                self.cpu_pool.touch([cb])
                self._held.append(cb)
        return victims + useless[: n - len(victims)]

    def _restore(self, wanted: list[tuple[Position, int, BlockKey]]) -> list[tuple[str, int, int]]:
        """Take R7 victims for ``wanted``; pin and mark them in flight.
        O(len(wanted) + retired keys skipped + the bounded walk)."""
        if not wanted:
            return []
        victims = self._choose_victims(len(wanted))
        if not victims:
            return []
        self.useful_evicted_by_restores += sum(1 for cb in victims if not self._acceptable_victim(cb))
        taken = wanted[: len(victims)]
        self.cpu_pool.touch(victims)
        self.cpu_pool.evict_blocks(victims)
        self._on_cpu_evictions(self.cpu_pool.take_evicted())
        for pos, _, _ in taken:
            self.lost.pop(pos, None)
        self._mark_in_flight([gid for _, gid, _ in taken])
        return [(pos[0], gid, cid) for (pos, gid, _), cid in zip(taken, victims, strict=True)]

    def _mark_in_flight(self, gpu_ids: list[int]) -> None:
        """R4: besides the GPU ids, count the keys being stored."""
        super()._mark_in_flight(gpu_ids)
        for g in gpu_ids:
            key = self.gpu_pool.block_hash[g]
            assert key is not None, "stores are planned for hashed blocks only"
            self.in_flight_keys[key] = self.in_flight_keys.get(key, 0) + 1

    def _release_held(self) -> None:
        self._judged_cached.clear()
        if self._held:
            held, self._held = self._held, []
            self.cpu_pool.free_blocks(held)

    def _on_store_completed(self, t: Transfer) -> None:
        for g in t.gpu_ids:
            key = self.gpu_pool.block_hash[g]
            self._unmark_key(key)

    def _unmark_key(self, key: BlockKey | None) -> None:
        if key is None:
            return
        n = self.in_flight_keys.get(key, 0) - 1
        if n > 0:
            self.in_flight_keys[key] = n
        else:
            self.in_flight_keys.pop(key, None)

    # -- finish: R9 ----------------------------------------------------------------------------

    def _queue_finished_eager_store(self, request: RequestView, block_ids: list[list[int]]) -> None:
        rid = request.request_id
        st = self.reqs_to_store.get(rid)
        if st is None:
            return
        selected, _ = self._select_eager_blocks_to_store(st, block_ids)
        cpu = self._cpu_alloc(len(selected)) if selected else []
        gpu = list(selected)
        self._mark_in_flight(selected)
        for _, gid, cid in self._restore(self._repair_candidates((rid, block_ids))):
            gpu.append(gid)
            cpu.append(cid)
        self._release_held()
        if gpu:
            self.pending_finished_stores.append(Transfer(gpu, cpu))

    def _on_request_finished(self, rid: str) -> None:
        self._drop_request(rid)

    # -- reset ----------------------------------------------------------------------------------

    def _on_reset(self) -> None:
        self.owners.clear()
        self.lost.clear()
        self.in_flight_keys.clear()
        self.owned_keys.clear()
        self.window_floor.clear()
        self.retired.clear()

    # -- observation ----------------------------------------------------------------------------

    def _policy_snapshot(self) -> dict[str, Any]:
        return {
            "lost": sorted([rid, g, p] for rid, g, p in self.lost),
            "in_flight_keys": sorted(key_str(k) for k in self.in_flight_keys),
            "restores_last_plan": self.restores_last_plan,
            "lost_keys_at_repair": self.lost_keys_at_repair,
            "self_evictions": self.self_evictions,
            "useful_evicted_by_restores": self.useful_evicted_by_restores,
        }
