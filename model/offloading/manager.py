"""vLLM's ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``, 0.33.0).

The manager owns the chunk pool and the ref counts; the policy (``lru`` or ``arc``) owns
where chunks live and which is evicted. Rules, each stated once:

* **Pool.** Slots ``0..num_chunks-1``. A new chunk takes a never-used slot while there are
  any (``num_allocated`` counts them), else the slot freed last (the free list is a stack).
* **Ref counts.** A chunk is being stored (``-1``) from ``prepare_store`` until
  ``complete_store``; then ``ref_cnt`` counts the loads in flight: ``prepare_load`` adds
  one per key, ``complete_load`` takes it back. Only ``ref_cnt == 0`` chunks are evictable.
* **Lookup.** ``MISS`` if the key has no chunk, ``HIT_PENDING`` while it is being stored,
  ``HIT`` when ready.
* **Store.** ``prepare_store(keys)`` allocates chunks for the offered keys that have none
  (with ``store_threshold >= 2``: only those offered that many times); when the pool has too
  few free slots it evicts exactly the shortfall through the policy, never one of the
  offered keys. It returns None, allocating nothing, when the shortfall exceeds the
  evictable chunks or the policy cannot find enough; offers, store misses and accesses are
  recorded first either way (as vLLM does). ``complete_store`` makes the keys still being
  stored ready (``success``) or drops them and frees their slots (failure); other keys are
  ignored.
* **Requests.** Every call is made for a request, whose context records the keys it first
  sees (per group, for the policy's finish ordering), inserts and reuses. After
  ``on_request_finished`` a request makes no more submit-side calls (``lookup``,
  ``prepare_*``, ``touch``); its transfers may still complete.
* **Reset.** ``reset_cache`` drops every chunk whatever its ref count (vLLM's connector
  then never completes a transfer from before the reset) and starts a new generation of
  request state.

Calls vLLM's connector never makes are refused with a ``KVSpecError`` before anything
changes: a load of a key that is not ready, a load completed that is not in flight, a key
twice in one call, an unknown or finished request, a malformed key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kvspec.contract.offloading import OffloadingConfig, OffloadKey, PrepareStoreOutput, key_text
from kvspec.contract.offloading_checks import (
    check_keys,
    check_loadable,
    check_loading,
    check_new_request,
    check_positions,
    check_success,
    known_request,
)
from kvspec.model.offloading.arc import ARCPolicy
from kvspec.model.offloading.lru import LRUPolicy
from kvspec.model.offloading.policy import AccessRecord, CachePolicy, Chunk, RequestContext


class OffloadingManager:
    """The model target of the second manager (``OffloadingManagerTarget``)."""

    POLICY_CLASSES: ClassVar[dict[str, Callable[[int], CachePolicy]]] = {"lru": LRUPolicy, "arc": ARCPolicy}

    def __init__(self, config: OffloadingConfig) -> None:
        config.validate()
        self._config = config
        self.policy: CachePolicy = self.POLICY_CLASSES[config.policy](config.num_chunks)
        self.num_allocated = 0
        self.free_list: list[int] = []
        self.num_evictable = 0  # vLLM's _num_evictable_cache_chunks
        self.num_write_pending = 0  # vLLM's _num_write_pending_chunks
        self.generation = 0
        self.requests: dict[str, RequestContext] = {}
        # Offers per key, least recently offered first (vLLM's `counts`; only with a threshold).
        self.offers: dict[OffloadKey, int] | None = {} if config.store_threshold >= 2 else None

    @property
    def config(self) -> OffloadingConfig:
        return self._config

    # -- requests ----------------------------------------------------------------------------

    def _ctx(self, req_id: str, submit: bool) -> RequestContext:
        return known_request(req_id, self.requests, submit, lambda ctx: ctx.closed)

    def _record(self, ctx: RequestContext) -> AccessRecord:
        """The request's access record of this generation, made anew after a reset."""
        if ctx.access is None or ctx.access.generation != self.generation:
            ctx.access = AccessRecord(self.generation)
        return ctx.access

    def _record_access(self, ctx: RequestContext, keys: Sequence[OffloadKey],
                       reused: Sequence[OffloadKey] = ()) -> None:
        """Keys seen for the first time join their group's list and the policy hears of them;
        reused keys are recorded unless this request inserted them."""
        rec = self._record(ctx)
        new = [k for k in keys if k not in rec.seen]
        for key in new:
            rec.key_groups.setdefault(key[1], []).append(key)
            rec.seen.add(key)
        if new:
            self.policy.on_request_access(new, ctx)
        rec.reused.update(k for k in reused if k not in rec.inserted)

    def on_new_request(self, req_id: str) -> None:
        check_new_request(req_id, self.requests)
        ctx = RequestContext(req_id)
        self._record(ctx)
        self.requests[req_id] = ctx

    def set_key_positions(self, req_id: str, positions: Sequence[tuple[OffloadKey, int]]) -> None:
        """``ReqContext.set_offload_key_position`` for each pair (later pairs win)."""
        ctx = self._ctx(req_id, submit=True)
        check_positions(positions)
        for key, position in positions:
            ctx.positions[key] = position

    def on_request_finished(self, req_id: str) -> None:
        """Hand the request's accesses to the policy in prefix order, once. O(k log k)."""
        ctx = self._ctx(req_id, submit=False)
        ctx.closed = True
        rec = ctx.access
        if rec is None or rec.generation != self.generation or rec.finished:
            return
        rec.finished = True
        groups = []
        for g in sorted(rec.key_groups):
            keys = rec.key_groups[g]
            if all(k in ctx.positions for k in keys):
                keys = sorted(keys, key=ctx.positions.__getitem__)
            groups.append(keys)
        self.policy.on_request_finished(groups, rec.inserted - rec.reused, rec.reused, ctx)

    # -- lookups and loads ---------------------------------------------------------------------

    def lookup(self, req_id: str, key: OffloadKey) -> str:
        self._ctx(req_id, submit=True)
        check_keys([key])
        chunk = self.policy.get(key)
        if chunk is None:
            return "MISS"
        return "HIT" if chunk.is_ready else "HIT_PENDING"

    def prepare_load(self, req_id: str, keys: Sequence[OffloadKey]) -> list[int]:
        """Pin every key (``ref_cnt += 1``) and return their slots. O(k)."""
        ctx = self._ctx(req_id, submit=True)
        check_keys(keys)
        check_loadable(keys, self._ref_cnt)
        ready = [c for k in keys if (c := self.policy.get(k)) is not None]
        for key, chunk in zip(keys, ready, strict=True):
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self.num_evictable -= 1
            chunk.ref_cnt += 1
        self._record_access(ctx, keys, reused=keys)
        return [c.chunk_id for c in ready]

    def _ref_cnt(self, key: OffloadKey) -> int | None:
        chunk = self.policy.get(key)
        return None if chunk is None else chunk.ref_cnt

    def touch(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        ctx = self._ctx(req_id, submit=True)
        check_keys(keys)
        self.policy.touch(list(keys), ctx)

    def complete_load(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """Unpin every key; a chunk left with no load becomes evictable. O(k)."""
        self._ctx(req_id, submit=False)
        check_keys(keys)
        check_loading(keys, self._ref_cnt)
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    # -- stores -------------------------------------------------------------------------------

    def _num_free(self) -> int:
        return len(self.free_list) + self._config.num_chunks - self.num_allocated

    def _allocate(self, n: int) -> list[Chunk]:
        """Never-used slots first, in order, then the most recently freed. O(n)."""
        fresh = min(n, self._config.num_chunks - self.num_allocated)
        chunks = [Chunk(self.num_allocated + i) for i in range(fresh)]
        self.num_allocated += fresh
        chunks += [Chunk(self.free_list.pop()) for _ in range(n - fresh)]
        return chunks

    def _count_offers(self, keys: Sequence[OffloadKey]) -> None:
        """vLLM ``_record_accesses``: count the offer of every key; a key not tracked yet
        enters with 1, making room by dropping the least recently offered key that this
        offer did not count again (if there is none, the key is not tracked). O(k)."""
        assert self.offers is not None
        counted = set()
        for key in keys:
            if key in self.offers:
                self.offers[key] = self.offers.pop(key) + 1
                counted.add(key)
        uncounted = len(self.offers) - len(counted)
        for key in keys:
            if key in self.offers:
                continue
            if len(self.offers) >= self._config.max_tracker_size:
                if uncounted == 0:
                    continue
                del self.offers[next(iter(self.offers))]
                uncounted -= 1
            self.offers[key] = 1

    def prepare_store(self, req_id: str, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        ctx = self._ctx(req_id, submit=True)
        check_keys(keys)
        keys = list(keys)
        if self.offers is not None:
            self._count_offers(keys)
        to_store = [k for k in keys if self.policy.get(k) is None]
        ready = [k for k in keys if (c := self.policy.get(k)) is not None and c.is_ready]
        if self.offers is not None:
            to_store = [k for k in to_store if self.offers.get(k, 0) >= self._config.store_threshold]
        rec = self._record(ctx)
        misses = [k for k in to_store if k not in rec.store_misses]
        if misses:
            self.policy.on_store_miss(misses, ctx)
            rec.store_misses.update(misses)
        recorded = set(to_store) | set(ready)
        self._record_access(ctx, [k for k in keys if k in recorded], reused=ready)
        if not to_store:
            return PrepareStoreOutput([], [], [])
        shortfall = len(to_store) - self._num_free()
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            if shortfall > self.num_evictable:
                return None
            victims = self.policy.evict(shortfall, protected=set(keys))
            if victims is None:
                return None
            self.num_evictable -= len(victims)
            for key, chunk in victims:
                self.free_list.append(chunk.chunk_id)
                evicted.append(key)
        chunks = self._allocate(len(to_store))
        for key, chunk in zip(to_store, chunks, strict=True):
            self.policy.insert(key, chunk, ctx)
        self.num_write_pending += len(to_store)
        rec.inserted.update(to_store)
        return PrepareStoreOutput(to_store, [c.chunk_id for c in chunks], evicted)

    def complete_store(self, req_id: str, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Keys still being stored become ready (evictable), or on failure lose their chunk. O(k)."""
        self._ctx(req_id, submit=False)
        check_keys(keys)
        check_success(success)
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self.num_write_pending -= 1
            if success:
                chunk.ref_cnt = 0
                self.num_evictable += 1
                self.policy.mark_evictable(key)
            else:
                self.policy.remove(key)
                self.free_list.append(chunk.chunk_id)

    def reset_cache(self) -> None:
        self.policy.clear()
        self.generation += 1
        self.num_evictable = 0
        self.num_write_pending = 0
        self.free_list.clear()
        self.num_allocated = 0

    # -- observation --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return snapshot_of(self)

    def _check(self) -> None:
        """Slots: resident and free ones distinct, below ``num_allocated``, together all of
        them; the two counters equal what they count; the policy's own check."""
        resident = self.policy.resident()
        used = [c.chunk_id for c in resident.values()]
        assert len(set(used)) == len(used) and len(set(self.free_list)) == len(self.free_list)
        assert not set(used) & set(self.free_list)
        assert sorted(used + self.free_list) == list(range(self.num_allocated))
        assert self.num_allocated <= self._config.num_chunks
        assert self.num_evictable == sum(c.ref_cnt == 0 for c in resident.values())
        assert self.num_write_pending == sum(c.ref_cnt == -1 for c in resident.values())
        assert all(c.ref_cnt >= -1 for c in resident.values())
        self.policy._check()


def snapshot_of(m: OffloadingManager) -> dict[str, Any]:
    """The canonical snapshot (SPEC.md §9): every field read off the model's state."""
    resident = m.policy.resident()
    requests: dict[str, Any] = {}
    for rid, ctx in sorted(m.requests.items()):
        rec = ctx.access if ctx.access is not None and ctx.access.generation == m.generation else None
        requests[rid] = None if rec is None else {
            "finished": rec.finished,
            "seen": sorted(key_text(k) for k in rec.seen),
            "inserted": sorted(key_text(k) for k in rec.inserted),
            "reused": sorted(key_text(k) for k in rec.reused),
            "store_misses": sorted(key_text(k) for k in rec.store_misses),
        }
    return {
        "manager": "offloading",
        "config": m.config.to_json(),
        "chunks": {key_text(k): {"chunk": c.chunk_id, "ref_cnt": c.ref_cnt} for k, c in sorted(resident.items())},
        "free_list": list(m.free_list),
        "num_allocated": m.num_allocated,
        "counters": {"evictable": m.num_evictable, "write_pending": m.num_write_pending},
        "policy": {m.config.policy: m.policy.snapshot()},
        "offers": None if m.offers is None else [[key_text(k), n] for k, n in m.offers.items()],
        "requests": requests,
    }


def make_offloading_manager(config: OffloadingConfig) -> OffloadingManager:
    return OffloadingManager(config)
