"""The torch-backed offload scheduler: vLLM 0.33.0's ``SimpleCPUOffloadScheduler`` interface.

State lives in tensors: both pools (``TensorBlockPool``), the in-flight GPU set (a
bool per GPU block), per-request store cursors and ids (``StoreTable``), KV payloads
(``PayloadStore``). Loads, events and pins are small per-request records in dicts, in
vLLM's order. Planning a step is batched across requests and groups
(``kvspec.impl.planner``, over the segments of ``kvspec.impl.segments``); lazy planning
walks the GPU free list in one slice. The re-store policy is the class
``POLICY_REGISTRY[config.policy].impl`` names; it sees this scheduler as a
``SchedulerFacade`` (``kvspec.impl.facade``), whose members are this class's planning
section.

Every public method checks its input with the shared checks of
``kvspec.contract`` before changing anything and raises the same ``KVSpecError``
subclasses as the model; ``snapshot()`` is the model's canonical format, key for key;
``_check()`` asserts every structure's own invariants (the stateful harness calls it
after every operation).
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import torch

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
from kvspec.contract.policy import POLICY_REGISTRY
from kvspec.contract.snapshot import Transfer as TransferPair
from kvspec.contract.snapshot import scheduler_section
from kvspec.contract.types import BlockIds, ConnectorMetadata, KVConnectorOutput, RequestView, SchedulerOutput
from kvspec.impl import batched_rules
from kvspec.impl.block_pool import TensorBlockPool
from kvspec.impl.convert import int_tensor
from kvspec.impl.facade import FlushCandidates, ImplStorePolicy, SchedulerFacade
from kvspec.impl.hit_search import longest_hit
from kvspec.impl.keys import KeyTable
from kvspec.impl.payload import PayloadStore
from kvspec.impl.planner import Candidates, Layout, PoolReads, SameStepDedup, candidate_layout, decide
from kvspec.impl.request_table import StoreTable
from kvspec.impl.segments import BatchRequests, ScanBatch, Segmenter
from kvspec.impl.transfers import Evictions, StoreBatch, Transfer


@dataclass
class PendingHit:
    """A lookup's CPU hit, pinned until allocation consumes it."""

    blocks: list[list[int]]
    hit_len: int
    num_computed_tokens: int
    pinned: torch.Tensor  # the non-null blocks, as pinned


@dataclass
class LoadState:
    request: RequestView
    transfer: Transfer
    load_event: int | None = None
    finished: bool = False


class LoadPairs(NamedTuple):
    """A load's block pairs, in order."""

    gpu: list[int]
    cpu: list[int]


def _load_policy(name: str, host: SchedulerFacade) -> ImplStorePolicy:
    """The policy class ``POLICY_REGISTRY[name].impl`` names (``module:attribute``), built on ``host``."""
    module, _, attribute = POLICY_REGISTRY[name].impl.partition(":")
    policy_class: Callable[[SchedulerFacade], ImplStorePolicy] = getattr(importlib.import_module(module), attribute)
    return policy_class(host)


