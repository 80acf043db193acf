"""vLLM's ``LRUCachePolicy`` (``vllm/v1/kv_offload/cpu/policies/lru.py``, 0.33.0).

Rule: every resident key has a *rank*, a pair of ints; eviction takes the evictable
(``ref_cnt == 0``), unprotected keys of smallest ``(rank, key_bytes)``. Ranks come from one
counter, ``next_rank``:

* a key stored or touched without a position, or re-used at a request's finish, gets
  ``(next_rank + 1, 0)``: most recent of all;
* a request shares one rank ``r`` across its calls (drawn from the counter at its first
  positioned insert or access); its key at end-token position ``p`` gets ``(r, -p)``, so
  within a request later positions come before earlier ones (tails are evicted first) and an
  access only ever raises a key's rank.

vLLM keeps the evictable keys in a lazily invalidated heap; the model keeps the ranks and
sorts on eviction: the same choice, O(E log E) for E evictable keys. ``clear`` restarts the
counter and starts a new generation, which makes every request's shared rank stale.
"""

from __future__ import annotations

from kvspec.contract.offloading import OffloadKey, key_bytes, key_text
from kvspec.model.offloading.policy import Chunk, RequestContext, order_request_keys

Rank = tuple[int, int]


class LRUPolicy:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.chunks: dict[OffloadKey, Chunk] = {}
        self.ranks: dict[OffloadKey, Rank] = {}
        self.evictable: set[OffloadKey] = set()
        self.next_rank = 0
        self.generation = 0

    def _fresh_rank(self) -> Rank:
        self.next_rank += 1
        return self.next_rank, 0

    def _request_rank(self, ctx: RequestContext) -> int:
        """The request's shared rank, drawn from the counter once per generation. O(1)."""
        if ctx.lru_rank is None or ctx.lru_rank[0] != self.generation:
            self.next_rank += 1
            ctx.lru_rank = (self.generation, self.next_rank)
        return ctx.lru_rank[1]

    def _refresh(self, keys: list[OffloadKey]) -> None:
        """Each resident key, in list order, becomes the most recent. O(k)."""
        for key in keys:
            if key in self.chunks:
                self.ranks[key] = self._fresh_rank()

    def get(self, key: OffloadKey) -> Chunk | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: Chunk, ctx: RequestContext) -> None:
        """A new chunk: ranked ``(request rank, -position)`` when the request declared the
        key's position, else most recent. A new chunk is being stored, so not evictable (vLLM's
        insert would add a chunk inserted ready; the manager never inserts one). O(1)."""
        self.chunks[key] = chunk
        position = ctx.positions.get(key)
        self.ranks[key] = self._fresh_rank() if position is None else (self._request_rank(ctx), -position)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: list[OffloadKey], ctx: RequestContext) -> None:
        """The keys become most recent, the first one last (it ends up the most recent). O(k)."""
        self._refresh(list(reversed(keys)))

    def on_store_miss(self, keys: list[OffloadKey], ctx: RequestContext) -> None:
        """vLLM's default: a store miss is a touch (of keys not resident: no effect)."""
        self.touch(keys, ctx)

    def on_request_access(self, keys: list[OffloadKey], ctx: RequestContext) -> None:
        """First accesses by a request: a positioned resident key is raised to
        ``(request rank, -position)`` if that is above its rank. The request's rank is drawn
        even when no key qualifies. O(k)."""
        request_rank = self._request_rank(ctx)
        for key in keys:
            position = ctx.positions.get(key)
            if position is None or key not in self.chunks:
                continue
            rank = (request_rank, -position)
            if self.ranks[key] < rank:
                self.ranks[key] = rank

    def on_request_finished(self, key_groups: list[list[OffloadKey]], insertion_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: RequestContext) -> None:
        """The request's keys, tail to head in prefix order, become most recent (its head the
        most recent of all). O(k log k)."""
        self._refresh(list(reversed(order_request_keys(key_groups, ctx))))

    def eviction_order(self) -> list[OffloadKey]:
        """Evictable keys, next evicted first: by ``(rank, key_bytes)``. O(E log E)."""
        return sorted(self.evictable, key=lambda k: (self.ranks[k], key_bytes(k)))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        """The first ``n`` keys of the eviction order that are not protected, removed; None
        (and nothing changed) when there are fewer. O(E log E)."""
        if n == 0:
            return []
        victims = [k for k in self.eviction_order() if k not in protected][:n]
        if len(victims) < n:
            return None
        out = []
        for key in victims:
            out.append((key, self.chunks[key]))
            self.remove(key)
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self.next_rank = 0
        self.generation += 1

    def mark_evictable(self, key: OffloadKey) -> None:
        self.evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.evictable.remove(key)

    def resident(self) -> dict[OffloadKey, Chunk]:
        return self.chunks

    def snapshot(self) -> dict[str, object]:
        return {"order": [key_text(k) for k in self.eviction_order()],
                "ranks": {key_text(k): list(r) for k, r in sorted(self.ranks.items())},
                "next_rank": self.next_rank}

    def _check(self) -> None:
        """Every resident key is ranked, the evictable ones are exactly those with
        ``ref_cnt == 0``, and no rank is above the counter."""
        assert set(self.ranks) == set(self.chunks)
        assert self.evictable == {k for k, c in self.chunks.items() if c.ref_cnt == 0}
        assert all(r[0] <= self.next_rank for r in self.ranks.values())
