"""Batched eager store planning: one pass of tensor ops for all scheduled requests.

vLLM scans each scheduled request's positions ``[cursor, ready)`` in turn. Here every
(request, group, position) candidate of a whole step is laid out in one flat tensor
in vLLM's visiting order and decided at once:

1. **classify** (vLLM ``_classify_store_candidate``): the source block (a null entry is
   recovered from the GPU prefix cache by the position's key), then NOT_HASHED,
   IN_FLIGHT, ALREADY_CACHED or READY from three gathers;
2. **same-step dedup**: a READY block that an earlier request of the step selects is
   IN_FLIGHT for the later ones (vLLM adds a request's picks to the in-flight set
   after its scan, so repeats inside one request are both selected);
3. **space**: each request may select while the CPU free count read before it lasts,
   i.e. while the step's running count of READY candidates is within the free count at
   the start of the step; a cumulative sum finds the selected candidates and, per
   request and group, where the scan stopped (the cursor passes everything before the
   first READY candidate that did not fit; a group that starts with no space is not
   scanned, nor are the request's later groups);
4. **self-eviction check**: CPU allocation pops the LRU head, which may evict an entry
   that a later request of the same step classified ALREADY_CACHED (vLLM's T3). The
   planner peeks at the blocks the step will pop; the first request whose decision
   could depend on one of them ends the batch, and planning resumes from it with the
   state after the allocations before it. Each request is therefore decided exactly
   as in vLLM's sequential loop.

The ``signal-rescan`` policy adds, when its flag was set, the positions ``[0, min(cursor,
ready))`` before each group's new ones (phase 1a; they never move the cursor).
Cost per step: O(candidates) tensor work plus O(requests) Python to read the
requests' token counts; nothing proportional to the pool sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BIG = 1 << 62


@dataclass
class Candidates:
    occ: torch.Tensor  # local request index
    g: torch.Tensor
    p: torch.Tensor
    phase1: torch.Tensor | None  # True: [cursor, ready) (moves the cursor); False: rescan of [0, cursor) (None: all)
    pair: torch.Tensor  # occ * G + g
    src: torch.Tensor  # GPU block to store (-1: null and not recoverable)
    has_nulls: bool = True  # False when no position held the null block
    n1: torch.Tensor | None = None  # [k, G] positions in [cursor, ready) (set by the plain layout)


@dataclass
class Decision:
    src: torch.Tensor  # the selected GPU blocks, in visiting order
    advance: torch.Tensor  # [k, G] cursor advance per request and group
    occ_with_selection: list[int]  # requests (local index) that selected something, in order
    cut: int  # requests decided (a prefix of the batch)


# (occ, g, p, phase1, pair, n1); phase1 is None without a rescan (every position is in phase 1),
# n1 is None with one (see Candidates).
Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def layout(cur: torch.Tensor, ready: torch.Tensor, rescan: bool) -> Layout | None:
    """Flat (occ, g, p, phase1, pair) for ranges [cursor, ready) (after [0, min(cursor, ready)))."""
    k, G = cur.shape
    n1 = (ready - cur).clamp(min=0)
    if not rescan:
        m = int(n1.max()) if n1.numel() else 0
        if m == 0:
            return None
        if m == 1:  # at most one new position per (request, group): the usual step
            occ, g = n1.nonzero(as_tuple=True)
            p = cur[occ, g]
        else:
            occ, g, j = (torch.arange(m, device=cur.device) < n1.unsqueeze(-1)).nonzero(as_tuple=True)
            p = cur[occ, g] + j
        return occ, g, p, None, (occ if G == 1 else occ * G + g), n1
    n0 = torch.minimum(cur, ready).clamp(min=0)
    cnt = (n0 + n1).flatten()
    total = int(cnt.sum())
    if total == 0:
        return None
    dev = cur.device
    pair = torch.repeat_interleave(torch.arange(k * G, device=dev), cnt)
    start = torch.cumsum(cnt, 0) - cnt
    local = torch.arange(total, device=dev) - start[pair]
    n0f = n0.flatten()[pair]
    phase1 = local >= n0f
    p = torch.where(phase1, cur.flatten()[pair] + local - n0f, local)
    return pair // G, pair % G, p, phase1, pair, None


def decide(c: Candidates, k: int, G: int, gpu_key: torch.Tensor, in_flight: torch.Tensor,
           cpu_first_of: Callable[[torch.Tensor], torch.Tensor], cpu_key: torch.Tensor,
           peek_cpu_head: Callable[[int], torch.Tensor], free0: int, cross_request: bool,
           scratch: torch.Tensor, stamp_base: int = 0) -> Decision:
    """``scratch``: an int64 tensor over the GPU blocks, zeros at first; ``stamp_base``: larger than
    any stamp of an earlier call (the caller adds ``k + 1`` after each call)."""
    dev = c.src.device
    n = c.src.numel()
    if c.has_nulls:
        src = c.src.clamp(min=0)
        key = torch.where(c.src > 0, gpu_key[src], -1)
    else:
        src = c.src
        key = gpu_key[src]
    movable = (key >= 0) > in_flight[src]  # hashed and not in flight
    cached = cpu_first_of(key) >= 0  # key -1 reads the index's sentinel slot
    ready = movable > cached
    already = movable & cached
    rsel, osel = src[ready], c.occ[ready]
    if cross_request and k > 1 and rsel.numel() > 1:
        # the first request that has a block READY takes it; later ones see it in flight.
        # scratch[b] = stamp - (first request); stamps only grow, so no reset is needed
        stamp = stamp_base + k + 1
        ro = stamp - osel
        scratch.scatter_reduce_(0, rsel, ro, reduce="amax")
        late = ro < scratch[rsel]
        if bool(late.any()):
            ready[ready.nonzero().flatten()[late]] = False
            rsel, osel = src[ready], c.occ[ready]
    total = rsel.numel()
    cut = k
    cum = None
    if total > 0 and bool(already.any()):
        cum = torch.cumsum(ready, 0)
        K = min(total, free0)
        popped_keys = cpu_key[peek_cpu_head(K)]
        hk = (popped_keys >= 0).nonzero().flatten()
        if hk.numel():
            ks, order = torch.sort(popped_keys[hk], stable=True)
            kpos = hk[order]
            ai = already.nonzero().flatten()
            akey = key[ai]
            at = torch.searchsorted(ks, akey).clamp(max=ks.numel() - 1)
            found = ks[at] == akey
            # selections of the requests before each candidate's request: the count at its request's start
            first_of_occ = torch.full((k,), BIG, dtype=torch.int64, device=dev)
            first_of_occ.scatter_reduce_(0, c.occ, torch.arange(n, device=dev), reduce="amin")
            start = first_of_occ[c.occ[ai]]
            before = (cum[start] - ready[start].to(torch.int64)).clamp(max=free0)
            danger = found & (kpos[at] < before)
            if bool(danger.any()):
                cut = int(c.occ[ai[danger]].min())
    if total < free0 and cut == k:  # everything fits: every position passed, every READY taken
        if c.n1 is not None:
            advance = c.n1
        else:
            assert c.phase1 is not None, "layout() sets phase1 whenever it leaves n1 unset"
            advance = torch.zeros(k * G, dtype=torch.int64, device=dev)
            advance.scatter_add_(0, c.pair, c.phase1.to(torch.int64)).view(k, G)
        return Decision(rsel if not c.has_nulls else c.src[ready], advance.view(k, G),
                        torch.unique_consecutive(osel).tolist(), cut)
    phase1 = c.phase1 if c.phase1 is not None else torch.ones(n, dtype=torch.bool, device=dev)
    if cum is None:
        cum = torch.cumsum(ready, 0)
    sel = ready & (cum <= free0)
    stop = ready & ~sel
    idx = torch.arange(n, device=dev)
    first_idx = torch.full((k * G,), BIG, dtype=torch.int64, device=dev)
    first_idx.scatter_reduce_(0, c.pair, idx, reduce="amin")
    excl = cum - ready.to(torch.int64)
    alive = excl[first_idx.clamp(max=max(n - 1, 0))] < free0
    stop_at = torch.full((k * G,), BIG, dtype=torch.int64, device=dev)
    s1 = (stop & phase1).nonzero().flatten()
    if s1.numel():
        stop_at.scatter_reduce_(0, c.pair[s1], s1, reduce="amin")
    moves = phase1 & alive[c.pair] & (idx < stop_at[c.pair])
    if cut < k:
        keep = c.occ < cut
        sel &= keep
        moves &= keep
    advance = torch.zeros(k * G, dtype=torch.int64, device=dev).scatter_add_(0, c.pair, moves.to(torch.int64))
    chosen = sel.nonzero().flatten()
    return Decision(c.src[chosen], advance.view(k, G), torch.unique_consecutive(c.occ[chosen]).tolist(), cut)
