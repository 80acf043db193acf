"""vLLM's ``LRUCachePolicy`` on tensors: two int64 rank columns per slot.

A resident key's rank is ``(rank0[slot], rank1[slot])``; the evictable keys (ref count 0)
leave in increasing ``(rank, key bytes)`` order. A fresh rank is ``(next_rank + 1, 0)``; a
request shares one rank ``r`` (drawn from ``next_rank`` once per cache generation, at its
first positioned insert or first access) and gives its key at position ``p`` the rank
``(r, -p)``; a first access only ever raises a rank.

Ordering is two stable sorts (``rank1`` then ``rank0``); keys still tied on both are put in
key-bytes order, which only the tied ones need (their bytes are compared in Python).
Eviction of ``n`` first narrows the candidates to those whose ``rank0`` is at most the
``n``-th smallest (``topk``), so it sorts only those.
"""

from __future__ import annotations

import torch

from kvspec.impl.offloading.keys import KeyTable
from kvspec.impl.offloading.pool import ChunkPool
from kvspec.impl.offloading.requests import Request


class TensorLRU:
    name = "lru"

    def __init__(self, pool: ChunkPool, keys: KeyTable) -> None:
        self.pool = pool
        self.keys = keys
        n = pool.num_chunks
        self.rank0 = torch.zeros(n, dtype=torch.int64, device=pool.device)
        self.rank1 = torch.zeros(n, dtype=torch.int64, device=pool.device)
        self.next_rank = 0

    def _refresh(self, slots: torch.Tensor) -> None:
        """Distinct ``slots`` become the most recent, in order (the last the most recent)."""
        n = slots.numel()
        if n == 0:
            return
        self.rank0[slots] = torch.arange(self.next_rank + 1, self.next_rank + 1 + n, dtype=torch.int64,
                                         device=slots.device)
        self.rank1[slots] = 0
        self.next_rank += n

    def _request_rank(self, req: Request, generation: int) -> int:
        if req.lru_rank is None or req.lru_rank[0] != generation:
            self.next_rank += 1
            req.lru_rank = (generation, self.next_rank)
        return req.lru_rank[1]

    def _resident_slots(self, kids: list[int]) -> torch.Tensor:
        slots = self.keys.slots_of(kids)
        return slots[slots >= 0]

    def insert(self, kids: list[int], slots: torch.Tensor, req: Request, generation: int) -> None:
        """New chunks, in call order: positioned keys ranked ``(request rank, -position)``,
        the others fresh; the request's rank is drawn at the first positioned key when it
        is stale, between the fresh ranks before and after that key."""
        pos = [req.positions.get(k) for k in kids]
        has = torch.tensor([p is not None for p in pos], dtype=torch.bool, device=slots.device)
        neg_pos = torch.tensor([0 if p is None else -p for p in pos], dtype=torch.int64, device=slots.device)
        fresh_upto = torch.cumsum((~has).to(torch.int64), 0)  # fresh ranks drawn up to each key, inclusive
        base = self.next_rank
        draw = bool(has.any()) and (req.lru_rank is None or req.lru_rank[0] != generation)
        if draw:
            first = int(torch.nonzero(has)[0, 0])
            after = (torch.arange(len(kids), device=slots.device) > first).to(torch.int64)
            fresh = base + fresh_upto + after
            request_rank = base + int(fresh_upto[first]) + 1
            req.lru_rank = (generation, request_rank)
            self.next_rank = base + int(fresh_upto[-1]) + 1
        else:
            fresh = base + fresh_upto
            request_rank = req.lru_rank[1] if req.lru_rank is not None else 0
            self.next_rank = base + int(fresh_upto[-1])
        self.rank0[slots] = torch.where(has, torch.full_like(fresh, request_rank), fresh)
        self.rank1[slots] = torch.where(has, neg_pos, torch.zeros_like(neg_pos))

    def remove(self, slots: torch.Tensor) -> None:
        """Nothing to do: a free slot's ranks are never read."""

    def touch(self, kids: list[int], req: Request, generation: int) -> None:
        """The resident keys become most recent, the first named the most recent of all."""
        self._refresh(self._resident_slots(kids[::-1]))

    def on_store_miss(self, kids: list[int], req: Request, generation: int) -> None:
        """vLLM's default (a touch): store misses are not resident, so nothing changes."""
        self.touch(kids, req, generation)

    def on_request_access(self, kids: list[int], req: Request, generation: int) -> None:
        """First accesses: the request's rank is drawn; a positioned resident key is raised
        to ``(request rank, -position)`` when that is above its rank."""
        rank = self._request_rank(req, generation)
        pairs = [(k, p) for k in kids if (p := req.positions.get(k)) is not None]
        if not pairs:
            return
        slots = self.keys.slots_of([k for k, _ in pairs])
        neg_pos = -self.keys.tensor([p for _, p in pairs])
        live = slots >= 0
        slots, neg_pos = slots[live], neg_pos[live]
        r0, r1 = self.rank0[slots], self.rank1[slots]
        raise_ = (r0 < rank) | ((r0 == rank) & (r1 < neg_pos))
        slots, neg_pos = slots[raise_], neg_pos[raise_]
        self.rank0[slots] = rank
        self.rank1[slots] = neg_pos

    def on_request_finished(self, order: list[int], insertion_only: set[int], reused: set[int],
                            req: Request, generation: int) -> None:
        """The request's keys in prefix order: the tail least recent, the head most recent."""
        self._refresh(self._resident_slots(order[::-1]))

    def order(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` sorted by ``(rank, key bytes)``. O(m log m) plus the tied keys' bytes."""
        perm = torch.argsort(self.rank1[slots], stable=True)
        perm = perm[torch.argsort(self.rank0[slots][perm], stable=True)]
        out = slots[perm]
        if out.numel() < 2:
            return out
        a0, a1 = self.rank0[out], self.rank1[out]
        same = (a0[1:] == a0[:-1]) & (a1[1:] == a1[:-1])
        if not bool(same.any()):
            return out
        return self._break_ties(out, same)

    def _break_ties(self, out: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
        """``out`` sorted by rank, ``same[i]`` when entries i and i+1 tie: each run of tied
        entries put in key-bytes order (the bytes of the tied keys only compared)."""
        tied = torch.zeros(out.numel(), dtype=torch.bool, device=out.device)
        tied[1:] |= same
        tied[:-1] |= same
        where = torch.nonzero(tied).squeeze(1)
        run = torch.cat([same.new_zeros(1, dtype=torch.int64), torch.cumsum((~same).to(torch.int64), 0)])[where]
        raw = self.keys.raw
        kids = self.pool.key[out[where]].tolist()
        by_bytes = sorted(range(len(kids)), key=lambda i: raw[kids[i]])
        ordinal = torch.empty(len(kids), dtype=torch.int64, device=out.device)
        ordinal[torch.tensor(by_bytes, dtype=torch.int64, device=out.device)] = torch.arange(
            len(kids), dtype=torch.int64, device=out.device)
        p = torch.argsort(ordinal, stable=True)
        p = p[torch.argsort(run[p], stable=True)]
        out[where] = out[where][p]
        return out

    def evictable(self) -> torch.Tensor:
        return self.pool.resident() & (self.pool.ref == 0)

    def _candidates(self, protected: torch.Tensor) -> torch.Tensor:
        """Mask of the slots eviction may take: evictable (ref count 0), not protected."""
        return self.evictable() & ~protected

    def evict(self, n: int, protected: torch.Tensor) -> torch.Tensor | None:
        """The first ``n`` evictable unprotected slots in eviction order; None when there are
        fewer."""
        cand = torch.nonzero(self._candidates(protected)).squeeze(1)
        if cand.numel() < n:
            return None
        if cand.numel() > n:
            r0 = self.rank0[cand]
            kth = torch.topk(r0, n, largest=False, sorted=False).values.max()
            cand = cand[r0 <= kth]
        return self.order(cand)[:n]

    def clear(self) -> None:
        self.next_rank = 0

    def snapshot(self) -> dict[str, object]:
        order = self.order(torch.nonzero(self.evictable()).squeeze(1))
        slots = torch.nonzero(self.pool.resident()).squeeze(1)
        keys = self.keys.keys
        kids, r0, r1 = self.pool.key[slots].tolist(), self.rank0[slots].tolist(), self.rank1[slots].tolist()
        ranked = sorted(zip((keys[k] for k in kids), r0, r1, strict=True))
        return {"order": self.keys.texts(self.pool.key[order]),
                "ranks": {f"{h}:{g}": [a, b] for (h, g), a, b in ranked},
                "next_rank": self.next_rank}

    def _check(self) -> None:
        """No resident key's rank is above the counter."""
        res = self.pool.resident()
        assert bool((self.rank0[res] <= self.next_rank).all())
