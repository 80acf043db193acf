"""vLLM's ``ARCCachePolicy`` on tensors: list membership and order stamps.

Per slot, ``where`` says which list the resident key is in (1 = T1, 2 = T2; 0 = none) and
``stamp`` its order there; per key id, ``KeyTable.ghost`` / ``ghost_stamp`` do the same for
the ghost lists B1 and B2. Every move to a list's end takes the next value of one clock, so
each list's order is its members sorted by stamp. ``target`` (vLLM ``target_t1_size``) is a
Python float, adapted key by key in the order vLLM adapts it, with vLLM's expressions:
``min(target + max(1, |B2|/|B1|), capacity)`` on a B1 hit and
``max(target - max(1, |B1|/|B2|), 0)`` on a B2 hit.

Eviction of ``n`` takes, in stamp order, the first evictable unprotected keys of T1 while
T1's remaining size is at least ``int(target)``, then of T2, then of T1 again: three counts
computed up front from the two candidate lists (``topk`` of the smallest stamps), not a loop
per victim. Victims become ghosts in victim order; each ghost list is then cut from its front
to ``capacity`` keys.
"""

from __future__ import annotations

import torch

from kvspec.impl.offloading.keys import KeyTable
from kvspec.impl.offloading.pool import ChunkPool
from kvspec.impl.offloading.requests import Request

T1, T2 = 1, 2
B1, B2 = 1, 2


