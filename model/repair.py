"""The ``repair`` policy (kvspec's own, the default): exact records of what the CPU lost.

Terms. A request *owns* position p of group g when the GPU block its list holds at p
carries the request's key for p and is referenced (ref >= 1), and, in a
sliding-window group, p has not left the window (``remove_skipped_blocks`` freed
every position below ``(computed - window + 1) // block_size``; the connector is
not told, so the policy computes it). A *retained copy* of a confirmed position the
request does not own is a GPU block that carries the request's key for p and that
nobody references (ref 0: a free GPU prefix-cache entry): the list's block at p
when it carries that key (a sliding-window block freed but still hashed), else the
GPU prefix cache's block for the key (vLLM's null recovery). A key is *live* when an active
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
* **R3 Soundness.** Only confirmed (below ``ready``), hashed positions are stored, under
  the key the request has for them, from the block the request owns there or else from
  a retained copy. A retained copy holds its key's data: vLLM hashes a block when it
  schedules the tokens that fill it, the forward of that step writes them, and a block
  reaches the free queue only at a later step (preemption takes requests not scheduled
  in the step; async scheduling defers the free of blocks a batch in flight writes). A
  referenced block the request does not own is never stored: another request may have
  hashed it in this very step, before the forward that computes it (I10). A retained
  copy is not owned: it is stored as new work (R4 applies), never indexed, pinned or
  recorded as lost.
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
  ``evict_blocks`` (both exist on vLLM's ``BlockPool``; ``OffloadScheduler.take_cpu_blocks``),
  which leaves it exactly as an allocation would. Hence a re-store never lowers any request's reachable CPU
  prefix, and the reachable prefix grows with every re-store: no cycle. Re-stores
  per step are bounded by the distinct
  lost keys (C3), and victim search costs O(n + retired keys skipped).
* **R8 Resume (H3).** A record that finds no space or no acceptable victim stays
  pending and is retried at every later planning step, scheduled or not (H1).
* **R9 Finish (H1, H2).** The finish flush stores ``[cursor, ready)`` of the live
  table (with R3-R5), then re-stores the finishing request's own pending records
  with the space left (R6, R7); what still finds no room is dropped with the
  request, which owns nothing afterwards.

Where the rules live: R3-R5 at one position of the scan are ``rules.repair_step``, the
scan of a group ``rules.repair_scan``; the
store classes by key are ``rules.classify_store_candidate``; confirmed blocks and the
window floor are ``rules.ready_blocks`` and ``rules.window_floor``. R7's victim order is
not a pure function of lists: it classifies CPU entries lazily, one at a time as it
walks (a classification prunes the owner index), and that laziness is its cost bound (R2).
The public methods are the rules as steps a variant may override (``kvspec.model.bugs``):
ownership, retained copies and loss records (``owned_block``, ``retained_block``,
``record_losses``: R1, R3), classification
by key (``classify_key``: R4), the same-step pin (``protect_cached``: R5), the pending
records (``repair_candidates``: R8) and the victims (``choose_victims``: R7).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar, NamedTuple

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.model.baseline import BaselinePolicy, Selection
from kvspec.model.block_pool import NULL_BLOCK
from kvspec.model.hashing import BlockKey, key_str
from kvspec.model.rules import (
    ALREADY_CACHED,
    NOT_OWNED,
    PASS,
    PIN,
    READY,
    RETAINED,
    SELECT,
    classify_store_candidate,
    repair_scan,
    window_floor,
)
from kvspec.model.scheduler import Evicted, OffloadScheduler, StoreBatch, StoreState, Transfer

Position = tuple[str, int, int]  # (request id, group, position)
Owners = dict[Position, None]  # ordered, so that records are made in a deterministic order


class Candidate(NamedTuple):
    """A pending record to re-store: its position, the GPU block the request owns there, its key."""

    position: Position
    gpu_id: int
    key: BlockKey


class Finishing(NamedTuple):
    """The request whose finish flush is running, and its live block table."""

    rid: str
    block_ids: list[list[int]]


class Restore(NamedTuple):
    """One planned re-store: the request it serves, the GPU block copied, the CPU victim."""

    rid: str
    gpu_id: int
    cpu_id: int


class RepairPolicy(BaselinePolicy):
    """kvspec's re-store policy: exact loss records, re-stored after the new work (R1-R9)."""

    name: ClassVar[str] = "repair"

    @classmethod
    def claims(cls, config: OffloadConfig) -> tuple[str, ...]:
        """Every I-invariant for every configuration, and C2-C8 (C1 only modulo pending repair)."""
        return ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12", "I13", "I14",
                "I15", "C2", "C3", "C4", "C5", "C6", "C7", "C8")

    def __init__(self, sched: OffloadScheduler) -> None:
        super().__init__(sched)
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

    def owned_block(self, st: StoreState, ids: list[int], g: int, p: int) -> int | None:
        """The block ``ids[p]`` if the request owns it at (g, p), else None: it carries the
        request's key for p, is referenced, and (sliding group) p is not below the window
        floor (``rules.window_floor``). O(1)."""
        hashes = st.request.block_hashes
        if p >= len(hashes) or p >= len(ids):
            return None
        spec = self.sched.config.groups[g]
        if spec.kind == "sliding":
            r = st.request
            if p < window_floor(r.num_computed_tokens, r.num_output_placeholders, spec.sliding_window,
                                self.sched.block_size):
                return None
        b = ids[p]
        gpu = self.sched.gpu_pool
        if b == NULL_BLOCK or gpu.block_hash[b] != (hashes[p], g) or gpu.ref_cnt[b] < 1:
            return None
        return b

    def retained_block(self, st: StoreState, ids: list[int], g: int, p: int) -> int | None:
        """R3: a retained copy for (g, p): the GPU block ``ids[p]`` if it carries the request's key
        for p, else the GPU prefix cache's block for that key, when nobody references it (ref 0);
        None otherwise. O(1)."""
        hashes = st.request.block_hashes
        if p >= len(hashes) or p >= len(ids):
            return None
        gpu = self.sched.gpu_pool
        b = ids[p]
        if b == NULL_BLOCK or gpu.block_hash[b] != (hashes[p], g):
            got = gpu.get_cached_block(hashes[p], [g])
            if got is None:
                return None
            b = got[0]
        return b if gpu.ref_cnt[b] == 0 else None

    def _is_live(self, key: BlockKey) -> bool:
        """Some active request owns ``key`` below its cursor (stale owners are pruned). O(owners)."""
        owners = self.owners.get(key)
        if not owners:
            return False
        for pos in list(owners):
            rid, g, p = pos
            st = self.sched.store_state(rid)
            if (st is None or st.finished or p >= st.num_stored_blocks[g]
                    or self.owned_block(st, st.block_ids[g], g, p) is None):
                del owners[pos]
        if not owners:
            del self.owners[key]
        return bool(owners)

    def _covered(self, key: BlockKey) -> bool:
        """The CPU holds ``key``, or a store of it is in flight. O(1)."""
        return self.sched.cpu_pool.get_one_block(key) is not None or self.in_flight_keys.get(key, 0) > 0

    def on_cpu_evictions(self, evicted: Evicted) -> None:
        """Count self-evictions (C5), drop evicted keys from the retired list (R7 b), record
        the losses (R1). O(evicted x owners)."""
        self.self_evictions += sum(1 for _, key in evicted if key in self._judged_cached)
        for _, key in evicted:
            if self.sched.cpu_pool.get_one_block(key) is None:
                self.retired.pop(key, None)
        self.record_losses(evicted)

    def record_losses(self, evicted: Evicted) -> None:
        """R1: owners of an evicted key that the CPU no longer holds get lost records. O(evicted x owners)."""
        for _, key in evicted:
            if self.sched.cpu_pool.get_one_block(key) is not None or not self._is_live(key):
                continue
            for pos in self.owners[key]:
                self.lost.setdefault(pos, key)

    def _register_owner(self, rid: str, g: int, p: int, key: BlockKey) -> None:
        """R1: index position (rid, g, p) under ``key`` (once). O(1)."""
        owners = self.owners.setdefault(key, {})
        if (rid, g, p) not in owners:
            owners[(rid, g, p)] = None
            self.owned_keys.setdefault(rid, []).append(key)

    def _drop_request(self, rid: str) -> None:
        """The request owns nothing any more: drop its records, retire its keys (R7 b).
        O(records + keys of the request)."""
        for pos in [p for p in self.lost if p[0] == rid]:
            del self.lost[pos]
        for key in self.owned_keys.pop(rid, []):
            self._retire(key)
        for rg in [rg for rg in self.window_floor if rg[0] == rid]:
            del self.window_floor[rg]

    def _retire(self, key: BlockKey) -> None:
        """R7 b: a key nobody needs any more is a victim candidate, if it is (or will be) cached."""
        if self._covered(key):  # cached, or cached when its store completes
            self.retired[key] = None

    def _retire_out_of_window(self, st: StoreState, g: int) -> None:
        """Sliding group: keys at positions that left the window since the last call retire."""
        spec = self.sched.config.groups[g]
        if spec.kind != "sliding":
            return
        rid = st.request.request_id
        r = st.request
        floor = window_floor(r.num_computed_tokens, r.num_output_placeholders, spec.sliding_window,
                             self.sched.block_size)
        floor = min(floor, st.num_stored_blocks[g], len(st.request.block_hashes))
        for p in range(self.window_floor.get((rid, g), 0), floor):
            self._retire((st.request.block_hashes[p], g))
        self.window_floor[(rid, g)] = max(floor, self.window_floor.get((rid, g), 0))

    # -- scan: R3, R4, R5 ----------------------------------------------------------------------

    def classify_key(self, gid: int) -> str:
        """R4: ``rules.classify_store_candidate`` by key: in flight when any store of the
        block's key is (``in_flight_keys``), cached when the CPU holds the key. O(1)."""
        key = self.sched.gpu_pool.block_hash[gid]
        in_flight = key is not None and self.in_flight_keys.get(key, 0) > 0
        cached = key is not None and self.sched.cpu_pool.get_one_block(key) is not None
        return classify_store_candidate(False, key is not None, in_flight, cached)

    def select(self, st: StoreState, ids_by_group: list[list[int]]) -> Selection:
        """The scan of ``[cursor, ready)`` of every group (``rules.repair_step`` at each
        position), after retiring the keys that left a sliding window. Unlike the baseline,
        a group is scanned even once the selection fills the free count: it may still pass
        positions and index owners. O(positions scanned)."""
        selected: list[int] = []
        cursors = list(st.num_stored_blocks)
        for g, ids in enumerate(ids_by_group):
            self._retire_out_of_window(st, g)
            cursors[g] += self._scan_group(st, g, ids, selected)
        return Selection(selected, cursors)

    def _scan_group(self, st: StoreState, g: int, ids: list[int], selected: list[int]) -> int:
        """One group's scan: what each position of ``[cursor, ready)`` is (owned block and its key
        class, else a retained copy whose class is READY, and whether the key's cached CPU entry is
        free), decided by ``rules.repair_scan`` with the CPU free count now (its pins lower it);
        then the decisions applied: owners indexed, entries pinned, selections appended. Keys carry
        their group, so the dedup of R4 within the request is per group. Returns the cursor
        advance. O(ready - cursor)."""
        cpu = self.sched.cpu_pool
        rid = st.request.request_id
        positions = range(st.num_stored_blocks[g], self.sched.ready_blocks(st, ids))
        owned = [self.owned_block(st, ids, g, p) for p in positions]
        kinds = [NOT_OWNED if b is None else self.classify_key(b) for b in owned]
        blocks = list(owned)
        for k, p in enumerate(positions):
            if owned[k] is None:
                kept = self.retained_block(st, ids, g, p)
                if kept is not None and self.classify_key(kept) == READY:
                    kinds[k], blocks[k] = RETAINED, kept
        keys = [None if b is None else self.sched.gpu_pool.block_hash[b] for b in blocks]
        cached = [cpu.get_one_block(key) if kind == ALREADY_CACHED and key is not None else None
                  for kind, key in zip(kinds, keys, strict=True)]
        numbered: dict[BlockKey | None, int] = {}
        scan = repair_scan(kinds, [numbered.setdefault(key, len(numbered)) for key in keys],
                           [cb is not None and cb in cpu.free_queue for cb in cached], len(selected),
                           cpu.get_num_free_blocks())
        self.visits_last_plan += len(scan.steps) + scan.stopped
        for p, step, b, key, cb, mine in zip(positions, scan.steps, blocks, keys, cached, owned, strict=False):
            if step == PASS:
                continue
            assert b is not None and key is not None, "repair_scan passes every position without a hashed source"
            if mine is not None:
                self._register_owner(rid, g, p, key)
            if step == PIN:
                assert cb is not None, "ALREADY_CACHED: the CPU pool lists the key"
                self._judged_cached.add(key)
                self.protect_cached(cb)
            elif step == SELECT:
                selected.append(b)
        return len(scan.steps)

    def protect_cached(self, cb: int) -> None:
        """R5: pin a CPU entry judged already cached until the step ends. O(1)."""
        self.sched.cpu_pool.touch([cb])
        self._held.append(cb)

    # -- planning: R6, R7, R8 ------------------------------------------------------------------

    def plan_eager(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        """Preempted requests drop their records; the positional scan of every scheduled request
        (R3-R5) allocates first; then the pending records are re-stored with what is left
        (R6-R8), and the step's pins are released. O(positions scanned + records + victims)."""
        self.visits_last_plan = 0
        self.restores_last_plan = 0
        for rid in out.preempted_req_ids:
            self._drop_request(rid)
        super().plan_eager(out, batch)
        wanted = self.repair_candidates(None)
        self.lost_keys_at_repair = len({c.key for c in wanted})
        done = self._restore(wanted)
        for r in done:
            batch.req_ids.append(r.rid)
            batch.gpu_ids.append(r.gpu_id)
            batch.cpu_ids.append(r.cpu_id)
        self.restores_last_plan = len(done)
        self._release_held()

    def allocate(self, batch: StoreBatch, rid: str, gpu_ids: list[int]) -> None:
        """The baseline's allocation, and the keys being stored are counted in flight (R4)."""
        self.sched.allocate_store(batch, rid, gpu_ids)
        self._count_in_flight_keys(gpu_ids)

    def repair_candidates(self, finishing: Finishing | None) -> list[Candidate]:
        """R8: pending records still owned and uncovered, one per key, in record order; drops
        the rest. ``finishing`` limits them to one request, read in its live table. O(records)."""
        out: list[Candidate] = []
        keys: set[BlockKey] = set()
        for pos, key in list(self.lost.items()):
            rid, g, p = pos
            if finishing is not None and rid != finishing.rid:
                continue
            self.visits_last_plan += 1
            st = self.sched.store_state(rid)
            b = None
            if st is not None and not st.finished and p < st.num_stored_blocks[g]:
                ids = finishing.block_ids[g] if finishing is not None else st.block_ids[g]
                b = self.owned_block(st, ids, g, p)
            if b is None or self._covered(key):
                del self.lost[pos]
                continue
            if key not in keys:
                keys.add(key)
                out.append(Candidate(pos, b, key))
        return out

    def _acceptable_victim(self, cb: int, useless_ok: bool = True) -> bool:
        """R7: a free CPU block may be taken iff it is unhashed, not live, or (when
        ``useless_ok``) useless. O(owners of its key)."""
        key = self.sched.cpu_pool.block_hash[cb]
        if key is None or not self._is_live(key):
            return True
        if not useless_ok:
            return False
        rid, g, p = next(iter(self.owners[key]))  # every owner has the same prefix, so the same parent
        if p == 0:
            return False
        st = self.sched.store_state(rid)
        assert st is not None, "a live key's owners are active requests"
        return not self._covered((st.request.block_hashes[p - 1], g))

    def choose_victims(self, n: int) -> list[int]:
        """R7: up to ``n`` acceptable victims, from (a) the head, (b) retired keys, (c) a
        bounded refreshing walk. Refreshed entries stay pinned until the step ends.
        O(n + retired keys skipped)."""
        victims = self._head_victims(n)
        if len(victims) >= n:
            return victims
        chosen = set(victims)
        self._retired_victims(n, victims, chosen)
        return self._walk_victims(n, victims, chosen)

    def _head_victims(self, n: int) -> list[int]:
        """R7 (a): the unhashed or not-live entries at the LRU head, up to the first live one. O(n)."""
        victims: list[int] = []
        for cb in self.sched.cpu_pool.free_queue:
            if len(victims) >= n:
                break
            self.visits_last_plan += 1
            if not self._acceptable_victim(cb, useless_ok=False):
                break
            victims.append(cb)
        return victims

    def _retired_victims(self, n: int, victims: list[int], chosen: set[int]) -> None:
        """R7 (b): retired keys, oldest first, appended to ``victims``; a key owned again is
        dropped, one pinned or still being stored waits. O(retired keys looked at)."""
        cpu = self.sched.cpu_pool
        deferred: list[BlockKey] = []
        while len(victims) < n and self.retired:
            key, _ = self.retired.popitem(last=False)
            self.visits_last_plan += 1
            cb = cpu.get_one_block(key)
            if cb is None and self.in_flight_keys.get(key, 0) > 0:
                deferred.append(key)  # its store has not completed yet
                continue
            if cb is None or cb in chosen or self._is_live(key):
                continue
            if cpu.ref_cnt[cb] > 0:
                deferred.append(key)
                continue
            victims.append(cb)
            chosen.add(cb)
        for key in deferred:
            self.retired[key] = None

    def _walk_victims(self, n: int, victims: list[int], chosen: set[int]) -> list[int]:
        """R7 (c): walk at most ``2n + 8`` free entries from the head: not-live ones are taken,
        live useful ones refreshed (pinned until the step ends), useless ones taken last.
        O(n) entries."""
        cpu = self.sched.cpu_pool
        budget = 2 * n + 8
        useless: list[int] = []  # acceptable only because their parent is lost: taken last
        while len(victims) < n and budget > 0:
            cb = next((b for b in cpu.free_queue if b not in chosen), None)
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
                cpu.touch([cb])
                self._held.append(cb)
        return victims + useless[: n - len(victims)]

    def _restore(self, wanted: list[Candidate]) -> list[Restore]:
        """Take R7 victims for ``wanted``; pin and mark them in flight.
        O(len(wanted) + retired keys skipped + the bounded walk)."""
        if not wanted:
            return []
        victims = self.choose_victims(len(wanted))
        if not victims:
            return []
        self.useful_evicted_by_restores += sum(1 for cb in victims if not self._acceptable_victim(cb))
        taken = wanted[: len(victims)]
        self.sched.take_cpu_blocks(victims)
        for c in taken:
            self.lost.pop(c.position, None)
        self._mark_in_flight([c.gpu_id for c in taken])
        return [Restore(c.position[0], c.gpu_id, cid) for c, cid in zip(taken, victims, strict=True)]

    def _mark_in_flight(self, gpu_ids: list[int]) -> None:
        """The scheduler's marking, and the keys being stored are counted (R4). O(len(gpu_ids))."""
        self.sched.mark_in_flight(gpu_ids)
        self._count_in_flight_keys(gpu_ids)

    def _count_in_flight_keys(self, gpu_ids: list[int]) -> None:
        """R4: count the keys of GPU blocks whose store is planned. O(len(gpu_ids))."""
        for g in gpu_ids:
            key = self.sched.gpu_pool.block_hash[g]
            assert key is not None, "stores are planned for hashed blocks only"
            self.in_flight_keys[key] = self.in_flight_keys.get(key, 0) + 1

    def _release_held(self) -> None:
        """The step (or flush) ends: R5 pins and R7 refreshes are released (an LRU refresh)."""
        self._judged_cached.clear()
        if self._held:
            held, self._held = self._held, []
            self.sched.cpu_pool.free_blocks(held)

    def on_store_completed(self, completed: Transfer) -> None:
        """The stored keys are no longer in flight. O(len(completed.gpu_ids))."""
        for g in completed.gpu_ids:
            self._unmark_key(self.sched.gpu_pool.block_hash[g])

    def _unmark_key(self, key: BlockKey | None) -> None:
        if key is None:
            return
        n = self.in_flight_keys.get(key, 0) - 1
        if n > 0:
            self.in_flight_keys[key] = n
        else:
            self.in_flight_keys.pop(key, None)

    # -- finish: R9 ----------------------------------------------------------------------------

    def finish_flush(self, request: RequestView, block_ids: list[list[int]]) -> None:
        """R9: the scan of ``[cursor, ready)`` of the live table, then the request's own pending
        records with the space left; one flush transfer for both. O(positions + records)."""
        rid = request.request_id
        st = self.sched.store_state(rid)
        assert st is not None, "finish_flush is called for requests with store state only"
        selected = self.select(st, block_ids).gpu_ids
        cpu = self.sched.allocate_cpu(len(selected)) if selected else []
        gpu = list(selected)
        self._mark_in_flight(selected)
        for r in self._restore(self.repair_candidates(Finishing(rid, block_ids))):
            gpu.append(r.gpu_id)
            cpu.append(r.cpu_id)
        self._release_held()
        if gpu:
            self.sched.queue_flush(Transfer(gpu, cpu))

    def on_request_finished(self, rid: str) -> None:
        """R9: the finished request owns nothing any more."""
        self._drop_request(rid)

    # -- reset ----------------------------------------------------------------------------------

    def on_reset(self) -> None:
        """Every record, owner, count and retired key refers to abandoned work: forgotten."""
        self.owners.clear()
        self.lost.clear()
        self.in_flight_keys.clear()
        self.owned_keys.clear()
        self.window_floor.clear()
        self.retired.clear()

    # -- observation ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Records, keys in flight and the re-store counters."""
        return {
            "lost": sorted([rid, g, p] for rid, g, p in self.lost),
            "in_flight_keys": sorted(key_str(k) for k in self.in_flight_keys),
            "restores_last_plan": self.restores_last_plan,
            "lost_keys_at_repair": self.lost_keys_at_repair,
            "self_evictions": self.self_evictions,
            "useful_evicted_by_restores": self.useful_evicted_by_restores,
        }
