"""The second manager's known-bug catalogue: variants of the ``CPUOffloadingManager`` model
that reintroduce a class of bug vLLM's offload tracker has reported.

As for the first manager (``kvspec.model.bugs``), a variant is *found* only when fuzzing it
violates an invariant of its ``oracle`` (catalogue ids O1-O10), never by comparison with the
correct model. A variant changes one rule: a policy subclass overriding one documented step
(``evictable``, ``mark_non_evictable``, ``evict``), or a manager subclass overriding one
contract method or documented step (``_allocate``, ``complete_store``, ``complete_load``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvspec.contract.offloading import OffloadingConfig, OffloadKey, PrepareStoreOutput
from kvspec.model.offloading.arc import ARCPolicy
from kvspec.model.offloading.lru import LRUPolicy
from kvspec.model.offloading.manager import OffloadingManager
from kvspec.model.offloading.policy import STORING, CachePolicy, Chunk, RequestContext

Policies = dict[str, Callable[[int], CachePolicy]]


@dataclass(frozen=True)
class OffloadingBug:
    """One variant: where the bug class is from, what the variant does, the policies it runs
    under (None: both), the invariants the fuzzer checks, and the manager class."""

    name: str
    source: str
    summary: str
    oracle: tuple[str, ...]
    manager: type[OffloadingManager]
    policy: str | None = None


# -- eviction of chunks in use ---------------------------------------------------------------


class _ARCEvictsStoring(ARCPolicy):
    def evictable(self, chunk: Chunk) -> bool:
        return chunk.ref_cnt <= 0


class _LRUEvictsStoring(LRUPolicy):
    def insert(self, key: OffloadKey, chunk: Chunk, ctx: RequestContext) -> None:
        super().insert(key, chunk, ctx)
        self.evictable.add(key)


class EvictsStoring(OffloadingManager):
    """A chunk being stored counts as evictable: a store in flight can lose its slot to another
    key, whose data the late copy then overwrites (the CPU side of the hazard vLLM #46951
    reports for GPU blocks: a block re-allocated while a transfer of it is in flight)."""

    POLICY_CLASSES: ClassVar[Policies] = {"lru": _LRUEvictsStoring, "arc": _ARCEvictsStoring}


class _ARCEvictsPinned(ARCPolicy):
    def evictable(self, chunk: Chunk) -> bool:
        return chunk.ref_cnt >= 0


class _LRUEvictsPinned(LRUPolicy):
    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Pinning by a load leaves the key evictable."""


class EvictsPinned(OffloadingManager):
    """A chunk pinned by a load in flight stays evictable: the load reads a slot another key
    now owns (the OffloadingConnector's ref counts exist to prevent it)."""

    POLICY_CLASSES: ClassVar[Policies] = {"lru": _LRUEvictsPinned, "arc": _ARCEvictsPinned}


class ReadyAtAllocation(OffloadingManager):
    """A new chunk is ready (``ref_cnt 0``) at ``prepare_store``, not at ``complete_store``:
    lookups answer HIT and loads read a slot whose copy has not landed (the -1 "being stored"
    mark, which vLLM #39186 relies on to keep a chunk invisible until its store completes,
    dropped)."""

    def _allocate(self, n: int) -> list[Chunk]:
        chunks = super()._allocate(n)
        for c in chunks:
            c.ref_cnt = 0
        return chunks


class FailedStoreLeaks(OffloadingManager):
    """A failed store drops the key but never returns its slot to the free list: the pool
    shrinks by one slot per failed transfer."""

    def complete_store(self, req_id: str, keys: Sequence[OffloadKey], success: bool = True) -> None:
        if success:
            super().complete_store(req_id, keys, success)
            return
        self._ctx(req_id, submit=False)
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is not None and chunk.ref_cnt == STORING:
                self.num_write_pending -= 1
                self.policy.remove(key)


