"""Batched eager store planning: one pass of tensor ops for all scheduled requests.

vLLM scans each scheduled request's positions ``[cursor, ready)`` in turn. Here every
(request, group, position) candidate of a whole step is laid out in one flat tensor
in vLLM's visiting order (``layout``) and decided at once (``decide``):

1. **classify** (``rules.classify_store_candidate``, batched): the source block (a null
   entry is recovered from the GPU prefix cache by the position's key), then NOT_HASHED,
   IN_FLIGHT, ALREADY_CACHED or READY from three gathers;
2. **same-step dedup**: a READY block that an earlier request of the step selects is
   IN_FLIGHT for the later ones (vLLM adds a request's picks to the in-flight set
   after its scan, so repeats inside one request are both selected);
3. **self-eviction check**: CPU allocation pops the LRU head, which may evict an entry
   that a later request of the same step classified ALREADY_CACHED (vLLM's T3). The
   planner peeks at the blocks the step will pop; the first request whose decision
   could depend on one of them ends the batch, and planning resumes from it with the
   state after the allocations before it. Each request is therefore decided exactly
   as in vLLM's sequential loop;
4. **space** (``rules.scan_group``, batched): each request may select while the CPU
   free count read before it lasts, i.e. while the step's running count of READY
   candidates is within the free count at the start of the step; a cumulative sum
   finds the selected candidates and, per request and group, where the scan stopped
   (the cursor passes everything before the first READY candidate that did not fit; a
   group that starts with no space is not scanned, nor are the request's later groups).

The ``signal-rescan`` policy adds, when its flag was set, the positions ``[0, min(cursor,
ready))`` before each group's new ones (phase 1a; they never move the cursor).
Cost per step: O(candidates) tensor work plus O(requests) Python to read the
requests' token counts; nothing proportional to the pool sizes.
tests/test_impl_rules.py holds the batched forms to the rule functions on random inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

BIG = 1 << 62  # larger than any candidate index: "no such candidate" in amin reductions


class Layout(NamedTuple):
    """The candidate positions of a batch of ``k`` requests over ``G`` groups, flat, in vLLM's
    visiting order (request, then group, then position)."""

    request: torch.Tensor  # the candidate's request, as its index in the batch
    group: torch.Tensor
    position: torch.Tensor
    phase1: torch.Tensor | None  # True: in [cursor, ready) (moves the cursor); False: rescan of [0, cursor);
    #                              None: no rescan (every candidate is in phase 1)
    pair: torch.Tensor  # request * G + group
    new_counts: torch.Tensor | None  # [k, G]: the length of each [cursor, ready) (None with a rescan)


@dataclass
class Candidates:
    """A layout with the GPU block to store at each position."""

    layout: Layout
    src: torch.Tensor  # GPU block to store (-1: null and not recoverable)
    has_nulls: bool = True  # False when no position held the null block


class PoolReads(NamedTuple):
    """What ``decide`` reads of the pools and the in-flight set (nothing is changed)."""

    gpu_key: torch.Tensor
    in_flight: torch.Tensor  # bool per GPU block
    cpu_first_of: Callable[[torch.Tensor], torch.Tensor]  # key ids -> first CPU block (-1: none)
    cpu_key: torch.Tensor
    peek_cpu_head: Callable[[int], torch.Tensor]  # the next n blocks an allocation pops
    cpu_free: int  # free CPU blocks at the start of the batch


@dataclass
class SameStepDedup:
    """Scratch state of the cross-request dedup: an int64 tensor over the GPU blocks (zeros at
    first) and a base larger than any stamp of an earlier call (the caller adds ``k + 1``
    after each call), so that the scratch never needs a reset."""

    scratch: torch.Tensor
    stamp_base: int


@dataclass
class Decision:
    src: torch.Tensor  # the selected GPU blocks, in visiting order
    advance: torch.Tensor  # [k, G] cursor advance per request and group
    requests_with_selection: list[int]  # requests (index in the batch) that selected something, in order
    cut: int  # requests decided (a prefix of the batch)


class Classes(NamedTuple):
    """``rules.classify_store_candidate`` per candidate: the block and key it reads, and the
    two classes the planning acts on (the others are passed)."""

    src: torch.Tensor  # the source block, null entries clamped to block 0
    key: torch.Tensor  # its key id (-1: null or not hashed)
    ready: torch.Tensor  # READY
    already: torch.Tensor  # ALREADY_CACHED


def candidate_layout(cur: torch.Tensor, ready: torch.Tensor, rescan: bool) -> Layout | None:
    """Flat candidates for the ranges ``[cursor, ready)`` (after ``[0, min(cursor, ready))`` each
    when ``rescan``), from ``[k, G]`` cursors and ready counts; None when there are none.
    O(k * G + candidates)."""
    if not rescan:
        return _plain_layout(cur, ready)
    return _rescan_layout(cur, ready)


def _plain_layout(cur: torch.Tensor, ready: torch.Tensor) -> Layout | None:
    G = cur.shape[1]
    new_counts = (ready - cur).clamp(min=0)
    m = int(new_counts.max()) if new_counts.numel() else 0
    if m == 0:
        return None
    if m == 1:  # at most one new position per (request, group): the usual step
        req, g = new_counts.nonzero(as_tuple=True)
        p = cur[req, g]
    else:
        req, g, j = (torch.arange(m, device=cur.device) < new_counts.unsqueeze(-1)).nonzero(as_tuple=True)
        p = cur[req, g] + j
    return Layout(req, g, p, None, (req if G == 1 else req * G + g), new_counts)


def _rescan_layout(cur: torch.Tensor, ready: torch.Tensor) -> Layout | None:
    k, G = cur.shape
    new_counts = (ready - cur).clamp(min=0)
    old_counts = torch.minimum(cur, ready).clamp(min=0)  # the rescan of [0, min(cursor, ready))
    cnt = (old_counts + new_counts).flatten()
    total = int(cnt.sum())
    if total == 0:
        return None
    dev = cur.device
    pair = torch.repeat_interleave(torch.arange(k * G, device=dev), cnt)
    start = torch.cumsum(cnt, 0) - cnt
    local = torch.arange(total, device=dev) - start[pair]
    old = old_counts.flatten()[pair]
    phase1 = local >= old
    p = torch.where(phase1, cur.flatten()[pair] + local - old, local)
    return Layout(pair // G, pair % G, p, phase1, pair, None)


def classify(src: torch.Tensor, has_nulls: bool, pools: PoolReads) -> Classes:
    """``rules.classify_store_candidate`` for every candidate at once: null (src < 1 when
    ``has_nulls``), not hashed, in flight, already cached, ready. Three gathers."""
    if has_nulls:
        block = src.clamp(min=0)
        key = torch.where(src > 0, pools.gpu_key[block], -1)
    else:
        block = src
        key = pools.gpu_key[block]
    movable = (key >= 0) > pools.in_flight[block]  # hashed and not in flight
    cached = pools.cpu_first_of(key) >= 0  # key -1 reads the index's sentinel slot
    return Classes(block, key, movable > cached, movable & cached)


def decide(c: Candidates, k: int, G: int, pools: PoolReads, dedup: SameStepDedup | None) -> Decision:
    """The batch's selections and cursor advances, as vLLM's sequential scan of its requests
    would make them (steps 1-4 of the module docstring); ``dedup`` None: no cross-request
    dedup (one request). O(candidates) tensor ops."""
    classes = classify(c.src, c.has_nulls, pools)
    ready = classes.ready
    if dedup is not None and k > 1:
        ready = _drop_later_repeats(classes.src, ready, c.layout.request, k, dedup)
    total = int(ready.sum())
    cut, cum = _self_eviction_cut(c.layout, k, classes.key, ready, classes.already, total, pools)
    if total < pools.cpu_free and cut == k:  # every position passed, every READY taken
        return _all_fit(c, k, G, ready)
    return _scan_stops(c, k, G, ready, cum, pools.cpu_free, cut)


def _drop_later_repeats(src: torch.Tensor, ready: torch.Tensor, request: torch.Tensor, k: int,
                        dedup: SameStepDedup) -> torch.Tensor:
    """Step 2: the first request that has a block READY takes it; later ones see it in flight.
    Each READY candidate stamps its block with ``stamp_base + k + 1 - request`` (the others with
    0), ``scratch[b]`` keeps the largest stamp (the first request's); a READY candidate stays
    READY when its stamp is that largest one. Stamps only grow from call to call, so the scratch
    needs no reset. Five tensor ops over all candidates, no compaction."""
    stamps = torch.where(ready, (dedup.stamp_base + k + 1) - request, 0)
    dedup.scratch.scatter_reduce_(0, src, stamps, reduce="amax")
    ready &= stamps >= dedup.scratch[src]
    return ready


def _self_eviction_cut(layout: Layout, k: int, key: torch.Tensor, ready: torch.Tensor, already: torch.Tensor,
                       total: int, pools: PoolReads) -> tuple[int, torch.Tensor | None]:
    """Step 3: the first request whose ALREADY_CACHED entry an earlier request's allocation pops
    (``k`` when none), and the running READY count when it was needed (``total``: READY count)."""
    if total == 0 or not bool(already.any()):
        return k, None
    cum = torch.cumsum(ready, 0)
    popped_keys = pools.cpu_key[pools.peek_cpu_head(min(total, pools.cpu_free))]
    hashed = (popped_keys >= 0).nonzero().flatten()  # pop order of the popped entries that hold a key
    if hashed.numel() == 0:
        return k, cum
    sorted_keys, order = torch.sort(popped_keys[hashed], stable=True)
    pop_rank = hashed[order]
    cached = already.nonzero().flatten()
    cached_keys = key[cached]
    match = torch.searchsorted(sorted_keys, cached_keys).clamp(max=sorted_keys.numel() - 1)
    found = sorted_keys[match] == cached_keys
    # selections of the requests before each candidate's request: the count at its request's start
    first_of_request = torch.full((k,), BIG, dtype=torch.int64, device=key.device)
    first_of_request.scatter_reduce_(0, layout.request, torch.arange(key.numel(), device=key.device), reduce="amin")
    start = first_of_request[layout.request[cached]]
    before = (cum[start] - ready[start].to(torch.int64)).clamp(max=pools.cpu_free)
    danger = found & (pop_rank[match] < before)
    if bool(danger.any()):
        return int(layout.request[cached[danger]].min()), cum
    return k, cum


def _all_fit(c: Candidates, k: int, G: int, ready: torch.Tensor) -> Decision:
    """Everything fits: every candidate in phase 1 is passed and every READY one selected."""
    layout = c.layout
    if layout.new_counts is not None:
        advance = layout.new_counts
    else:
        assert layout.phase1 is not None, "candidate_layout() sets phase1 whenever it leaves new_counts unset"
        advance = torch.zeros(k * G, dtype=torch.int64, device=ready.device)
        advance.scatter_add_(0, layout.pair, layout.phase1.to(torch.int64))
    return Decision(c.src[ready], advance.view(k, G), torch.unique_consecutive(layout.request[ready]).tolist(), k)


def _scan_stops(c: Candidates, k: int, G: int, ready: torch.Tensor, cum: torch.Tensor | None, free0: int,
                cut: int) -> Decision:
    """Step 4 (``rules.scan_group`` per group, batched): READY candidates are selected while the
    running count stays within ``free0``; each group's cursor passes everything before its first
    READY candidate in phase 1 that did not fit; a group that starts with no space is not scanned.
    Only the first ``cut`` requests are decided."""
    layout = c.layout
    n = ready.numel()
    dev = ready.device
    phase1 = layout.phase1 if layout.phase1 is not None else torch.ones(n, dtype=torch.bool, device=dev)
    if cum is None:
        cum = torch.cumsum(ready, 0)
    selected = ready & (cum <= free0)
    stop = ready & ~selected  # READY but out of space
    idx = torch.arange(n, device=dev)
    first_of_pair = torch.full((k * G,), BIG, dtype=torch.int64, device=dev)
    first_of_pair.scatter_reduce_(0, layout.pair, idx, reduce="amin")
    ready_before = cum - ready.to(torch.int64)
    scanned = ready_before[first_of_pair.clamp(max=max(n - 1, 0))] < free0  # per pair: room at its start
    stop_at = torch.full((k * G,), BIG, dtype=torch.int64, device=dev)
    stops = (stop & phase1).nonzero().flatten()
    if stops.numel():
        stop_at.scatter_reduce_(0, layout.pair[stops], stops, reduce="amin")
    moves = phase1 & scanned[layout.pair] & (idx < stop_at[layout.pair])
    if cut < k:
        keep = layout.request < cut
        selected &= keep
        moves &= keep
    advance = torch.zeros(k * G, dtype=torch.int64, device=dev).scatter_add_(0, layout.pair, moves.to(torch.int64))
    chosen = selected.nonzero().flatten()
    return Decision(c.src[chosen], advance.view(k, G), torch.unique_consecutive(layout.request[chosen]).tolist(), cut)
