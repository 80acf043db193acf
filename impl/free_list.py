"""The free queue as a tensor deque with tombstones.

vLLM links free blocks in a doubly-linked list; taking the n blocks at the head is
then a walk of n pointers, one Python step each. Here the queue is an int64 *ring*
of block ids in eviction order (head at ``h``, tail at ``t``) plus, per block, its
slot in the ring (``pos``, -1 when not queued):

* ``pop_head(n)`` / ``peek_head(n)``: one slice of the ring, a mask and a cumulative
  count find the first n live entries; O(n + tombstones passed), a few tensor ops.
* ``remove(ids)``: the slots become tombstones (-1); O(len) in one scatter.
* ``append(ids)`` / ``prepend(ids)``: one slice write at either end; O(len).
* ``after(cursor, k)``: the k live entries after a block (vLLM ``iter_blocks_after``).

Tombstones are skipped by the head as it passes them and removed by a compaction
(which also re-centres the live span) when an end runs out of room or when they
outnumber the live entries; both are O(live) and happen at most once per O(live)
operations, so every operation is amortised O(its own size), independent of the
pool size.
"""

from __future__ import annotations

import torch

SMALL_WINDOW = 4096  # up to this many ring slots, ``order_list`` filters the window as a list


class FreeList:
    """Block ids in eviction order (head = least recently used = next popped)."""

    def __init__(self, num_blocks: int, initial: torch.Tensor, device: torch.device) -> None:
        self.device = device
        self.capacity = 4 * num_blocks + 16
        self.ring = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        self.position = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.h = self.t = self.capacity // 2
        self.count = 0
        self.append(initial)

    def __len__(self) -> int:
        return self.count

    def contains(self, block: int) -> bool:
        return bool(self.position[block] >= 0)

    # -- reading --------------------------------------------------------------------------

    def _first_live(self, start: int, n: int) -> tuple[torch.Tensor, int]:
        """The first ``n`` live ids at or after ring slot ``start`` and the slot after the last."""
        if n <= 0:
            return self.ring[:0], start
        head = self.ring[start : min(self.t, start + n)]
        if head.numel() == n and bool((head >= 0).all()):
            return head.clone(), start + n
        width = n
        while True:
            end = min(self.t, start + width)
            window = self.ring[start:end]
            live = (window >= 0).nonzero().flatten()
            if live.numel() >= n or end == self.t:
                live = live[:n]
                stop = start + int(live[-1]) + 1 if live.numel() else end
                return window[live], stop
            width = 2 * width + (n - live.numel())

    def peek_head(self, n: int) -> torch.Tensor:
        return self._first_live(self.h, min(n, self.count))[0]

    def order(self) -> torch.Tensor:
        window = self.ring[self.h : self.t]
        return window[window >= 0]

    def order_list(self) -> list[int]:
        """``order()`` as a list: a short ring window is filtered as a list (less than the
        tensor operations cost), a long one by ``order``. O(window)."""
        if self.t - self.h <= SMALL_WINDOW:
            return [b for b in self.ring[self.h : self.t].tolist() if b >= 0]
        return self.order().tolist()

    def after(self, cursor: int | None, k: int) -> torch.Tensor:
        """Up to ``k`` live ids after ``cursor`` (from the head when None; none if unqueued)."""
        if cursor is None:
            start = self.h
        else:
            p = int(self.position[cursor])
            if p < 0:
                return self.ring[:0]
            start = p + 1
        return self._first_live(start, k)[0]

    # -- changing ---------------------------------------------------------------------------

    def pop_head(self, n: int) -> torch.Tensor:
        ids, stop = self._first_live(self.h, n)
        self.position[ids] = -1
        self.h = stop  # slots outside [h, t) are never read, so they need no clearing
        self.count -= ids.numel()
        if self.count == 0:
            self.h = self.t = self.capacity // 2
        return ids

    def remove(self, ids: torch.Tensor) -> None:
        """Unlink queued, distinct ``ids`` from anywhere in the queue."""
        if ids.numel() == 0:
            return
        self.ring[self.position[ids]] = -1
        self.position[ids] = -1
        self.count -= ids.numel()
        if self.count == 0:
            self.h = self.t = self.capacity // 2
        elif self.t - self.h > 2 * self.count + 1024:
            self._compact(self.capacity // 2 - self.count // 2)

    def append(self, ids: torch.Tensor) -> None:
        m = ids.numel()
        if m == 0:
            return
        if self.t + m > self.capacity:
            self._compact((self.capacity - self.count - m) // 2)
        self.ring[self.t : self.t + m] = ids
        self.position[ids] = torch.arange(self.t, self.t + m, dtype=torch.int64, device=self.device)
        self.t += m
        self.count += m

    def prepend(self, ids: torch.Tensor) -> None:
        """``ids[0]`` becomes the new head."""
        m = ids.numel()
        if m == 0:
            return
        if self.h - m < 0:
            self._compact((self.capacity - self.count + m) // 2)
        self.ring[self.h - m : self.h] = ids
        self.position[ids] = torch.arange(self.h - m, self.h, dtype=torch.int64, device=self.device)
        self.h -= m
        self.count += m

    def _compact(self, start: int) -> None:
        live = self.order().clone()
        n = live.numel()
        self.ring[start : start + n] = live
        self.position[live] = torch.arange(start, start + n, dtype=torch.int64, device=self.device)
        self.h, self.t = start, start + n

    # -- self-check ---------------------------------------------------------------------------

    def _check(self) -> None:
        """The ring's live span ``[h, t)`` holds ``count`` live ids, each exactly where its ``pos``
        says, and no other block has a ring slot. O(span + blocks)."""
        assert 0 <= self.h <= self.t <= self.capacity, f"free list: span [{self.h}, {self.t}) out of the ring"
        pos = self.position.tolist()
        live = 0
        for slot, b in enumerate(self.ring[self.h : self.t].tolist(), start=self.h):
            if b >= 0:
                live += 1
                assert b < len(pos) and pos[b] == slot, f"free list: block {b} at slot {slot}, its pos is not"
        assert live == self.count, f"free list: {live} live entries, count {self.count}"
        assert sum(1 for p in pos if p >= 0) == self.count, "free list: a block has a slot but is not queued"