class TensorARC:
    name = "arc"

    def __init__(self, pool: ChunkPool, keys: KeyTable, capacity: int) -> None:
        self.pool = pool
        self.keys = keys
        self.capacity = capacity
        n = pool.num_chunks
        self.where = torch.zeros(n, dtype=torch.int8, device=pool.device)
        self.stamp = torch.zeros(n, dtype=torch.int64, device=pool.device)
        self.clock = 0
        self.sizes = [0, 0, 0]  # [unused, |T1|, |T2|]
        self.ghosts = [0, 0, 0]  # [unused, |B1|, |B2|]
        self.target: float = 0.0

    def _stamps(self, n: int) -> torch.Tensor:
        out = torch.arange(self.clock + 1, self.clock + 1 + n, dtype=torch.int64, device=self.pool.device)
        self.clock += n
        return out

    def _adapt(self, kids: list[int]) -> None:
        """Ghost hits among ``kids``, in order: each adapts the target and moves to its ghost
        list's end. Keys in no ghost list are ignored."""
        if not kids:
            return
        kt = self.keys.tensor(kids)
        g = self.keys.ghost[kt]
        hit = g != 0
        if not bool(hit.any()):
            return
        capacity = self.capacity
        b1, b2 = self.ghosts[B1], self.ghosts[B2]
        target = self.target
        for which in g[hit].tolist():
            if which == B1:
                target = float(min(target + max(1, b2 / b1), capacity))
            else:
                target = float(max(target - max(1, b1 / b2), 0))
        self.target = target
        hit_kids = kt[hit]
        self.keys.ghost_stamp[hit_kids] = self._stamps(hit_kids.numel())

    def insert(self, kids: list[int], slots: torch.Tensor, req: Request, generation: int) -> None:
        """New chunks go to T1's end, in order, and leave the ghost lists."""
        self.where[slots] = T1
        self.stamp[slots] = self._stamps(slots.numel())
        self.sizes[T1] += slots.numel()
        kt = self.keys.tensor(kids)
        g = self.keys.ghost[kt]
        self.ghosts[B1] -= int((g == B1).sum())
        self.ghosts[B2] -= int((g == B2).sum())
        self.keys.ghost[kt] = 0

    def remove(self, slots: torch.Tensor) -> None:
        w = self.where[slots]
        self.sizes[T1] -= int((w == T1).sum())
        self.sizes[T2] -= int((w == T2).sum())
        self.where[slots] = 0

    def _move(self, slots: torch.Tensor, lists: torch.Tensor) -> None:
        """Distinct resident ``slots`` go, in order, to the end of ``lists`` (T1 or T2 each)."""
        if slots.numel() == 0:
            return
        before = self.where[slots]
        moved_up = int(((before == T1) & (lists == T2)).sum())
        self.sizes[T1] -= moved_up
        self.sizes[T2] += moved_up
        self.where[slots] = lists.to(torch.int8)
        self.stamp[slots] = self._stamps(slots.numel())

    def touch(self, kids: list[int], req: Request, generation: int) -> None:
        """Last named first: a ready T1 key and any T2 key go to T2's end, a T1 key still
        being stored to T1's end; a key not resident may be a ghost hit."""
        rev = kids[::-1]
        slots = self.keys.slots_of(rev)
        res = slots >= 0
        s = slots[res]
        ready = self.pool.ref[s] >= 0
        lists = torch.where((self.where[s] == T2) | ready, T2, T1)
        self._move(s, lists)
        self._adapt([k for k, r in zip(rev, res.tolist(), strict=True) if not r])

    def on_store_miss(self, kids: list[int], req: Request, generation: int) -> None:
        self._adapt(kids[::-1])

    def on_request_access(self, kids: list[int], req: Request, generation: int) -> None:
        """ARC learns nothing from a first access."""

    def on_request_finished(self, order: list[int], insertion_only: set[int], reused: set[int],
                            req: Request, generation: int) -> None:
        """Tail to head: keys the request only inserted go to their list's end, ready ones it
        reused to T2's end."""
        rev = order[::-1]
        slots = self.keys.slots_of(rev)
        only = torch.tensor([k in insertion_only for k in rev], dtype=torch.bool, device=slots.device)
        again = torch.tensor([k in reused for k in rev], dtype=torch.bool, device=slots.device)
        pick = (slots >= 0) & (only | again)
        s = slots[pick]
        lists = torch.where(only[pick], self.where[s].to(torch.int64), T2)
        self._move(s, lists)

    def _first(self, mask: torch.Tensor, n: int) -> torch.Tensor:
        """Up to ``n`` slots of ``mask`` with the smallest stamps, in stamp order."""
        slots = torch.nonzero(mask).squeeze(1)
        k = min(n, slots.numel())
        if k == slots.numel():
            return slots[torch.argsort(self.stamp[slots])]
        return slots[torch.topk(self.stamp[slots], k, largest=False, sorted=True).indices]

    def _candidates(self, protected: torch.Tensor) -> torch.Tensor:
        """Mask of the slots eviction may take: listed, ref count 0, not protected."""
        return (self.where > 0) & (self.pool.ref == 0) & ~protected

    def evict(self, n: int, protected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Victim slots in vLLM's order and the list each came from; None when fewer than
        ``n`` are found (nothing changed)."""
        cand = self._candidates(protected)
        c1 = self._first(cand & (self.where == T1), n)
        c2 = self._first(cand & (self.where == T2), n)
        m1, m2 = c1.numel(), c2.numel()
        preferred = max(0, self.sizes[T1] - int(self.target) + 1)  # T1 takes while |T1| >= int(target)
        a = min(n, m1, preferred)
        b = min(n - a, m2)
        c = min(n - a - b, m1 - a)
        if a + b + c < n:
            return None
        victims = torch.cat([c1[:a], c2[:b], c1[a:a + c]])
        lists = torch.cat([c1.new_full((a,), T1), c2.new_full((b,), T2), c1.new_full((c,), T1)])
        kids = self.pool.key[victims]
        self.remove(victims)
        self.keys.ghost[kids] = lists.to(torch.int8)  # T1 victims to B1, T2 victims to B2
        self.keys.ghost_stamp[kids] = self._stamps(victims.numel())
        self.ghosts[B1] += a + c
        self.ghosts[B2] += b
        for which in (B1, B2):
            over = self.ghosts[which] - self.capacity
            if over > 0:
                members = torch.nonzero(self.keys.live(self.keys.ghost) == which).squeeze(1)
                front = members[torch.topk(self.keys.ghost_stamp[members], over, largest=False).indices]
                self.keys.ghost[front] = 0
                self.ghosts[which] -= over
        return victims, lists

    def clear(self) -> None:
        self.where.zero_()
        self.keys.ghost.zero_()
        self.sizes = [0, 0, 0]
        self.ghosts = [0, 0, 0]
        self.target = 0.0

    def _list(self, which: int) -> list[str]:
        slots = torch.nonzero(self.where == which).squeeze(1)
        slots = slots[torch.argsort(self.stamp[slots])]
        return self.keys.texts(self.pool.key[slots])

    def _ghost_list(self, which: int) -> list[str]:
        kids = torch.nonzero(self.keys.live(self.keys.ghost) == which).squeeze(1)
        return self.keys.texts(kids[torch.argsort(self.keys.ghost_stamp[kids])])

    def snapshot(self) -> dict[str, object]:
        return {"t1": self._list(T1), "t2": self._list(T2), "b1": self._ghost_list(B1), "b2": self._ghost_list(B2),
                "target_t1_size": float(self.target)}

    def _check(self) -> None:
        """List sizes match the tensors; only resident slots are listed; ghosts are not
        resident, at most ``capacity`` per list; ``0 <= target <= capacity``."""
        res = self.pool.resident()
        assert bool(((self.where > 0) == res).all())
        assert self.sizes[T1] == int((self.where == T1).sum()) and self.sizes[T2] == int((self.where == T2).sum())
        ghost = self.keys.live(self.keys.ghost)
        assert self.ghosts[B1] == int((ghost == B1).sum()) and self.ghosts[B2] == int((ghost == B2).sum())
        assert not bool(((ghost > 0) & (self.keys.live(self.keys.slot) >= 0)).any())
        assert self.ghosts[B1] <= self.capacity and self.ghosts[B2] <= self.capacity
        assert 0 <= self.target <= self.capacity
