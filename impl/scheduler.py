"""The torch-backed offload scheduler: vLLM 0.33.0's ``SimpleCPUOffloadScheduler`` interface.

State lives in tensors: both pools (``TensorBlockPool``), the in-flight GPU set (a
bool per GPU block), per-request store cursors and ids (``StoreTable``), KV payloads
(``PayloadStore``). Loads, events and pins are small per-request records in dicts, in
vLLM's order. Planning a step is batched across requests and groups
(``kvspec.impl.planner``); lazy planning walks the GPU free list in one slice. The
re-store policy is a strategy object (``kvspec.impl.policies``).

Every public method checks its input with the shared checks of
``kvspec.contract`` before changing anything and raises the same ``KVSpecError``
subclasses as the model; ``snapshot()`` is the model's canonical format, key for key.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, cast

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
from kvspec.contract.snapshot import Transfer, scheduler_section
from kvspec.contract.types import BlockIds, ConnectorMetadata, KVConnectorOutput, RequestView, SchedulerOutput
from kvspec.impl.block_pool import TensorBlockPool
from kvspec.impl.convert import int_tensor
from kvspec.impl.hit_search import longest_hit
from kvspec.impl.keys import KeyTable
from kvspec.impl.payload import PayloadStore
from kvspec.impl.planner import Candidates, decide, layout
from kvspec.impl.request_table import StoreTable


@dataclass
class Xfer:
    """A transfer: GPU and CPU block ids (tensors) in pair order."""

    gpu: torch.Tensor
    cpu: torch.Tensor

    def pair(self) -> Transfer:
        return self.gpu.tolist(), self.cpu.tolist()


@dataclass
class Hit:
    blocks: list[list[int]]
    hit_len: int
    num_computed_tokens: int
    pinned: torch.Tensor  # the non-null blocks, as pinned


@dataclass
class Load:
    request: RequestView
    xfer: Xfer
    load_event: int | None = None
    finished: bool = False


@dataclass
class Segment:
    """Occurrences of requests in a scheduler output, in order (parallel lists)."""

    rids: list[str]
    ids: list[Any]
    full: list[bool]
    slots: list[int]


@dataclass
class StepBatch:
    gpu: list[torch.Tensor]
    cpu: list[torch.Tensor]
    req_ids: list[str]




class TensorOffloadScheduler:
    def __init__(self, config: OffloadConfig, device: str | torch.device = "cpu",
                 block_shape: tuple[int, ...] = (2, 8), dtype: torch.dtype = torch.float32) -> None:
        from kvspec.impl.policies import make_policy

        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.B = config.block_size
        self.G = config.num_groups
        self.keys = KeyTable(self.G, self.device)
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
        self.reqs_to_load: dict[str, Load] = {}
        self.load_event_to_reqs: dict[int, list[str]] = {}
        self.abandoned_reqs_to_load: dict[str, Load] = {}
        self.pending_cpu_hits: dict[str, Hit] = {}
        self.store_events: dict[int, Xfer] = {}
        self.abandoned_store_events: dict[int, Xfer] = {}
        self.pending_finished_stores: list[Xfer] = []
        self.store_event_to_reqs: dict[int, list[str]] = {}
        self.stores = StoreTable(self.G, self.keys, self.device)
        self.in_flight = torch.zeros(config.num_gpu_blocks, dtype=torch.bool, device=self.device)
        self._memo: tuple[list[str], int, list[int]] | None = None
        self._memo_sl: tuple[torch.Tensor, list[Any]] | None = None
        self._scratch = torch.zeros(config.num_gpu_blocks, dtype=torch.int64, device=self.device)
        self._stamp = 0
        self._min_scheduled = 0  # smallest num_scheduled_tokens value of the output being planned
        self.load_event_counter = 0
        self.store_event_counter = 0
        self.store_event_pending_counts: dict[int, int] = {}
        self.policy = make_policy(config.policy, self)

    # == loads =====================================================================================

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        check_request(request, "get_num_new_matched_tokens")
        check_count(num_computed_tokens, "num_computed_tokens", request.num_tokens)
        stale = self.pending_cpu_hits.pop(request.request_id, None)
        if stale is not None:
            self.cpu_pool.free_t(stale.pinned)
        if request.skip_reading_prefix_cache or num_computed_tokens % self.B:
            return 0, False
        hashes = request.block_hashes[num_computed_tokens // self.B:]
        max_len = request.num_tokens - 1 - num_computed_tokens
        if not hashes or max_len <= 0:
            return 0, False
        hids = [self.keys.known_hash_id(h) for h in hashes[: max_len // self.B]]
        if not hids or max(hids) < 0:
            return 0, False
        h = int_tensor(hids, self.device)
        kids = torch.where(h >= 0, h.view(1, -1) * self.G + torch.arange(self.G, device=self.device).view(-1, 1), -1)
        firsts = self.cpu_pool.first_of(kids).tolist()
        blocks, hit_len = longest_hit(firsts, self.config.groups, max_len, self.B)
        if hit_len == 0:
            return 0, False
        pinned = self.cpu_pool.as_ids([b for g in blocks for b in g if b != 0])
        self.cpu_pool.touch_t(pinned)
        self.pending_cpu_hits[request.request_id] = Hit(blocks, hit_len, num_computed_tokens, pinned)
        return hit_len, True

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None:
        rid = check_request(request, "update_state_after_alloc")
        ids = check_block_ids(block_ids, self.G, self.gpu_pool.num_blocks, "update_state_after_alloc",
                                none_groups=False)
        check_count(num_external_tokens, "num_external_tokens", request.num_tokens)
        pending = self.pending_cpu_hits.get(rid)
        load: tuple[list[int], list[int]] | None = None
        if num_external_tokens > 0 and pending is not None:
            if num_external_tokens % self.B:
                raise InvalidOperationError(
                    f"{name_of(rid)}: num_external_tokens {num_external_tokens} is not a multiple of "
                    f"the block size {self.B}")
            if num_external_tokens > pending.hit_len:
                raise InvalidOperationError(
                    f"{name_of(rid)}: accepted {num_external_tokens} external tokens of a {pending.hit_len}-token hit")
            if rid in self.reqs_to_load:
                raise InvalidOperationError(f"{name_of(rid)}: a load is already registered")
            load = self._load_pairs(rid, ids, pending, num_external_tokens)
        if not self.lazy_mode and rid not in self.stores:
            self.stores.add(rid, request)
        self.pending_cpu_hits.pop(rid, None)
        if pending is None or num_external_tokens == 0 or load is None:
            if pending is not None:
                self.cpu_pool.free_t(pending.pinned)
            return
        gpu = self.gpu_pool.as_ids(load[0])
        cpu = self.cpu_pool.as_ids(load[1])
        self.cpu_pool.touch_t(cpu)
        self.cpu_pool.free_t(pending.pinned)
        self.gpu_pool.touch_t(gpu)
        self.reqs_to_load[rid] = Load(request, Xfer(gpu, cpu))

    def _load_pairs(self, rid: str, ids: BlockIds, pending: Hit, ext: int) -> tuple[list[int], list[int]]:
        gpu: list[int] = []
        cpu: list[int] = []
        start = pending.num_computed_tokens // self.B
        take = -(-ext // self.B)
        for g, hits in enumerate(pending.blocks):
            for i, cb in enumerate(hits[:take]):
                if cb == 0:
                    continue
                if start + i >= len(ids[g]) or ids[g][start + i] == 0:
                    raise InvalidOperationError(
                        f"{name_of(rid)}: group {g} has no allocated GPU block at position {start + i} for the load")
                gpu.append(ids[g][start + i])
                cpu.append(cb)
        return gpu, cpu

    # == planning ==================================================================================

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        out = scheduler_output
        self._check_scheduler_output(out)
        if self.lazy_mode:
            batch = self._plan_lazy()
        else:
            batch = StepBatch([], [], [])
            self.policy.plan_eager(out, batch)
        for t in self.pending_finished_stores:
            batch.gpu.append(t.gpu)
            batch.cpu.append(t.cpu)
        self.pending_finished_stores.clear()
        meta = ConnectorMetadata(need_flush=bool(out.preempted_req_ids))
        gpu = (batch.gpu[0] if len(batch.gpu) == 1 else torch.cat(batch.gpu)) if batch.gpu else None
        if gpu is not None and gpu.numel():
            cpu = batch.cpu[0] if len(batch.cpu) == 1 else torch.cat(batch.cpu)
            e = self.store_event_counter
            self.store_event_counter += 1
            self.store_events[e] = Xfer(gpu, cpu)
            if batch.req_ids:
                self.store_event_to_reqs[e] = batch.req_ids
                slot_of, events = self.stores.slot_of, self.stores.events
                try:  # every listed request has a slot (the usual step): C-level passes
                    deque(map(set.add, map(events.__getitem__, map(slot_of.__getitem__, batch.req_ids)),
                              repeat(e)), maxlen=0)
                except KeyError:  # set.add is idempotent: redo it request by request
                    for r in batch.req_ids:
                        s = slot_of.get(r)
                        if s is not None:
                            events[s].add(e)
            meta.store_event = e
            meta.store_gpu_blocks = gpu.tolist()
            meta.store_cpu_blocks = cpu.tolist()
        unsent = [r for r, st in self.reqs_to_load.items() if st.load_event is None]
        if unsent:
            e = self.load_event_counter
            self.load_event_counter += 1
            for r in unsent:
                st = self.reqs_to_load[r]
                st.load_event = e
                meta.load_gpu_blocks += st.xfer.gpu.tolist()
                meta.load_cpu_blocks += st.xfer.cpu.tolist()
            self.load_event_to_reqs[e] = unsent
            meta.load_event = e
        meta.load_event_to_reqs = {e: list(rs) for e, rs in self.load_event_to_reqs.items()}
        return meta

    def _check_scheduler_output(self, out: SchedulerOutput) -> None:
        """Every field the planning reads, shapes first (``kvspec.contract.checks.check_scheduler_output``);
        notes the smallest scheduled count (0 when none) for the planner's fast path."""
        self._min_scheduled = check_scheduler_output(out, self.G, self.gpu_pool.num_blocks)

    def _ready(self, reqs: list[Any], lengths: torch.Tensor) -> torch.Tensor:
        """Confirmed full blocks per (request, group): computed minus placeholders, capped at the ids."""
        done = int_tensor([r.num_computed_tokens - r.num_output_placeholders for r in reqs], self.device)
        conf = torch.div(done.clamp_(min=0), self.B, rounding_mode="floor")
        return torch.minimum(lengths, conf.view(-1, 1))

    def eager_segments(self, out: SchedulerOutput) -> list[Segment]:
        """Preemption reset; then the registered, unfinished requests' occurrences in vLLM's order,
        split so that no slot repeats inside a segment (vLLM applies a request listed twice one
        occurrence after the other)."""
        st = self.stores
        if out.preempted_req_ids:
            st.reset_rows([st.slot_of[r] for r in out.preempted_req_ids if r in st.slot_of], True)
        cr = out.scheduled_cached_reqs
        new = out.scheduled_new_reqs
        rids: list[str] = [nr.req_id for nr in new] + cr.req_ids if new else cr.req_ids
        new_ids: list[BlockIds | None] = [nr.block_ids for nr in new]
        ids = new_ids + cr.new_block_ids if new else cr.new_block_ids
        if cr.resumed_req_ids:
            full = [True] * len(new) + [r in cr.resumed_req_ids for r in cr.req_ids]
        else:
            full = [True] * len(new) + [False] * len(cr.req_ids)
        memo = self._memo
        if not new and memo is not None and memo[1] == st.version and rids == memo[0]:
            return [Segment(memo[0], ids, full, memo[2])]  # the same running batch as last step
        found = list(map(st.slot_of.get, rids))
        slots: list[int]
        if None in found or st.num_finished:
            fin = st.finished
            keep = [s is not None and not fin[s] for s in found]
            rids, ids, full = list(compress(rids, keep)), list(compress(ids, keep)), list(compress(full, keep))
            slots = [s for s in compress(found, keep) if s is not None]  # keep is False for every None
        else:
            slots = cast("list[int]", found)  # no None in it
        if len(set(slots)) == len(slots):
            if not new:
                self._memo = (list(rids), st.version, slots)
                self._memo_sl = None
            return [Segment(rids, ids, full, slots)]
        segs = [Segment([], [], [], [])]
        seen: set[int] = set()
        for rid, block_ids, is_full, slot in zip(rids, ids, full, slots, strict=True):
            if slot in seen:
                segs.append(Segment([], [], [], []))
                seen = set()
            seen.add(slot)
            seg = segs[-1]
            seg.rids.append(rid)
            seg.ids.append(block_ids)
            seg.full.append(is_full)
            seg.slots.append(slot)
        return segs

    def apply_segment(self, seg: Segment, out: SchedulerOutput) -> tuple[list[str], list[int]]:
        """Accumulate a segment's ids (full tables replace); the rids and slots to scan."""
        if any(seg.full):
            self.stores.reset_rows(list(compress(seg.slots, seg.full)), False)
        if seg.ids.count(None) != len(seg.ids):
            app: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
            for ids, s in zip(seg.ids, seg.slots, strict=True):
                if ids is not None:
                    for g, gids in enumerate(ids):
                        if gids:
                            app[0].append(s)
                            app[1].append(g)
                            app[2].append(len(gids))
                            app[3].extend(gids)
            if app[0]:
                self.stores.append(*app)
        sched = out.num_scheduled_tokens
        if self._min_scheduled > 0 and len(sched) == len(seg.rids) and list(sched) == seg.rids:
            return seg.rids, seg.slots  # every listed request is scheduled (the usual step)
        want = list(map(sched.get, seg.rids))
        if all(want):
            return seg.rids, seg.slots
        return list(compress(seg.rids, want)), list(compress(seg.slots, want))

    def plan_scan(self, rids: list[str], slots: list[int], batch: StepBatch, rescan: bool) -> None:
        """Decide requests (distinct slots) in batches; commit each (baseline, signal-rescan)."""
        while slots:
            cut = self._plan_batch(rids, slots, batch, rescan)
            rids, slots = rids[cut:], slots[cut:]

    def batch_requests(self, slots: list[int]) -> tuple[torch.Tensor, list[Any]]:
        """The slots as a tensor and their request objects (kept while the running batch is unchanged)."""
        memo = self._memo
        if memo is not None and slots is memo[2]:
            if self._memo_sl is None:
                self._memo_sl = (int_tensor(slots, self.device), list(map(self.stores.request.__getitem__, slots)))
            return self._memo_sl
        return int_tensor(slots, self.device), list(map(self.stores.request.__getitem__, slots))

    def _plan_batch(self, rids: list[str], slots: list[int], batch: StepBatch, rescan: bool) -> int:
        st = self.stores
        k = len(slots)
        sl, reqs = self.batch_requests(slots)
        cur = st.cursor[sl]
        ready = self._ready(reqs, st.length[sl])
        lay = layout(cur, ready, rescan)
        if lay is None:
            return k
        occ, g, p, phase1, pair, n1 = lay
        gid = st.table[sl[occ], g, p]
        src = self._recover_nulls(gid, occ, g, p, slots.__getitem__)
        c = Candidates(occ, g, p, phase1, pair, src, src is not gid, n1)
        self.cpu_pool.index.ensure(self.keys.key_capacity)
        d = decide(c, k, self.G, self.gpu_pool.key, self.in_flight, self.cpu_pool.index.first_known,
                   self.cpu_pool.key,
                   self.cpu_pool.free.peek_head, self.cpu_pool.free.count, True, self._scratch, self._stamp)
        self._stamp += k + 1
        self._commit_selection(d.src, batch)
        cut = d.cut
        if cut < k:
            st.cursor.index_put_((sl[:cut],), d.advance[:cut], accumulate=True)
        else:
            st.cursor.index_put_((sl,), d.advance, accumulate=True)
        batch.req_ids.extend(map(rids.__getitem__, d.occ_with_selection))
        return cut

    def _recover_nulls(self, gid: torch.Tensor, occ: torch.Tensor, g: torch.Tensor, p: torch.Tensor,
                       slot_of_occ: Any) -> torch.Tensor:
        """Null entries: the GPU prefix cache's block for the position's key, else -1 (vLLM §7.6)."""
        if int(gid.min()) > 0:
            return gid
        null = (gid == 0).nonzero().flatten()
        kids = []
        for i, gg, pp in zip(occ[null].tolist(), g[null].tolist(), p[null].tolist(), strict=True):
            hids = self.stores.sync_hids(slot_of_occ(i))
            kids.append(hids[pp] * self.G + gg if pp < len(hids) else -1)
        found = self.gpu_pool.first_of(int_tensor(kids, self.device))
        src = gid.clone()
        src[null] = found
        return src

    def _commit_selection(self, gsel: torch.Tensor, batch: StepBatch | None) -> torch.Tensor:
        """Allocate CPU destinations for ``gsel`` (evictions to the policy), pin both sides."""
        K = gsel.numel()
        if K == 0:
            return gsel
        cpu, ev_b, ev_k = self.cpu_pool.alloc(K)
        if ev_b.numel():
            self.policy.on_evictions(ev_b, ev_k)
        self.in_flight[gsel] = True
        self.gpu_pool.touch_t(gsel)
        if batch is not None:
            batch.gpu.append(gsel)
            batch.cpu.append(cpu)
        return cpu

    def flush_select(self, slot: int, block_ids: list[list[int]]) -> torch.Tensor:
        """The baseline scan of ``[cursor, ready)`` over a live table (finish flush); no commit."""
        st = self.stores
        lengths = torch.tensor([[len(x) for x in block_ids]], dtype=torch.int64, device=self.device)
        cur = st.cursor[slot].view(1, -1)
        ready = self._ready([self.stores.request[slot]], lengths)
        lay = layout(cur, ready, False)
        if lay is None:
            return self.gpu_pool.empty()
        occ, g, p, phase1, pair, n1 = lay
        width = max(1, int(lengths.max()))
        padded = torch.zeros((self.G, width), dtype=torch.int64, device=self.device)
        for gg, ids in enumerate(block_ids):
            if ids:
                padded[gg, : len(ids)] = int_tensor(ids, self.device)
        src = self._recover_nulls(padded[g, p], occ, g, p, lambda i: slot)
        d = decide(Candidates(occ, g, p, phase1, pair, src, True, n1), 1, self.G, self.gpu_pool.key, self.in_flight,
                   self.cpu_pool.first_of, self.cpu_pool.key, self.cpu_pool.free.peek_head,
                   self.cpu_pool.free.count, False, self._scratch)
        return d.src

    # -- lazy ------------------------------------------------------------------------------------------

    def _plan_lazy(self) -> StepBatch:
        batch = StepBatch([], [], [])
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
            batch.gpu.append(sel)
            batch.cpu.append(cpu)
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
            self.payload.load(st.xfer.gpu, st.xfer.cpu)
        self.cpu_pool.free_t(st.xfer.cpu)
        self.gpu_pool.free_t(st.xfer.gpu)

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
        ids = check_block_ids(block_ids, self.G, self.gpu_pool.num_blocks, "request_finished",
                                none_groups=False)
        s = self.stores.slot_of.get(request.request_id)
        if s is not None and not self.lazy_mode:
            self.policy.finish_flush(request, s, [list(g) for g in ids])
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

    def queue_flush(self, gsel: torch.Tensor, cpu: torch.Tensor | None = None) -> None:
        """Queue a finish-flush transfer (CPU blocks allocated now when not given)."""
        if cpu is None:
            cpu = self._commit_selection(gsel, None)
        self.pending_finished_stores.append(Xfer(gsel, cpu))

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
        def load(st: Load) -> tuple[Transfer, int | None, bool]:
            return st.xfer.pair(), st.load_event, st.finished

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
