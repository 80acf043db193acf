"""vLLM 0.33.0's ``SimpleCPUOffloadScheduler``: the mechanism every re-store policy shares.

The scheduler owns a CPU ``BlockPool`` and is bound to the GPU pool. It copies GPU
blocks to CPU (stores) and CPU hits back (loads), and keeps the bookkeeping that makes
those copies safe; a *re-store policy* (``kvspec.contract.policy.StorePolicy``) decides
which GPU blocks an eager step stores.

Rules (section numbers refer to docs/vllm-semantics.md):

* **Hit and pin (§7.3):** a lookup finds the longest CPU hit after the GPU-local hit,
  leaving at least one token to compute, and pins the hit blocks (CPU ref +1) until
  ``update_state_after_alloc`` consumes the pin, a new lookup or the finish drops it,
  or ``reset`` releases it.
* **Load registration (§7.4):** the accepted part of the hit is loaded into the GPU
  blocks that follow the local hit; both sides get a ref for the transfer.
* **Eager stores (§7.6):** the scheduler keeps each request's store state (the GPU
  ids accumulated from the step outputs, one cursor per group; a preempted request
  starts over, a full table replaces the ids) and asks its *policy* which positions to
  store. A selected GPU block gets a CPU block (the allocation may *evict* a cached
  entry, which the policy is told) and both are pinned until the store completes.
  Which positions are selected, and what happens to entries evicted below a cursor,
  is the policy's: ``kvspec.model.baseline`` is vLLM 0.33.0's scan and its FIXME.
* **Lazy stores (§7.7):** free hashed GPU blocks near the GPU LRU head that the CPU
  does not hold are copied; a cursor into the GPU free queue resumes the walk.
* **Events (§7.5):** at most one store and one load event per step; event ids count
  up forever. Finish-flush transfers join the next store event after the scan.
* **Completion (§7.8, §7.9):** worker counts accumulate across steps; at
  ``world_size`` the event completes: each CPU block is registered under its GPU
  block's key read *now*, then both sides are freed (CPU blocks to the MRU tail).
* **Finish (§7.10, §7.13):** an eager request's policy queues the finish flush of its
  live table (CPU blocks allocated now, the copies join the next store event); the
  request state is removed, or kept until its last store event completes.
* **Reset (§7.12):** pins and queued flushes are released, sent transfers are
  abandoned (their refs held until the workers report), store state forgotten;
  True iff nothing abandoned remains and the CPU cache could be cleared.

The policy is an object the scheduler holds (``self.policy``), built from
``POLICY_REGISTRY[config.policy].model`` unless a factory is passed. It implements
``StorePolicy`` with the model's types (``ModelPolicy``: a ``StoreBatch``, the evicted
(CPU block, key) pairs, a completed ``Transfer``) and is called at the points its
methods name: ``plan_eager`` inside ``build_connector_meta`` after the preemption reset,
``finish_flush`` for an eager request's finish, ``on_cpu_evictions`` after every CPU
allocation or take, ``on_store_completed``, ``on_request_finished``, ``on_reset``, and
``snapshot`` for ``policy_state``. What a policy may use of the scheduler is its
*policy-facing interface* (documented below, under that heading): ``store_state`` and
``scheduled_store_states`` (per-request store state), ``ready_blocks``,
``store_source``, ``classify`` and ``ready_sources`` (what a position holds),
``allocate_cpu`` and ``take_cpu_blocks`` (CPU blocks, evictions reported to the
policy), ``mark_in_flight``, ``allocate_store`` and ``queue_flush`` (stores), plus the
pools and the configuration. Everything else here is the scheduler's own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from kvspec.contract.checks import (
    check_block_ids,
    check_count,
    check_request,
    check_scheduler_output,
    check_worker_output,
    name_of,
)
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import InvalidOperationError
from kvspec.contract.policy import POLICY_REGISTRY, StorePolicy
from kvspec.contract.snapshot import Transfer as Transfer_
from kvspec.contract.snapshot import scheduler_section
from kvspec.contract.types import (
    BlockIds,
    ConnectorMetadata,
    KVConnectorOutput,
    RequestView,
    SchedulerOutput,
    yield_req_data,
)
from kvspec.model.block_pool import NULL_BLOCK, BlockPool
from kvspec.model.hashing import BlockKey
from kvspec.model.hit_search import find_longest_cache_hit
from kvspec.model.rules import READY, classify_store_candidate, ready_blocks


@dataclass
class Transfer:
    """vLLM ``TransferMeta``: parallel lists of GPU and CPU block ids."""

    gpu_ids: list[int]
    cpu_ids: list[int]

    def to_json(self) -> dict[str, list[int]]:
        return {"gpu": list(self.gpu_ids), "cpu": list(self.cpu_ids)}


@dataclass
class PendingHit:
    """A Phase-A pin: the CPU hit found by a lookup, held until allocation."""

    blocks: list[list[int]]
    hit_len: int
    num_computed_tokens: int


@dataclass
class LoadState:
    request: RequestView
    transfer: Transfer
    load_event: int | None = None
    finished: bool = False


@dataclass
class StoreState:
    """Per-request eager store state: accumulated GPU ids and one cursor per group."""

    request: RequestView
    block_ids: list[list[int]]
    num_stored_blocks: list[int]
    store_events: set[int] = field(default_factory=set)
    finished: bool = False


@dataclass
class StoreBatch:
    """What one planning step selects: GPU ids, CPU ids and the requests they serve."""

    gpu_ids: list[int] = field(default_factory=list)
    cpu_ids: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)


Evicted: TypeAlias = list[tuple[int, BlockKey]]
"""What one CPU allocation evicted: (CPU block, key) pairs, in eviction order."""

ModelPolicy: TypeAlias = StorePolicy[StoreBatch, Evicted, Transfer]
"""The re-store policy contract with the model's types; the model's policies subclass it,
so that mypy checks every method against the contract."""

PolicyFactory: TypeAlias = Callable[["OffloadScheduler"], ModelPolicy]
"""Builds a scheduler's policy, bound to that scheduler (a policy class is one)."""


