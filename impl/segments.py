"""A scheduler output's eager requests, in vLLM's order, as batches the planner can scan.

vLLM's ``_prepare_eager_store_specs`` resets preempted requests, then visits the new and
the cached requests of the output one after the other: a full table replaces the ids,
new ids are appended, and a request with scheduled tokens is scanned. The planner
scans many requests at once, so the occurrences are split into *segments* in which no
slot repeats (a request listed twice is applied one occurrence after the other); each
segment's ids are appended in one scatter (``StoreTable.append``) when the planning
reaches it, and its scheduled requests are scanned as one batch.

When a step lists exactly the running batch of the step before (no new requests, the
store table unchanged), the slots and request objects of the last step are reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from typing import Any, NamedTuple, cast

import torch

from kvspec.contract.types import BlockIds, SchedulerOutput
from kvspec.impl.convert import int_tensor
from kvspec.impl.request_table import StoreTable


@dataclass
class Segment:
    """Occurrences of requests in a scheduler output, in order (parallel lists), no slot twice."""

    rids: list[str]
    ids: list[BlockIds | None]  # new block ids per occurrence (None: none)
    full: list[bool]  # the occurrence carries the full table (new or resumed request)
    slots: list[int]


class ScanBatch(NamedTuple):
    """Requests to scan together (distinct slots), in vLLM's order."""

    rids: list[str]
    slots: list[int]


class BatchRequests(NamedTuple):
    """A batch's slots as a tensor, and its request objects (read for their token counts)."""

    slots: torch.Tensor
    requests: list[Any]


@dataclass
class _RunningBatch:
    """The last output's requests when it had no new ones, and the table version then."""

    rids: list[str]
    version: int
    slots: list[int]
    requests: BatchRequests | None = None  # made on first use


class Segmenter:
    """Splits outputs into segments and applies them to the store table."""

    def __init__(self, stores: StoreTable, device: torch.device) -> None:
        self.stores = stores
        self.device = device
        self._running: _RunningBatch | None = None

    def split(self, out: SchedulerOutput) -> list[Segment]:
        """The preemption reset (ids and cursors of preempted requests), then the registered,
        unfinished requests' occurrences in vLLM's order, split so that no slot repeats inside a
        segment. O(occurrences)."""
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
        last = self._running
        if not new and last is not None and last.version == st.version and rids == last.rids:
            return [Segment(last.rids, ids, full, last.slots)]  # the same running batch as last step
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
                self._running = _RunningBatch(list(rids), st.version, slots)
            return [Segment(rids, ids, full, slots)]
        return _split_repeats(rids, ids, full, slots)

    def apply(self, seg: Segment, out: SchedulerOutput, min_scheduled: int) -> ScanBatch:
        """Accumulate a segment's ids (full tables replace); the requests to scan: those with
        scheduled tokens (``min_scheduled`` > 0: every listed request has some). O(ids)."""
        if any(seg.full):
            self.stores.reset_rows(list(compress(seg.slots, seg.full)), False)
        if seg.ids.count(None) != len(seg.ids):
            self._append_ids(seg)
        sched = out.num_scheduled_tokens
        if min_scheduled > 0 and len(sched) == len(seg.rids) and list(sched) == seg.rids:
            return ScanBatch(seg.rids, seg.slots)  # every listed request is scheduled (the usual step)
        want = list(map(sched.get, seg.rids))
        if all(want):
            return ScanBatch(seg.rids, seg.slots)
        return ScanBatch(list(compress(seg.rids, want)), list(compress(seg.slots, want)))

    def _append_ids(self, seg: Segment) -> None:
        run_slots: list[int] = []
        run_groups: list[int] = []
        run_lengths: list[int] = []
        flat: list[int] = []
        for ids, slot in zip(seg.ids, seg.slots, strict=True):
            if ids is not None:
                for g, gids in enumerate(ids):
                    if gids:
                        run_slots.append(slot)
                        run_groups.append(g)
                        run_lengths.append(len(gids))
                        flat.extend(gids)
        if run_slots:
            self.stores.append(run_slots, run_groups, run_lengths, flat)

    def batch_requests(self, slots: list[int]) -> BatchRequests:
        """The slots as a tensor and their request objects (kept while the running batch is
        unchanged: ``slots`` is then the very list ``split`` handed out). O(len(slots))."""
        last = self._running
        if last is not None and slots is last.slots:
            if last.requests is None:
                last.requests = self._requests_of(slots)
            return last.requests
        return self._requests_of(slots)

    def _requests_of(self, slots: list[int]) -> BatchRequests:
        return BatchRequests(int_tensor(slots, self.device), list(map(self.stores.request.__getitem__, slots)))


def _split_repeats(rids: list[str], ids: list[BlockIds | None], full: list[bool], slots: list[int]) -> list[Segment]:
    """Cut the occurrences before each slot already in the current segment."""
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
