"""One ordered list of ARC (T1, T2, B1 or B2) as an append-only log of ``(id, stamp)`` pairs.

The list's truth stays in a column its owner keeps, indexed by id: ``stamp[id]``, the id's
order in its list, from one clock shared by all the lists that column serves, and 0 for an id
in none of them. Every move of an id to the list's end appends ``(id, stamp)`` here; an
entry is live while ``stamp[id]`` is still the entry's stamp, and stale once the id moves
again (a new stamp) or leaves (0). Stamps only grow, so the live entries, read from the head,
are the list in order, each member once: a walk from the head is the list's walk.

Cost: an append is amortised O(1) per id (when the buffer is full its stale entries are
dropped, and it doubles only while more than half of it is live). ``first(n)`` reads windows
from the head, doubling from ``2n``, so it costs the entries it passes over: the stale prefix
it drops for good, then the live entries it skips (ids the caller refuses) and the stale ones
between them, at most about as many as the list has members.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Column = Callable[[], torch.Tensor]
Usable = Callable[[torch.Tensor], torch.Tensor]


class StampLog:
    def __init__(self, column: Column, device: torch.device, capacity: int = 64) -> None:
        self.column = column  # () -> stamp, read at each use (the owner may regrow it)
        self.ids = torch.empty(capacity, dtype=torch.int64, device=device)
        self.stamps = torch.empty(capacity, dtype=torch.int64, device=device)
        self.head = 0
        self.tail = 0

    def _live(self, ids: torch.Tensor, stamps: torch.Tensor) -> torch.Tensor:
        return self.column().index_select(0, ids) == stamps

    def _make_room(self, k: int) -> None:
        """Room for ``k`` more entries: the live ones moved to the front, the buffer doubled
        while they fill more than half of it."""
        cap = self.ids.numel()
        if self.tail + k <= cap:
            return
        ids, stamps = self.ids[self.head:self.tail], self.stamps[self.head:self.tail]
        live = self._live(ids, stamps)
        ids, stamps = ids[live], stamps[live]
        n = ids.numel()
        while 2 * (n + k) > cap:
            cap *= 2
        if cap != self.ids.numel():
            self.ids = torch.empty(cap, dtype=torch.int64, device=self.ids.device)
            self.stamps = torch.empty(cap, dtype=torch.int64, device=self.ids.device)
        self.ids[:n] = ids
        self.stamps[:n] = stamps
        self.head, self.tail = 0, n

    def append(self, ids: torch.Tensor, stamps: torch.Tensor) -> None:
        """``ids`` moved to the list's end in order, with increasing ``stamps`` above all here."""
        k = ids.numel()
        if k == 0:
            return
        self._make_room(k)
        self.ids[self.tail:self.tail + k] = ids
        self.stamps[self.tail:self.tail + k] = stamps
        self.tail += k

    def first(self, n: int, usable: Usable | None = None) -> torch.Tensor:
        """Up to ``n`` members from the head, in list order, skipping those ``usable`` refuses
        (a mask over ids); the stale entries in front of the first member are dropped.
        (``index_select`` and ``masked_select`` rather than indexing: a few microseconds
        less per call, and a walk is a dozen calls.)"""
        out: list[torch.Tensor] = []
        got = 0
        start = self.head
        width = max(2 * n, 32)
        while got < n and start < self.tail:
            end = min(self.tail, start + width)
            ids = self.ids[start:end]
            live = self._live(ids, self.stamps[start:end])
            if start == self.head:
                at = torch.nonzero(live)
                self.head = start + (int(at[0, 0]) if at.numel() else end - start)
            if usable is not None:
                live &= usable(ids)
            picked = torch.masked_select(ids, live)[:n - got]
            out.append(picked)
            got += picked.numel()
            start = end
            width *= 2
        if not out:
            return self.ids.new_empty(0)
        return out[0] if len(out) == 1 else torch.cat(out)

    def members(self) -> torch.Tensor:
        """The ids of the live entries, head first (the list). O(entries)."""
        ids = self.ids[self.head:self.tail]
        return torch.masked_select(ids, self._live(ids, self.stamps[self.head:self.tail]))

    def clear(self) -> None:
        self.head = self.tail = 0

    def _check(self) -> None:
        """``head <= tail <= capacity``; stamps strictly increase from head to tail."""
        assert 0 <= self.head <= self.tail <= self.ids.numel()
        s = self.stamps[self.head:self.tail]
        assert bool((s[1:] > s[:-1]).all())