class PolicyClass(Protocol):
    """A model policy class as the registry names it: a factory that also states its claims."""

    def __call__(self, sched: OffloadScheduler) -> ModelPolicy: ...

    def claims(self, config: OffloadConfig) -> tuple[str, ...]:
        """Invariant ids the policy guarantees under ``config``."""
        ...


def policy_class(name: str) -> PolicyClass:
    """The model's class for policy ``name``: ``POLICY_REGISTRY[name].model``
    (``module:attribute``), imported now. O(1) after the first import."""
    module, _, attribute = POLICY_REGISTRY[name].model.partition(":")
    cls: PolicyClass = getattr(importlib.import_module(module), attribute)
    return cls


class OffloadScheduler:
    """vLLM 0.33.0's offload scheduler around a re-store policy (``self.policy``)."""

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool, policy: PolicyFactory | None = None) -> None:
        """``policy`` builds the re-store policy; by default the registry's class for
        ``config.policy``."""
        config.validate()
        self.config = config
        self.gpu_pool = gpu_pool
        self.cpu_pool = BlockPool(config.num_cpu_blocks, "cpu", config.num_groups)
        self.block_size = config.block_size
        self.num_groups = config.num_groups
        self.lazy_mode = config.lazy_offload
        self.target_free = config.lazy_target_free()
        self.lazy_cursor: int | None = None
        # loads
        self.reqs_to_load: dict[str, LoadState] = {}
        self.load_event_to_reqs: dict[int, list[str]] = {}
        self.abandoned_reqs_to_load: dict[str, LoadState] = {}
        self.pending_cpu_hits: dict[str, PendingHit] = {}
        # stores
        self.store_event_to_blocks: dict[int, Transfer] = {}
        self.abandoned_store_event_to_blocks: dict[int, Transfer] = {}
        self.pending_finished_stores: list[Transfer] = []
        self.reqs_to_store: dict[str, StoreState] = {}
        self.store_event_to_reqs: dict[int, list[str]] = {}
        self.in_flight_store_gpu_blocks: set[int] = set()
        # counters
        self.load_event_counter = 0
        self.store_event_counter = 0
        self.store_event_pending_counts: dict[int, int] = {}
        self.policy: ModelPolicy = (policy or policy_class(config.policy))(self)

    # == loads: lookup (Phase A) and registration (Phase B) ====================================

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """CPU hit after ``num_computed_tokens`` local tokens; pins it. O(hashes x groups)."""
        check_request(request, "get_num_new_matched_tokens")
        check_count(num_computed_tokens, "num_computed_tokens", request.num_tokens)
        stale = self.pending_cpu_hits.pop(request.request_id, None)
        if stale is not None:
            self._free_pending_cpu_hit(stale)
        if request.skip_reading_prefix_cache or num_computed_tokens % self.block_size:
            return 0, False
        hashes = request.block_hashes[num_computed_tokens // self.block_size :]
        max_len = request.num_tokens - 1 - num_computed_tokens
        if not hashes or max_len <= 0:
            return 0, False
        blocks, hit_len = find_longest_cache_hit(
            self.cpu_pool, hashes, max_len, self.config.groups, self.block_size
        )
        if hit_len == 0:
            return 0, False
        self.cpu_pool.touch(b for g in blocks for b in g if b != NULL_BLOCK)
        self.pending_cpu_hits[request.request_id] = PendingHit(blocks, hit_len, num_computed_tokens)
        return hit_len, True

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        """Register store state once; turn the pinned hit into a load of the accepted part."""
        rid = check_request(request, "update_state_after_alloc")
        ids = check_block_ids(block_ids, self.num_groups, self.gpu_pool.num_blocks, "update_state_after_alloc",
                                none_groups=False)
        check_count(num_external_tokens, "num_external_tokens", request.num_tokens)
        pending = self.pending_cpu_hits.get(rid)
        load: Transfer | None = None
        if num_external_tokens > 0 and pending is not None:
            if num_external_tokens % self.block_size:
                raise InvalidOperationError(
                    f"{name_of(rid)}: num_external_tokens {num_external_tokens} is not a multiple of "
                    f"the block size {self.block_size}"
                )
            if num_external_tokens > pending.hit_len:
                raise InvalidOperationError(
                    f"{name_of(rid)}: accepted {num_external_tokens} external tokens of a {pending.hit_len}-token hit"
                )
            if rid in self.reqs_to_load:
                raise InvalidOperationError(f"{name_of(rid)}: a load is already registered")
            load = self._load_pairs(rid, ids, pending, num_external_tokens)
        # -- all checks done; mutate --
        if not self.lazy_mode and rid not in self.reqs_to_store:
            self.reqs_to_store[rid] = StoreState(request, [[] for _ in range(self.num_groups)],
                                                 [0] * self.num_groups)
        self.pending_cpu_hits.pop(rid, None)
        if pending is None or num_external_tokens == 0 or load is None:
            if pending is not None:
                self._free_pending_cpu_hit(pending)
            return
        self.cpu_pool.touch(load.cpu_ids)
        self._free_pending_cpu_hit(pending)
        self.gpu_pool.touch(load.gpu_ids)
        self.reqs_to_load[rid] = LoadState(request, load)

    def _load_pairs(self, rid: str, ids: BlockIds, pending: PendingHit, ext: int) -> Transfer:
        gpu: list[int] = []
        cpu: list[int] = []
        for g, hits in enumerate(pending.blocks):
            start = pending.num_computed_tokens // self.block_size
            for i, cb in enumerate(hits[: -(-ext // self.block_size)]):
                if cb == NULL_BLOCK:
                    continue
                if start + i >= len(ids[g]) or ids[g][start + i] == NULL_BLOCK:
                    raise InvalidOperationError(
                        f"{name_of(rid)}: group {g} has no allocated GPU block at position {start + i} for the load"
                    )
                gpu.append(ids[g][start + i])
                cpu.append(cb)
        return Transfer(gpu, cpu)

    def _free_pending_cpu_hit(self, pending: PendingHit) -> None:
        self.cpu_pool.free_blocks(b for g in pending.blocks for b in g if b != NULL_BLOCK)

    # == planning: build_connector_meta ========================================================

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """Plan this step's stores and ship pending loads: at most one event of each."""
        self._check_scheduler_output(scheduler_output)
        batch = self._plan_lazy() if self.lazy_mode else self._plan_eager(scheduler_output)
        for t in self.pending_finished_stores:
            batch.gpu_ids += t.gpu_ids
            batch.cpu_ids += t.cpu_ids
        self.pending_finished_stores.clear()
        meta = ConnectorMetadata(need_flush=bool(scheduler_output.preempted_req_ids))
        if batch.gpu_ids:
            e = self.store_event_counter
            self.store_event_counter += 1
            self.store_event_to_blocks[e] = Transfer(batch.gpu_ids, batch.cpu_ids)
            if batch.req_ids:
                self.store_event_to_reqs[e] = batch.req_ids
                for r in batch.req_ids:
                    if r in self.reqs_to_store:
                        self.reqs_to_store[r].store_events.add(e)
            meta.store_event, meta.store_gpu_blocks, meta.store_cpu_blocks = e, batch.gpu_ids, batch.cpu_ids
        unsent = [r for r, st in self.reqs_to_load.items() if st.load_event is None]
        if unsent:
            e = self.load_event_counter
            self.load_event_counter += 1
            for r in unsent:
                st = self.reqs_to_load[r]
                st.load_event = e
                meta.load_gpu_blocks += st.transfer.gpu_ids
                meta.load_cpu_blocks += st.transfer.cpu_ids
            self.load_event_to_reqs[e] = unsent
            meta.load_event = e
        meta.load_event_to_reqs = {e: list(rs) for e, rs in self.load_event_to_reqs.items()}
        return meta

    def _check_scheduler_output(self, out: SchedulerOutput) -> None:
        """Every field the planning reads, shapes first (``kvspec.contract.checks.check_scheduler_output``)."""
        check_scheduler_output(out, self.num_groups, self.gpu_pool.num_blocks)

    def _plan_eager(self, out: SchedulerOutput) -> StoreBatch:
        """vLLM ``_prepare_eager_store_specs``: the preemption reset, then the policy's plan;
        each request the batch serves is listed once."""
        batch = StoreBatch()
        for rid in out.preempted_req_ids:
            st = self.reqs_to_store.get(rid)
            if st is not None:
                self._reset_after_preemption(st)
        self.policy.plan_eager(out, batch)
        batch.req_ids = list(dict.fromkeys(batch.req_ids))
        return batch

    def _reset_after_preemption(self, st: StoreState) -> None:
        """A preempted request starts over: no ids, cursors at 0 (the #57816 fix)."""
        st.block_ids = [[] for _ in range(self.num_groups)]
        st.num_stored_blocks = [0] * self.num_groups

    # -- the policy-facing interface ------------------------------------------------------------

    def store_state(self, rid: str) -> StoreState | None:
        """The eager store state of request ``rid``, or None when it has none (lazy mode, never
        allocated, or gone after its finish or a reset). O(1)."""
        return self.reqs_to_store.get(rid)

    def scheduled_store_states(self, out: SchedulerOutput) -> Iterator[StoreState]:
        """The store states a planning step scans, in vLLM's order (``yield_req_data``: new
        requests first): for each listed request with live store state, a full table
        (new or resumed) replaces the accumulated ids and the step's new ids are appended
        (cursors are kept); it is yielded when the step schedules tokens for it. Lazily:
        each request's ids are updated just before it is yielded, after the earlier
        requests' stores were planned, as in vLLM; consume it in order. O(requests + ids)."""
        for rid, new_ids, full_table in yield_req_data(out):
            st = self.reqs_to_store.get(rid)
            if st is None or st.finished:
                continue
            if full_table:
                st.block_ids = [[] for _ in range(self.num_groups)]
            if new_ids is not None:
                for g, ids in enumerate(new_ids):
                    if ids is not None:
                        st.block_ids[g].extend(ids)
            if out.num_scheduled_tokens.get(rid, 0) > 0:
                yield st

    def ready_blocks(self, st: StoreState, ids: list[int]) -> int:
        """Confirmed full blocks of ``st`` in the list ``ids`` (``rules.ready_blocks``: computed
        tokens minus output placeholders, capped at the list). O(1)."""
        return ready_blocks(st.request.num_computed_tokens, st.request.num_output_placeholders, len(ids),
                            self.block_size)

    def store_source(self, st: StoreState, g: int, i: int, gid: int) -> int | None:
        """The GPU block to store for position ``i`` of group ``g`` holding ``gid``: itself,
        or for a null entry the GPU prefix cache's block for the position's key (vLLM's
        null recovery); None if neither. O(1)."""
        if gid != NULL_BLOCK:
            return gid
        hashes = st.request.block_hashes
        if i >= len(hashes):
            return None
        got = self.gpu_pool.get_cached_block(hashes[i], [g])
        return None if got is None else got[0]

    def classify(self, gid: int) -> str:
        """vLLM ``_classify_store_candidate`` of GPU block ``gid`` (``rules.classify_store_candidate``):
        in flight means its id is in the in-flight set, cached that the CPU holds its key. O(1)."""
        key = None if gid == NULL_BLOCK else self.gpu_pool.block_hash[gid]
        return classify_store_candidate(gid == NULL_BLOCK, key is not None, gid in self.in_flight_store_gpu_blocks,
                                        key is not None and self.cpu_pool.get_one_block(key) is not None)

    def ready_sources(self, st: StoreState, g: int, ids: list[int], positions: range) -> list[int]:
        """For each position of ``positions`` in group ``g`` (ids ``ids``): its store source
        when that is READY (``store_source``, then ``classify``), else ``NULL_BLOCK`` (never a
        READY block). O(len(positions))."""
        out: list[int] = []
        for i in positions:
            gid = self.store_source(st, g, i, ids[i])
            out.append(gid if gid is not None and self.classify(gid) == READY else NULL_BLOCK)
        return out

    def allocate_cpu(self, n: int) -> list[int]:
        """``n`` new CPU blocks, LRU head first; the entries the allocation evicted go to the
        policy (``on_cpu_evictions``) before this returns. Every CPU allocation of the
        scheduler and its policy goes through here. O(n)."""
        blocks = self.cpu_pool.get_new_blocks(n)
        self.policy.on_cpu_evictions(self.cpu_pool.take_evicted())
        return blocks

    def take_cpu_blocks(self, block_ids: list[int]) -> None:
        """Take these free CPU blocks as an allocation would (``touch`` + ``evict_blocks``, both
        on vLLM's ``BlockPool``): referenced, and a cached one's entry evicted, which goes to
        the policy before this returns. O(len(block_ids))."""
        self.cpu_pool.touch(block_ids)
        self.cpu_pool.evict_blocks(block_ids)
        self.policy.on_cpu_evictions(self.cpu_pool.take_evicted())

    def mark_in_flight(self, gpu_ids: list[int]) -> None:
        """Eager stores pin their GPU blocks (ref +1) and mark them in flight until their
        event completes or is abandoned. O(len(gpu_ids))."""
        self.in_flight_store_gpu_blocks |= set(gpu_ids)
        self.gpu_pool.touch(gpu_ids)

    def allocate_store(self, batch: StoreBatch, rid: str, gpu_ids: list[int]) -> None:
        """Add the stores of ``gpu_ids`` for request ``rid`` to this step's ``batch``: CPU
        destinations from ``allocate_cpu``, then both sides pinned (``mark_in_flight``).
        O(len(gpu_ids))."""
        cpu_ids = self.allocate_cpu(len(gpu_ids))
        batch.req_ids.append(rid)
        batch.gpu_ids += gpu_ids
        batch.cpu_ids += cpu_ids
        self.mark_in_flight(gpu_ids)

    def queue_flush(self, transfer: Transfer) -> None:
        """Queue a finish flush whose CPU blocks are allocated and whose GPU blocks are
        marked in flight; it joins the next store event, after that step's plan. O(1)."""
        self.pending_finished_stores.append(transfer)

    # -- lazy -----------------------------------------------------------------------------------

    def _plan_lazy(self) -> StoreBatch:
        """vLLM ``_prepare_lazy_store_specs``: copy free hashed GPU blocks near the LRU head."""
        batch = StoreBatch()
        if self.target_free <= 0:
            return batch
        n_cpu_free = self.cpu_pool.get_num_free_blocks()
        if self.lazy_cursor is not None and self.gpu_pool.ref_cnt[self.lazy_cursor] > 0:
            self.lazy_cursor = None
        selected: list[int] = []
        last = self.lazy_cursor
        for covered, b in enumerate(self.gpu_pool.free_queue.iter_after(self.lazy_cursor)):
            if covered >= self.target_free or len(selected) >= n_cpu_free:
                break
            last = b
            key = self.gpu_pool.block_hash[b]
            if key is not None and self.cpu_pool.get_one_block(key) is None:
                selected.append(b)
        self.lazy_cursor = last
        if selected:
            batch.cpu_ids = self.allocate_cpu(len(selected))
            batch.gpu_ids = selected
            self.gpu_pool.touch(selected)
        return batch

    # == worker reports ========================================================================

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Load completions, then store-event counts accumulated to ``world_size``."""
        check_worker_output(connector_output, self._load_sent, self.store_event_counter, self.config.world_size)
        for e in connector_output.completed_store_events:
            self._check_completion_hashes(e)
        # -- all checks done; mutate --
        for rid in connector_output.finished_recving:
            self._cleanup_load_request(rid)
        for e, c in connector_output.completed_store_events.items():
            total = self.store_event_pending_counts.get(e, 0) + c
            if total >= self.config.world_size:
                self.store_event_pending_counts.pop(e, None)
                self._process_store_event(e)
            else:
                self.store_event_pending_counts[e] = total

    def _load_sent(self, rid: str) -> bool | None:
        st = self.reqs_to_load.get(rid) or self.abandoned_reqs_to_load.get(rid)
        return None if st is None else st.load_event is not None

    def _check_completion_hashes(self, e: int) -> None:
        t = self.store_event_to_blocks.get(e)
        for g in t.gpu_ids if t is not None else ():
            if self.gpu_pool.block_hash[g] is None:
                raise InvalidOperationError(f"store event {e}: GPU block {g} lost its hash before completion")

    def _process_store_event(self, e: int) -> None:
        t = self.store_event_to_blocks.pop(e, None)
        if t is None:
            abandoned = self.abandoned_store_event_to_blocks.pop(e, None)
            if abandoned is not None:
                self._release_transfer_refs(abandoned)
            return
        if not self.lazy_mode:
            self.in_flight_store_gpu_blocks -= set(t.gpu_ids)
        for g, c in zip(t.gpu_ids, t.cpu_ids, strict=True):
            key = self.gpu_pool.block_hash[g]
            assert key is not None  # checked before any change
            self.cpu_pool.insert_block_hash(key, c)
        self.cpu_pool.free_blocks(t.cpu_ids)
        self.gpu_pool.free_blocks(t.gpu_ids)
        self.policy.on_store_completed(t)
        for rid in self.store_event_to_reqs.pop(e, []):
            st = self.reqs_to_store.get(rid)
            if st is not None:
                st.store_events.discard(e)
                if st.finished and not st.store_events:
                    self._cleanup_store_request(rid)

    def _release_transfer_refs(self, t: Transfer) -> None:
        self.cpu_pool.free_blocks(t.cpu_ids)
        self.gpu_pool.free_blocks(t.gpu_ids)

    def _cleanup_load_request(self, rid: str) -> None:
        st = self.reqs_to_load.pop(rid, None) or self.abandoned_reqs_to_load.pop(rid, None)
        if st is None:
            return
        if st.load_event is not None:
            reqs = self.load_event_to_reqs.get(st.load_event)
            if reqs is not None and rid in reqs:
                reqs.remove(rid)
                if not reqs:
                    del self.load_event_to_reqs[st.load_event]
        self.cpu_pool.free_blocks(st.transfer.cpu_ids)
        self.gpu_pool.free_blocks(st.transfer.gpu_ids)

    def _cleanup_store_request(self, rid: str) -> None:
        st = self.reqs_to_store.pop(rid)
        for e in st.store_events:
            reqs = self.store_event_to_reqs.get(e)
            if reqs is not None and rid in reqs:
                reqs.remove(rid)
                if not reqs:
                    del self.store_event_to_reqs[e]

    # == finish ================================================================================

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockIds) -> tuple[bool, None]:
        """An eager request's policy queues the finish flush of the live table (§7.13); then
        ``request_finished`` (§7.10)."""
        rid = check_request(request, "request_finished")
        ids = check_block_ids(block_ids, self.num_groups, self.gpu_pool.num_blocks, "request_finished",
                                none_groups=False)
        if not self.lazy_mode and rid in self.reqs_to_store:
            self.policy.finish_flush(request, [list(g) for g in ids])
        return self.request_finished(request)

    def request_finished(self, request: RequestView) -> tuple[bool, None]:
        """Drop the pin; defer or drop load and store state. The GPU blocks are the caller's."""
        rid = check_request(request, "request_finished", full=False)
        pending = self.pending_cpu_hits.pop(rid, None)
        if pending is not None:
            self._free_pending_cpu_hit(pending)
        ls = self.reqs_to_load.get(rid)
        if ls is not None:
            if ls.load_event is not None:
                ls.finished = True
            else:
                self._cleanup_load_request(rid)
        ss = self.reqs_to_store.get(rid)
        if ss is not None and not self.lazy_mode:
            if ss.store_events:
                ss.finished = True
            else:
                self._cleanup_store_request(rid)
        self.policy.on_request_finished(rid)
        return False, None

    # == reset =================================================================================

    def reset(self) -> bool:
        """Abandon-style reset (§7.12). True iff nothing is abandoned and the CPU cache cleared."""
        for p in self.pending_cpu_hits.values():
            self._free_pending_cpu_hit(p)
        self.pending_cpu_hits.clear()
        self.abandoned_store_event_to_blocks.update(self.store_event_to_blocks)
        for t in self.pending_finished_stores:
            self._release_transfer_refs(t)
        self.pending_finished_stores.clear()
        self.store_event_to_blocks.clear()
        self.in_flight_store_gpu_blocks.clear()
        for rid in list(self.reqs_to_load):
            st = self.reqs_to_load.pop(rid)
            if st.load_event is None:
                self.reqs_to_load[rid] = st
                self._cleanup_load_request(rid)
            else:
                self.abandoned_reqs_to_load[rid] = st
        self.reqs_to_store.clear()
        self.store_event_to_reqs.clear()
        self.store_event_pending_counts = {
            e: c for e, c in self.store_event_pending_counts.items() if e in self.abandoned_store_event_to_blocks
        }
        self.lazy_cursor = None
        self.policy.on_reset()
        if self.abandoned_store_event_to_blocks or self.abandoned_reqs_to_load:
            return False
        return self.cpu_pool.reset_prefix_cache()

    def has_pending_stores(self) -> bool:
        return bool(self.pending_finished_stores or self.store_event_to_blocks
                    or self.abandoned_store_event_to_blocks)

    # == observation ===========================================================================

    def snapshot(self) -> dict[str, Any]:
        """Canonical state: both pools and the scheduler (see kvspec.contract.snapshot)."""
        return {
            "gpu_pool": self.gpu_pool.snapshot(),
            "cpu_pool": self.cpu_pool.snapshot(),
            "scheduler": self._scheduler_snapshot(),
        }

    def _scheduler_snapshot(self) -> dict[str, Any]:
        def load(st: LoadState) -> tuple[Transfer_, int | None, bool]:
            return (st.transfer.gpu_ids, st.transfer.cpu_ids), st.load_event, st.finished

        return scheduler_section(
            policy=self.policy.name,
            lazy=self.lazy_mode,
            lazy_cursor=self.lazy_cursor,
            pending_cpu_hits={r: (p.blocks, p.hit_len, p.num_computed_tokens)
                              for r, p in self.pending_cpu_hits.items()},
            reqs_to_load={r: load(st) for r, st in self.reqs_to_load.items()},
            abandoned_reqs_to_load={r: load(st) for r, st in self.abandoned_reqs_to_load.items()},
            load_event_to_reqs=self.load_event_to_reqs,
            store_events={e: (t.gpu_ids, t.cpu_ids) for e, t in self.store_event_to_blocks.items()},
            abandoned_store_events={e: (t.gpu_ids, t.cpu_ids) for e, t in self.abandoned_store_event_to_blocks.items()},
            pending_finished_stores=[(t.gpu_ids, t.cpu_ids) for t in self.pending_finished_stores],
            reqs_to_store={r: (st.block_ids, st.num_stored_blocks, st.store_events, st.finished)
                           for r, st in self.reqs_to_store.items()},
            store_event_to_reqs=self.store_event_to_reqs,
            in_flight=self.in_flight_store_gpu_blocks,
            load_event_counter=self.load_event_counter,
            store_event_counter=self.store_event_counter,
            store_event_pending_counts=self.store_event_pending_counts,
            policy_state=self.policy.snapshot(),
        )

    def _check(self) -> None:
        """The invariants that need only this scheduler's own state (pools, I3-I4, I6-I9, I13)."""
        from kvspec.oracle.catalogue import LOCAL_INVARIANTS, check

        self.gpu_pool._check()
        self.cpu_pool._check()
        violations = check(self.snapshot(), LOCAL_INVARIANTS)
        assert not violations, "\n".join(str(v) for v in violations)