class TensorOffloadScheduler:
    """An ``OffloadTarget`` on tensors (module docstring); to its policy, a ``SchedulerFacade``."""

    def __init__(self, config: OffloadConfig, device: str | torch.device = "cpu",
                 block_shape: tuple[int, ...] = (2, 8), dtype: torch.dtype = torch.float32) -> None:
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.block_size = config.block_size
        self.num_groups = config.num_groups
        self.keys = KeyTable(self.num_groups, self.device)
        self.gpu_pool = TensorBlockPool(config.num_gpu_blocks, "gpu", self.keys, self.device)
        self.cpu_pool = TensorBlockPool(config.num_cpu_blocks, "cpu", self.keys, self.device)
        self.gpu_pool.record_evictions = False
        self.cpu_pool.record_evictions = False
        self.payload = PayloadStore(config.num_gpu_blocks, config.num_cpu_blocks, block_shape, dtype,
                                    self.device, self.keys.seeds)
        self.gpu_pool.on_register = self.payload.on_gpu_register
        self.gpu_pool.on_alloc = self.payload.on_gpu_alloc
        self.lazy_mode = config.lazy_offload
        self.target_free = config.lazy_target_free()
        self.lazy_cursor: int | None = None
        self.reqs_to_load: dict[str, LoadState] = {}
        self.load_event_to_reqs: dict[int, list[str]] = {}
        self.abandoned_reqs_to_load: dict[str, LoadState] = {}
        self.pending_cpu_hits: dict[str, PendingHit] = {}
        self.store_events: dict[int, Transfer] = {}
        self.abandoned_store_events: dict[int, Transfer] = {}
        self.pending_finished_stores: list[Transfer] = []
        self.store_event_to_reqs: dict[int, list[str]] = {}
        self.stores = StoreTable(self.num_groups, self.keys, self.device)
        self.in_flight = torch.zeros(config.num_gpu_blocks, dtype=torch.bool, device=self.device)
        self._segments = Segmenter(self.stores, self.device)
        self._dedup = SameStepDedup(torch.zeros(config.num_gpu_blocks, dtype=torch.int64, device=self.device), 0)
        self._min_scheduled = 0  # smallest num_scheduled_tokens value of the output being planned
        self.load_event_counter = 0
        self.store_event_counter = 0
        self.store_event_pending_counts: dict[int, int] = {}
        host: SchedulerFacade = self
        self.policy: ImplStorePolicy = _load_policy(config.policy, host)

    # == loads =====================================================================================

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        check_request(request, "get_num_new_matched_tokens")
        check_count(num_computed_tokens, "num_computed_tokens", request.num_tokens)
        B, G = self.block_size, self.num_groups
        stale = self.pending_cpu_hits.pop(request.request_id, None)
        if stale is not None:
            self.cpu_pool.free_t(stale.pinned)
        if request.skip_reading_prefix_cache or num_computed_tokens % B:
            return 0, False
        hashes = request.block_hashes[num_computed_tokens // B:]
        max_len = request.num_tokens - 1 - num_computed_tokens
        if not hashes or max_len <= 0:
            return 0, False
        hids = [self.keys.known_hash_id(h) for h in hashes[: max_len // B]]
        if not hids or max(hids) < 0:
            return 0, False
        h = int_tensor(hids, self.device)
        kids = torch.where(h >= 0, h.view(1, -1) * G + torch.arange(G, device=self.device).view(-1, 1), -1)
        firsts = self.cpu_pool.first_of(kids).tolist()
        blocks, hit_len = longest_hit(firsts, self.config.groups, max_len, B)
        if hit_len == 0:
            return 0, False
        pinned = self.cpu_pool.as_ids([b for g in blocks for b in g if b != 0])
        self.cpu_pool.touch_t(pinned)
        self.pending_cpu_hits[request.request_id] = PendingHit(blocks, hit_len, num_computed_tokens, pinned)
        return hit_len, True

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None:
        rid = check_request(request, "update_state_after_alloc")
        ids = check_block_ids(block_ids, self.num_groups, self.gpu_pool.num_blocks, "update_state_after_alloc",
                              none_groups=False)
        check_count(num_external_tokens, "num_external_tokens", request.num_tokens)
        pending = self.pending_cpu_hits.get(rid)
        load: LoadPairs | None = None
        if num_external_tokens > 0 and pending is not None:
            self._check_load(rid, pending, num_external_tokens)
            load = self._load_pairs(rid, ids, pending, num_external_tokens)
        if not self.lazy_mode and rid not in self.stores:
            self.stores.add(rid, request)
        self.pending_cpu_hits.pop(rid, None)
        if pending is None or load is None:
            if pending is not None:
                self.cpu_pool.free_t(pending.pinned)
            return
        gpu = self.gpu_pool.as_ids(load.gpu)
        cpu = self.cpu_pool.as_ids(load.cpu)
        self.cpu_pool.touch_t(cpu)
        self.cpu_pool.free_t(pending.pinned)
        self.gpu_pool.touch_t(gpu)
        self.reqs_to_load[rid] = LoadState(request, Transfer(gpu, cpu))

    def _check_load(self, rid: str, pending: PendingHit, ext: int) -> None:
        if ext % self.block_size:
            raise InvalidOperationError(
                f"{name_of(rid)}: num_external_tokens {ext} is not a multiple of the block size {self.block_size}")
        if ext > pending.hit_len:
            raise InvalidOperationError(
                f"{name_of(rid)}: accepted {ext} external tokens of a {pending.hit_len}-token hit")
        if rid in self.reqs_to_load:
            raise InvalidOperationError(f"{name_of(rid)}: a load is already registered")

    def _load_pairs(self, rid: str, ids: BlockIds, pending: PendingHit, ext: int) -> LoadPairs:
        load = LoadPairs([], [])
        start = pending.num_computed_tokens // self.block_size
        take = -(-ext // self.block_size)
        for g, hits in enumerate(pending.blocks):
            for i, cb in enumerate(hits[:take]):
                if cb == 0:
                    continue
                if start + i >= len(ids[g]) or ids[g][start + i] == 0:
                    raise InvalidOperationError(
                        f"{name_of(rid)}: group {g} has no allocated GPU block at position {start + i} for the load")
                load.gpu.append(ids[g][start + i])
                load.cpu.append(cb)
        return load

    # == planning ==================================================================================

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        out = scheduler_output
        self._check_scheduler_output(out)
        if self.lazy_mode:
            batch = self._plan_lazy()
        else:
            batch = StoreBatch()
            self.policy.plan_eager(out, batch)
        for t in self.pending_finished_stores:
            batch.add(t.gpu, t.cpu)
        self.pending_finished_stores.clear()
        meta = ConnectorMetadata(need_flush=bool(out.preempted_req_ids))
        self._make_store_event(batch, meta)
        self._make_load_event(meta)
        meta.load_event_to_reqs = {e: list(rs) for e, rs in self.load_event_to_reqs.items()}
        return meta

    def _make_store_event(self, batch: StoreBatch, meta: ConnectorMetadata) -> None:
        """At most one store event per step: the batch's pairs, if any."""
        gpu = (batch.gpu[0] if len(batch.gpu) == 1 else torch.cat(batch.gpu)) if batch.gpu else None
        if gpu is None or not gpu.numel():
            return
        cpu = batch.cpu[0] if len(batch.cpu) == 1 else torch.cat(batch.cpu)
        e = self.store_event_counter
        self.store_event_counter += 1
        self.store_events[e] = Transfer(gpu, cpu)
        if batch.req_ids:
            self.store_event_to_reqs[e] = batch.req_ids
            self._note_store_event(e, batch.req_ids)
        meta.store_event = e
        meta.store_gpu_blocks = gpu.tolist()
        meta.store_cpu_blocks = cpu.tolist()

    def _note_store_event(self, e: int, req_ids: list[str]) -> None:
        """Add ``e`` to the store events of every listed request that has a slot."""
        slot_of, events = self.stores.slot_of, self.stores.events
        try:  # every listed request has a slot (the usual step): C-level passes
            deque(map(set.add, map(events.__getitem__, map(slot_of.__getitem__, req_ids)), repeat(e)), maxlen=0)
        except KeyError:  # set.add is idempotent: redo it request by request
            for r in req_ids:
                s = slot_of.get(r)
                if s is not None:
                    events[s].add(e)

    def _make_load_event(self, meta: ConnectorMetadata) -> None:
        """At most one load event per step: every registered load not sent yet."""
        unsent = [r for r, st in self.reqs_to_load.items() if st.load_event is None]
        if not unsent:
            return
        e = self.load_event_counter
        self.load_event_counter += 1
        for r in unsent:
            st = self.reqs_to_load[r]
            st.load_event = e
            meta.load_gpu_blocks += st.transfer.gpu.tolist()
            meta.load_cpu_blocks += st.transfer.cpu.tolist()
        self.load_event_to_reqs[e] = unsent
        meta.load_event = e

    def _check_scheduler_output(self, out: SchedulerOutput) -> None:
        """Every field the planning reads, shapes first (``kvspec.contract.checks.check_scheduler_output``);
        notes the smallest scheduled count (0 when none) for the planner's fast path."""
        self._min_scheduled = check_scheduler_output(out, self.num_groups, self.gpu_pool.num_blocks)

    # -- the policy's view (SchedulerFacade) ------------------------------------------------------

    def scheduled_segments(self, out: SchedulerOutput) -> Iterator[ScanBatch]:
        segments = self._segments.split(out)  # the preemption reset happens here, before any scan
        return (self._segments.apply(seg, out, self._min_scheduled) for seg in segments)

    def batch_requests(self, slots: list[int]) -> BatchRequests:
        return self._segments.batch_requests(slots)

    def ready_blocks(self, requests: Sequence[Any], lengths: torch.Tensor) -> torch.Tensor:
        """``rules.ready_blocks`` per (request, group), batched: computed tokens minus output
        placeholders, in whole blocks, capped at the ids. O(k * G)."""
        done = int_tensor([r.num_computed_tokens - r.num_output_placeholders for r in requests], self.device)
        return batched_rules.ready_blocks(done, lengths, self.block_size)

    def scan_and_store(self, batch: ScanBatch, step: StoreBatch, rescan: bool) -> None:
        """Decide requests (distinct slots) in batches; commit each (baseline, signal-rescan)."""
        rids, slots = batch
        while slots:
            cut = self._plan_batch(rids, slots, step, rescan)
            rids, slots = rids[cut:], slots[cut:]

    def _pool_reads(self) -> PoolReads:
        self.cpu_pool.index.ensure(self.keys.key_capacity)
        return PoolReads(self.gpu_pool.key, self.in_flight, self.cpu_pool.index.first_known, self.cpu_pool.key,
                         self.cpu_pool.free.peek_head, self.cpu_pool.free.count)

    def _plan_batch(self, rids: list[str], slots: list[int], step: StoreBatch, rescan: bool) -> int:
        """Decide a prefix of the batch with the planner and commit it; the prefix's length."""
        st = self.stores
        k = len(slots)
        slot_ids, requests = self.batch_requests(slots)
        cur = st.cursor[slot_ids]
        layout = candidate_layout(cur, self.ready_blocks(requests, st.length[slot_ids]), rescan)
        if layout is None:
            return k
        blocks = st.table[slot_ids[layout.request], layout.group, layout.position]
        src = self._recover_nulls(blocks, layout, slots.__getitem__)
        d = decide(Candidates(layout, src, src is not blocks), k, self.num_groups, self._pool_reads(), self._dedup)
        self._dedup.stamp_base += k + 1
        self.start_stores(d.src, step)
        if d.cut < k:
            st.cursor.index_put_((slot_ids[:d.cut],), d.advance[:d.cut], accumulate=True)
        else:
            st.cursor.index_put_((slot_ids,), d.advance, accumulate=True)
        step.req_ids.extend(map(rids.__getitem__, d.requests_with_selection))
        return d.cut

    def _recover_nulls(self, blocks: torch.Tensor, layout: Layout, slot_of_request: Callable[[int], int]
                       ) -> torch.Tensor:
        """``blocks`` (one per candidate of ``layout``) with each null entry replaced by the GPU prefix
        cache's block for the position's key, else -1 (vLLM §7.6); ``blocks`` itself when none is null."""
        if int(blocks.min()) > 0:
            return blocks
        null = (blocks == 0).nonzero().flatten()
        kids = []
        for i, g, p in zip(layout.request[null].tolist(), layout.group[null].tolist(), layout.position[null].tolist(),
                           strict=True):
            hids = self.stores.sync_hids(slot_of_request(i))
            kids.append(hids[p] * self.num_groups + g if p < len(hids) else -1)
        src = blocks.clone()
        src[null] = self.gpu_pool.first_of(int_tensor(kids, self.device))
        return src

    def start_stores(self, gpu: torch.Tensor, step: StoreBatch | None) -> torch.Tensor:
        if gpu.numel() == 0:
            return gpu
        cpu, ev_blocks, ev_kids = self.cpu_pool.alloc(gpu.numel())
        if ev_blocks.numel():
            self.policy.on_cpu_evictions(Evictions(ev_blocks, ev_kids))
        self.mark_in_flight(gpu)
        if step is not None:
            step.add(gpu, cpu)
        return cpu

    def mark_in_flight(self, gpu: torch.Tensor) -> None:
        self.in_flight[gpu] = True
        self.gpu_pool.touch_t(gpu)

    def flush_candidates(self, slot: int, block_ids: list[list[int]]) -> FlushCandidates | None:
        lengths = torch.tensor([[len(x) for x in block_ids]], dtype=torch.int64, device=self.device)
        cur = self.stores.cursor[slot].view(1, -1)
        layout = candidate_layout(cur, self.ready_blocks([self.stores.request[slot]], lengths), False)
        if layout is None:
            return None
        width = max(1, int(lengths.max()))
        padded = torch.zeros((self.num_groups, width), dtype=torch.int64, device=self.device)
        for g, ids in enumerate(block_ids):
            if ids:
                padded[g, : len(ids)] = int_tensor(ids, self.device)
        return FlushCandidates(layout, padded[layout.group, layout.position])

    def select_flush(self, request: RequestView, block_ids: list[list[int]]) -> torch.Tensor:
        """The baseline scan of ``[cursor, ready)`` over a live table (finish flush); no commit."""
        slot = self.stores.slot_of[request.request_id]
        found = self.flush_candidates(slot, block_ids)
        if found is None:
            return self.gpu_pool.empty()
        layout = found.layout
        src = self._recover_nulls(found.blocks, layout, lambda i: slot)
        pools = PoolReads(self.gpu_pool.key, self.in_flight, self.cpu_pool.first_of, self.cpu_pool.key,
                          self.cpu_pool.free.peek_head, self.cpu_pool.free.count)
        return decide(Candidates(layout, src), 1, self.num_groups, pools, None).src

    def queue_flush(self, gpu: torch.Tensor, cpu: torch.Tensor) -> None:
        self.pending_finished_stores.append(Transfer(gpu, cpu))

    # -- lazy ------------------------------------------------------------------------------------------

    def _plan_lazy(self) -> StoreBatch:
        batch = StoreBatch()
        if self.target_free <= 0:
            return batch
        n_cpu_free = self.cpu_pool.free.count
        if self.lazy_cursor is not None and int(self.gpu_pool.ref[self.lazy_cursor]) > 0:
            self.lazy_cursor = None
        walk = self.gpu_pool.free.after(self.lazy_cursor, self.target_free)
        if walk.numel() == 0 or n_cpu_free == 0:
            return batch
        key = self.gpu_pool.key[walk]
        ok = (key >= 0) & (self.cpu_pool.first_of(key) < 0)
        cum = torch.cumsum(ok.to(torch.int64), 0)
        excl = cum - ok.to(torch.int64)
        full = (excl >= n_cpu_free).nonzero().flatten()
        stop = int(full[0]) if full.numel() else walk.numel()
        if stop == 0:
            return batch
        self.lazy_cursor = int(walk[stop - 1])
        sel = walk[:stop][ok[:stop]]
        if sel.numel():
            cpu, _, _ = self.cpu_pool.alloc(sel.numel())
            self.gpu_pool.touch_t(sel)
            batch.add(sel, cpu)
        return batch

    # == worker reports ============================================================================

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        co = connector_output

        def load_sent(rid: str) -> bool | None:
            st = self.reqs_to_load.get(rid) or self.abandoned_reqs_to_load.get(rid)
            return None if st is None else st.load_event is not None

        check_worker_output(co, load_sent, self.store_event_counter, self.config.world_size)
        for e in co.completed_store_events:
            t = self.store_events.get(e)
            if t is not None and bool((self.gpu_pool.key[t.gpu] < 0).any()):
                bad = t.gpu[self.gpu_pool.key[t.gpu] < 0][0]
                raise InvalidOperationError(f"store event {e}: GPU block {int(bad)} lost its hash before completion")
        for rid in co.finished_recving:
            self._cleanup_load(rid, copy=True)
        for e, c in co.completed_store_events.items():
            total = self.store_event_pending_counts.get(e, 0) + c
            if total >= self.config.world_size:
                self.store_event_pending_counts.pop(e, None)
                self._process_store_event(e)
            else:
                self.store_event_pending_counts[e] = total

    def _process_store_event(self, e: int) -> None:
        t = self.store_events.pop(e, None)
        if t is None:
            ab = self.abandoned_store_events.pop(e, None)
            if ab is not None:
                self.cpu_pool.free_t(ab.cpu)
                self.gpu_pool.free_t(ab.gpu)
            return
        if not self.lazy_mode:
            self.in_flight[t.gpu] = False
        kids = self.gpu_pool.key[t.gpu]
        self.payload.store(t.gpu, t.cpu)
        self.cpu_pool.register_many(kids, t.cpu)
        self.cpu_pool.free_t(t.cpu)
        self.gpu_pool.free_t(t.gpu)
        self.policy.on_store_completed(kids)
        slot_of, events, finished = self.stores.slot_of, self.stores.events, self.stores.finished
        for rid in self.store_event_to_reqs.pop(e, []):
            s = slot_of.get(rid)
            if s is not None:
                events[s].discard(e)
                if finished[s] and not events[s]:
                    self._cleanup_store(rid)

    def _cleanup_load(self, rid: str, copy: bool = False) -> None:
        st = self.reqs_to_load.pop(rid, None) or self.abandoned_reqs_to_load.pop(rid, None)
        if st is None:
            return
        if st.load_event is not None:
            reqs = self.load_event_to_reqs.get(st.load_event)
            if reqs is not None and rid in reqs:
                reqs.remove(rid)
                if not reqs:
                    del self.load_event_to_reqs[st.load_event]
        if copy:
            self.payload.load(st.transfer.gpu, st.transfer.cpu)
        self.cpu_pool.free_t(st.transfer.cpu)
        self.gpu_pool.free_t(st.transfer.gpu)

    def _cleanup_store(self, rid: str) -> None:
        s = self.stores.slot_of[rid]
        for e in self.stores.events[s]:
            reqs = self.store_event_to_reqs.get(e)
            if reqs is not None and rid in reqs:
                reqs.remove(rid)
                if not reqs:
                    del self.store_event_to_reqs[e]
        self.stores.remove(rid)

    # == finish ======================================================================================

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockIds) -> tuple[bool, None]:
        check_request(request, "request_finished")
        ids = check_block_ids(block_ids, self.num_groups, self.gpu_pool.num_blocks, "request_finished",
                              none_groups=False)
        if request.request_id in self.stores and not self.lazy_mode:
            self.policy.finish_flush(request, [list(g) for g in ids])
        return self.request_finished(request)

    def request_finished(self, request: RequestView) -> tuple[bool, None]:
        rid = check_request(request, "request_finished", full=False)
        pending = self.pending_cpu_hits.pop(rid, None)
        if pending is not None:
            self.cpu_pool.free_t(pending.pinned)
        ls = self.reqs_to_load.get(rid)
        if ls is not None:
            if ls.load_event is not None:
                ls.finished = True
            else:
                self._cleanup_load(rid)
        s = self.stores.slot_of.get(rid)
        if s is not None and not self.lazy_mode:
            if self.stores.events[s]:
                self.stores.mark_finished(s)
            else:
                self._cleanup_store(rid)
        self.policy.on_request_finished(rid)
        return False, None

    # == reset =========================================================================================

    def reset(self) -> bool:
        for p in self.pending_cpu_hits.values():
            self.cpu_pool.free_t(p.pinned)
        self.pending_cpu_hits.clear()
        self.abandoned_store_events.update(self.store_events)
        for t in self.pending_finished_stores:
            self.cpu_pool.free_t(t.cpu)
            self.gpu_pool.free_t(t.gpu)
        self.pending_finished_stores.clear()
        self.store_events.clear()
        self.in_flight.fill_(False)
        for rid in list(self.reqs_to_load):
            st = self.reqs_to_load.pop(rid)
            if st.load_event is None:
                self.reqs_to_load[rid] = st
                self._cleanup_load(rid)
            else:
                self.abandoned_reqs_to_load[rid] = st
        self.stores.clear()
        self.store_event_to_reqs.clear()
        self.store_event_pending_counts = {
            e: c for e, c in self.store_event_pending_counts.items() if e in self.abandoned_store_events}
        self.lazy_cursor = None
        self.policy.on_reset()
        if self.abandoned_store_events or self.abandoned_reqs_to_load:
            return False
        return self.cpu_pool.reset_prefix_cache()

    def has_pending_stores(self) -> bool:
        return bool(self.pending_finished_stores or self.store_events or self.abandoned_store_events)

    # == observation ===================================================================================

    def snapshot(self) -> dict[str, Any]:
        return {
            "gpu_pool": self.gpu_pool.snapshot(),
            "cpu_pool": self.cpu_pool.snapshot(),
            "scheduler": self._scheduler_snapshot(),
        }

    def _scheduler_snapshot(self) -> dict[str, Any]:
        def load(st: LoadState) -> tuple[TransferPair, int | None, bool]:
            return st.transfer.pair(), st.load_event, st.finished

        return scheduler_section(
            policy=self.policy.name,
            lazy=self.lazy_mode,
            lazy_cursor=self.lazy_cursor,
            pending_cpu_hits={r: (p.blocks, p.hit_len, p.num_computed_tokens)
                              for r, p in self.pending_cpu_hits.items()},
            reqs_to_load={r: load(st) for r, st in self.reqs_to_load.items()},
            abandoned_reqs_to_load={r: load(st) for r, st in self.abandoned_reqs_to_load.items()},
            load_event_to_reqs=self.load_event_to_reqs,
            store_events={e: t.pair() for e, t in self.store_events.items()},
            abandoned_store_events={e: t.pair() for e, t in self.abandoned_store_events.items()},
            pending_finished_stores=[t.pair() for t in self.pending_finished_stores],
            reqs_to_store=self.stores.snapshot_rows(),
            store_event_to_reqs=self.store_event_to_reqs,
            in_flight=self.in_flight.nonzero().flatten().tolist(),
            load_event_counter=self.load_event_counter,
            store_event_counter=self.store_event_counter,
            store_event_pending_counts=self.store_event_pending_counts,
            policy_state=self.policy.snapshot(),
        )

    def memory_bytes(self) -> dict[str, int]:
        return {
            "gpu_pool": self.gpu_pool.memory_bytes(),
            "cpu_pool": self.cpu_pool.memory_bytes(),
            "stores": self.stores.memory_bytes() + self.in_flight.numel(),
        }

    # == self-check ======================================================================================

    def _check(self) -> None:
        """Every structure's own invariants (key table, both pools with their free lists and
        prefix indexes, store table, the policy's), then the scheduler's: events and the
        requests they name agree, and the in-flight set is exactly the blocks of live eager
        stores. Raises AssertionError. O(pools + requests + transfers)."""
        self.keys._check()
        self.gpu_pool._check()
        self.cpu_pool._check()
        self.stores._check()
        policy_check = getattr(self.policy, "_check", None)  # policies with state check it themselves
        if policy_check is not None:
            policy_check()
        self._check_store_events()
        self._check_loads()
        self._check_in_flight()

    def _check_store_events(self) -> None:
        live = self.store_events.keys() | self.abandoned_store_events.keys()
        assert all(0 <= e < self.store_event_counter for e in live), "store event id beyond the counter"
        assert self.store_event_to_reqs.keys() <= self.store_events.keys(), "requests listed for a dead event"
        for e, count in self.store_event_pending_counts.items():
            assert e in live and 0 < count < self.config.world_size, f"store event {e}: pending count {count}"
        for rid, slot in self.stores.slot_of.items():
            for e in self.stores.events[slot]:
                assert rid in self.store_event_to_reqs.get(e, ()), f"{rid}: store event {e} does not list it"

    def _check_loads(self) -> None:
        for rid, st in [*self.reqs_to_load.items(), *self.abandoned_reqs_to_load.items()]:
            assert st.transfer.gpu.numel() == st.transfer.cpu.numel(), f"{rid}: load pairs"
            if st.load_event is not None:
                assert rid in self.load_event_to_reqs.get(st.load_event, ()), f"{rid}: load event not listed"
        for e, rids in self.load_event_to_reqs.items():
            assert rids and 0 <= e < self.load_event_counter, f"load event {e}: {rids}"
            for rid in rids:
                assert any(st is not None and st.load_event == e for st in
                           (self.reqs_to_load.get(rid), self.abandoned_reqs_to_load.get(rid))), f"{rid}: load {e}"
        for rid, hit in self.pending_cpu_hits.items():
            assert hit.pinned.tolist() == [b for g in hit.blocks for b in g if b != 0], f"{rid}: hit pins"

    def _check_in_flight(self) -> None:
        marked = self.in_flight.nonzero().flatten()
        if self.lazy_mode:
            assert marked.numel() == 0, "lazy mode marks nothing in flight"
            return
        sources = [t.gpu for t in (*self.store_events.values(), *self.pending_finished_stores)]
        stored = torch.unique(torch.cat(sources)) if sources else marked[:0]
        assert torch.equal(marked, stored), "the in-flight set is not the blocks of the live eager stores"
