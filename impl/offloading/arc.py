"""vLLM's ``ARCCachePolicy`` on tensors: list membership and order stamps.

Per slot, ``where`` says which list the resident key is in (1 = T1, 2 = T2; 0 = none) and
``stamp`` its order there (0 when in none); per key id, ``KeyTable.ghost`` / ``ghost_stamp``
do the same for the ghost lists B1 and B2. Every move to a list's end takes the next value of one clock, so
each list's order is its members sorted by stamp. ``target`` (vLLM ``target_t1_size``) is a
Python float, adapted key by key in the order vLLM adapts it, with vLLM's expressions:
``min(target + max(1, |B2|/|B1|), capacity)`` on a B1 hit and
``max(target - max(1, |B1|/|B2|), 0)`` on a B2 hit.

Each list also has a ``StampLog`` (its members in order, read from the head), so eviction
walks from the heads as vLLM does instead of scanning every slot. Eviction of ``n`` takes, in
list order, the first evictable unprotected keys of T1 while T1's remaining size is at least
``int(target)``, then of T2, then of T1 again: three counts computed from the first ``n``
candidates of T1 and the first ones T2 must give, not a loop per victim. Victims become
ghosts in victim order; each ghost list is then cut from its front to ``capacity`` keys.
Cost of an eviction: amortised O(n) plus the pinned or protected keys it passes over at the
heads, as in vLLM; never a scan of the pool or of the key table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvspec.impl.offloading.keys import KeyTable
from kvspec.impl.offloading.pool import ChunkPool
from kvspec.impl.offloading.requests import Request
from kvspec.impl.offloading.stamp_log import StampLog

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
        dev = pool.device
        self.logs = {T1: StampLog(lambda: self.stamp, dev), T2: StampLog(lambda: self.stamp, dev)}
        self.ghost_logs = {B1: StampLog(lambda: self.keys.ghost_stamp, dev),
                           B2: StampLog(lambda: self.keys.ghost_stamp, dev)}

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
        hit_kids, which = kt[hit], g[hit]
        stamps = self._stamps(hit_kids.numel())
        self.keys.ghost_stamp[hit_kids] = stamps
        for b in (B1, B2):
            mine = which == b
            self.ghost_logs[b].append(hit_kids[mine], stamps[mine])

    def insert(self, kids: list[int], slots: torch.Tensor, req: Request, generation: int) -> None:
        """New chunks go to T1's end, in order, and leave the ghost lists."""
        stamps = self._stamps(slots.numel())
        self.where[slots] = T1
        self.stamp[slots] = stamps
        self.logs[T1].append(slots, stamps)
        self.sizes[T1] += slots.numel()
        kt = self.keys.tensor(kids)
        g = self.keys.ghost[kt]
        self.ghosts[B1] -= int((g == B1).sum())
        self.ghosts[B2] -= int((g == B2).sum())
        self.keys.ghost[kt] = 0
        self.keys.ghost_stamp[kt] = 0

    def remove(self, slots: torch.Tensor) -> None:
        w = self.where[slots]
        self.sizes[T1] -= int((w == T1).sum())
        self.sizes[T2] -= int((w == T2).sum())
        self.where[slots] = 0
        self.stamp[slots] = 0

    def _move(self, slots: torch.Tensor, lists: torch.Tensor) -> None:
        """Distinct resident ``slots`` go, in order, to the end of ``lists`` (T1 or T2 each)."""
        if slots.numel() == 0:
            return
        before = self.where[slots]
        moved_up = int(((before == T1) & (lists == T2)).sum())
        self.sizes[T1] -= moved_up
        self.sizes[T2] += moved_up
        stamps = self._stamps(slots.numel())
        self.where[slots] = lists.to(torch.int8)
        self.stamp[slots] = stamps
        for t in (T1, T2):
            mine = lists == t
            self.logs[t].append(slots[mine], stamps[mine])

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

    def _usable(self, protected: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """Which slots eviction may take: ref count 0, not protected."""
        ref = self.pool.ref
        return lambda slots: torch.logical_not(ref.index_select(0, slots)) & ~protected.index_select(0, slots)

    def evict(self, n: int, protected: torch.Tensor) -> torch.Tensor | None:
        """Victim slots in vLLM's order; None when fewer than ``n`` are found (nothing
        changed). The T1 victims are the first ``a + c`` candidates of T1, so each ghost list
        receives its victims in list order."""
        usable = self._usable(protected)
        c1 = self.logs[T1].first(n, usable)
        m1 = c1.numel()
        preferred = max(0, self.sizes[T1] - int(self.target) + 1)  # T1 takes while |T1| >= int(target)
        a = min(n, m1, preferred)
        c2 = self.logs[T2].first(n - a, usable)
        b = c2.numel()
        c = min(n - a - b, m1 - a)
        if a + b + c < n:
            return None
        from_t1, from_t2 = c1[:a + c], c2
        victims = torch.cat([from_t1[:a], from_t2, from_t1[a:]]) if c else torch.cat([from_t1, from_t2])
        self.where[victims] = 0
        self.stamp[victims] = 0
        self.sizes[T1] -= a + c
        self.sizes[T2] -= b
        for which, slots in ((B1, from_t1), (B2, from_t2)):  # T1 victims to B1, T2 victims to B2
            if slots.numel() == 0:
                continue
            kids = self.pool.key[slots]
            stamps = self._stamps(kids.numel())
            self.keys.ghost[kids] = which
            self.keys.ghost_stamp[kids] = stamps
            self.ghost_logs[which].append(kids, stamps)
            self.ghosts[which] += kids.numel()
            over = self.ghosts[which] - self.capacity
            if over > 0:
                front = self.ghost_logs[which].first(over)
                self.keys.ghost[front] = 0
                self.keys.ghost_stamp[front] = 0
                self.ghosts[which] -= over
        return victims

    def clear(self) -> None:
        self.where.zero_()
        self.stamp.zero_()
        self.keys.ghost.zero_()
        self.keys.ghost_stamp.zero_()
        self.sizes = [0, 0, 0]
        self.ghosts = [0, 0, 0]
        self.target = 0.0
        for log in (*self.logs.values(), *self.ghost_logs.values()):
            log.clear()

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
        resident, at most ``capacity`` per list; ``0 <= target <= capacity``; exactly the
        members have a stamp; each list's log holds one live entry per member of that list, in
        stamp order."""
        res = self.pool.resident()
        assert bool(((self.where > 0) == res).all())
        assert self.sizes[T1] == int((self.where == T1).sum()) and self.sizes[T2] == int((self.where == T2).sum())
        ghost = self.keys.live(self.keys.ghost)
        assert self.ghosts[B1] == int((ghost == B1).sum()) and self.ghosts[B2] == int((ghost == B2).sum())
        assert not bool(((ghost > 0) & (self.keys.live(self.keys.slot) >= 0)).any())
        assert self.ghosts[B1] <= self.capacity and self.ghosts[B2] <= self.capacity
        assert 0 <= self.target <= self.capacity
        assert bool(((self.where > 0) == (self.stamp > 0)).all())
        assert bool(((ghost > 0) == (self.keys.live(self.keys.ghost_stamp) > 0)).all())
        for lists, logs, sizes in ((self.where, self.logs, self.sizes),
                                   (self.keys.ghost, self.ghost_logs, self.ghosts)):
            for which, log in logs.items():
                log._check()
                members = log.members()
                assert members.numel() == sizes[which] and bool((lists[members] == which).all())