class StoresPendingAgain(OffloadingManager):
    """A key whose store is still in flight is offered again and allocated a second chunk,
    as if missing (a re-offload of a block in flight)."""

    def prepare_store(self, req_id: str, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is not None and chunk.ref_cnt == STORING:
                self.policy.remove(key)
                self.free_list.append(chunk.chunk_id)
                self.num_write_pending -= 1
        return super().prepare_store(req_id, keys)


class _LRUEvictsOffered(LRUPolicy):
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        return super().evict(n, set())


class _ARCEvictsOffered(ARCPolicy):
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        return super().evict(n, set())


class EvictsOffered(OffloadingManager):
    """Eviction ignores the keys of the store that triggers it: a key the request just
    offered, already cached, is evicted to make room for its neighbours (vLLM protects them:
    "a chunk that was already stored must remain in the cache after this call")."""

    POLICY_CLASSES: ClassVar[Policies] = {"lru": _LRUEvictsOffered, "arc": _ARCEvictsOffered}


class _LRUEvictsNewest(LRUPolicy):
    def eviction_order(self) -> list[OffloadKey]:
        return super().eviction_order()[::-1]


class EvictsNewest(OffloadingManager):
    """LRU evicts the most recently used key first (a reversed heap comparison)."""

    POLICY_CLASSES: ClassVar[Policies] = {"lru": _LRUEvictsNewest, "arc": ARCPolicy}


class _ARCUntrimmedGhosts(ARCPolicy):
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        capacity, self.capacity = self.capacity, 1 << 30
        try:
            return super().evict(n, protected)
        finally:
            self.capacity = capacity


class UntrimmedGhosts(OffloadingManager):
    """ARC's ghost lists are never trimmed: B1 and B2 grow without bound with every eviction."""

    POLICY_CLASSES: ClassVar[Policies] = {"lru": LRUPolicy, "arc": _ARCUntrimmedGhosts}


class UnpinCountDrift(OffloadingManager):
    """The last load of a chunk completing does not count it evictable again: the manager's
    evictable count drifts below the truth and stores fail that could have evicted."""

    def complete_load(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        before = self.num_evictable
        super().complete_load(req_id, keys)
        self.num_evictable = before


OFFLOADING_BUGS: dict[str, OffloadingBug] = {b.name: b for b in [
    OffloadingBug("offloading-evict-storing", "the being-stored mark (CPU side of vLLM #46951's hazard)",
                  EvictsStoring.__doc__ or "", ("O2", "O3", "O5"), EvictsStoring),
    OffloadingBug("offloading-evict-pinned", "the OffloadingManager's ref counts (prepare_load pins)",
                  EvictsPinned.__doc__ or "", ("O3", "O5"), EvictsPinned),
    OffloadingBug("offloading-ready-at-allocation", "the being-stored mark (ref_cnt -1; vLLM #39186)",
                  ReadyAtAllocation.__doc__ or "", ("O2", "O8"), ReadyAtAllocation),
    OffloadingBug("offloading-failed-store-leak", "complete_store(success=False) must free the slot",
                  FailedStoreLeaks.__doc__ or "", ("O1",), FailedStoreLeaks),
    OffloadingBug("offloading-store-pending-again", "re-offload of a block in flight (PR #41289's class)",
                  StoresPendingAgain.__doc__ or "", ("O2", "O4"), StoresPendingAgain),
    OffloadingBug("offloading-evict-offered", "prepare_store's protected set (cpu/manager.py)",
                  EvictsOffered.__doc__ or "", ("O5",), EvictsOffered),
    OffloadingBug("lru-evicts-newest", "LRUCachePolicy's heap order", EvictsNewest.__doc__ or "", ("O9",),
                  EvictsNewest, "lru"),
    OffloadingBug("arc-untrimmed-ghosts", "ARCCachePolicy's ghost-list trim", UntrimmedGhosts.__doc__ or "",
                  ("O10",), UntrimmedGhosts, "arc"),
    OffloadingBug("offloading-unpin-count-drift", "CPUOffloadingManager's evictable count",
                  UnpinCountDrift.__doc__ or "", ("O6", "O7"), UnpinCountDrift),
]}


def offloading_bug_factory(name: str) -> Callable[[OffloadingConfig], OffloadingManager]:
    bug = OFFLOADING_BUGS[name]
    return bug.manager
