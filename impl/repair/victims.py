"""Victim choice for ``repair``'s re-stores (R7 of ``kvspec.model.repair``).

A re-store's CPU block is an *acceptable victim*: a free block that is unhashed, not
live, or useless (its key's parent is not covered: no lookup reaches it); never a live,
useful entry. For n re-stores, victims are taken in this order:

* (a) the acceptable entries at the LRU head, up to the first live one;
* (b) retired keys, oldest first: one owned again is dropped, one whose block is pinned
  or whose store is still in flight waits (goes back to the list);
* (c) a walk from the head, at most ``2n + 8`` entries, that takes not-live entries,
  refreshes (pins for the step, so that they move to the MRU end) the live, useful ones,
  and takes the useless ones it met last, if still short.

The walk reads the CPU free list in slices and the owner index only for keys that have
owners; the owners of the keys in (a)'s and (c)'s windows are judged in one batch
(``Ownership.reads``). Cost: O(n + retired keys skipped).
"""

from __future__ import annotations

from kvspec.impl.facade import SchedulerFacade
from kvspec.impl.repair.holds import StepHolds
from kvspec.impl.repair.in_flight import InFlightKeys
from kvspec.impl.repair.index import LossIndex
from kvspec.impl.repair.ownership import Ownership, Reads


class VictimChooser:
    def __init__(self, host: SchedulerFacade, index: LossIndex, in_flight: InFlightKeys, ownership: Ownership,
                 holds: StepHolds) -> None:
        self.host = host
        self.index = index
        self.in_flight = in_flight
        self.ownership = ownership
        self.holds = holds

    def reads_for(self, kids: list[int]) -> Reads:
        """``Ownership.reads`` for every owner of ``kids``."""
        owners = self.index.owners
        return self.ownership.reads(pos for kid in kids if kid in owners for pos in owners[kid])

    def acceptable_victim(self, kid: int, reads: Reads, useless_ok: bool = True) -> bool:
        """R7: a free CPU entry holding key ``kid`` (-1: unhashed) may be taken iff unhashed, not
        live, or (``useless_ok``) useless. Every owner of a key has the same prefix, so the first
        owner's parent is the key's parent. ``reads``: taken since the last change of state."""
        owners = self.index.owners
        if kid < 0 or kid not in owners or not reads.is_live(kid):
            return True
        if not useless_ok:
            return False
        return reads.useless(next(iter(owners[kid])))

    def choose_victims(self, n: int) -> list[int]:
        """Up to ``n`` acceptable victims, in the order (a), (b), (c)."""
        victims = self._head_victims(n)
        if len(victims) >= n:
            return victims
        chosen = set(victims)
        self._retired_victims(n, victims, chosen)
        if len(victims) < n:
            self._walk_victims(n, victims, chosen)
        return victims

    def _head_victims(self, n: int) -> list[int]:
        """(a): the acceptable (not live) entries at the head, up to the first that is not."""
        pool = self.host.cpu_pool
        head = pool.free.peek_head(n)
        victims: list[int] = []
        kids = pool.key[head].tolist()
        reads = self.reads_for(kids)
        for cb, kid in zip(head.tolist(), kids, strict=True):
            if not self.acceptable_victim(kid, reads, useless_ok=False):
                break
            victims.append(cb)
        return victims

    def _retired_victims(self, n: int, victims: list[int], chosen: set[int]) -> None:
        """(b): retired keys, oldest first, while short."""
        pool = self.host.cpu_pool
        retired = self.index.retired
        deferred: list[int] = []
        while len(victims) < n and retired:
            kid, _ = retired.popitem(last=False)
            cb = pool.index.get_one(kid)
            if cb < 0 and self.in_flight.count(kid) > 0:
                deferred.append(kid)  # its store has not completed yet
                continue
            if cb < 0 or cb in chosen or self.ownership.is_live(kid):
                continue
            if int(pool.ref[cb]) > 0:
                deferred.append(kid)
                continue
            victims.append(cb)
            chosen.add(cb)
        for kid in deferred:
            self.index.retire(kid)

    def _walk_victims(self, n: int, victims: list[int], chosen: set[int]) -> None:
        """(c): the bounded refreshing walk from the head; useless entries are taken last."""
        pool = self.host.cpu_pool
        budget = 2 * n + 8
        walk = pool.free.peek_head(len(chosen) + budget)
        refresh: list[int] = []
        useless: list[int] = []  # acceptable only because their parent is lost: taken last
        kids = pool.key[walk].tolist()
        reads = self.reads_for(kids)
        for cb, kid in zip(walk.tolist(), kids, strict=True):
            if len(victims) >= n or budget <= 0:
                break
            if cb in chosen:
                continue
            budget -= 1
            if self.acceptable_victim(kid, reads, useless_ok=False):
                victims.append(cb)
            elif self.acceptable_victim(kid, reads):
                useless.append(cb)
            else:
                refresh.append(cb)
        self.holds.pin(refresh)
        victims += useless[: n - len(victims)]
