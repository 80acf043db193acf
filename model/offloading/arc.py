"""vLLM's ``ARCCachePolicy`` (``vllm/v1/kv_offload/cpu/policies/arc.py``, 0.33.0).

Rules. Resident keys are in T1 (seen once) or T2 (reused), each ordered least recent first;
B1 and B2 are ghost lists of keys evicted from T1 and T2. ``target`` (vLLM
``target_t1_size``, a float in ``[0, capacity]``) is how large T1 should be:

* insert: a new chunk goes to T1's end and leaves the ghost lists;
* a miss on a ghost (a store miss, or a touch of a key not resident) adapts the target: a B1
  hit raises it by ``max(1, |B2|/|B1|)``, a B2 hit lowers it by ``max(1, |B1|/|B2|)``,
  clamped, and moves the ghost to its list's end;
* touch: a ready key in T1 moves to T2's end; a key in T1 still being stored stays in T1 (at
  its end); a T2 key moves to T2's end;
* a request's finish walks its keys tail to head: keys it only inserted move to the end of
  their list, ready keys it reused go to T2's end;
* evict ``n``: for each victim, take the first evictable unprotected key of T1 if T1's
  remaining size is ``>= int(target)``, else of T2, else of T1; nothing if ``n`` are not
  found. T1 victims go to B1's end, T2 victims to B2's; then each ghost list is trimmed from
  its front to ``capacity`` keys.

Lists are dicts in insertion order (moving a key to the end is pop and re-insert): every
rule is O(1) per key but eviction, O(|T1| + |T2|).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvspec.contract.offloading import OffloadKey, key_text
from kvspec.model.offloading.policy import Chunk, RequestContext, order_request_keys


def _to_end(d: dict[OffloadKey, Chunk] | dict[OffloadKey, None], key: OffloadKey) -> None:
    d[key] = d.pop(key)  # type: ignore[assignment]


class ARCPolicy:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target: float = 0.0
        self.t1: dict[OffloadKey, Chunk] = {}
        self.t2: dict[OffloadKey, Chunk] = {}
        self.b1: dict[OffloadKey, None] = {}
        self.b2: dict[OffloadKey, None] = {}

    def get(self, key: OffloadKey) -> Chunk | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: Chunk, ctx: RequestContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt(self, key: OffloadKey) -> None:
        """A ghost hit moves the target toward the list it came from."""
        if key in self.b1:
            self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
            _to_end(self.b1, key)
        elif key in self.b2:
            self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
            _to_end(self.b2, key)

    def on_store_miss(self, keys: list[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(keys):
            self._adapt(key)

    def on_request_access(self, keys: list[OffloadKey], ctx: RequestContext) -> None:
        """ARC learns nothing from a first access (vLLM's default hook)."""

    def touch(self, keys: list[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(keys):
            if key in self.t1:
                chunk = self.t1.pop(key)
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                _to_end(self.t2, key)
            else:
                self._adapt(key)

    def on_request_finished(self, key_groups: list[list[OffloadKey]], insertion_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(order_request_keys(key_groups, ctx)):
            if key in insertion_only:
                if key in self.t1:
                    _to_end(self.t1, key)
                elif key in self.t2:
                    _to_end(self.t2, key)
            elif key in reused and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused and key in self.t2:
                _to_end(self.t2, key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        if n == 0:
            return []

        def candidates(entries: dict[OffloadKey, Chunk]) -> Iterator[OffloadKey]:
            return (k for k, c in entries.items() if self.evictable(c) and k not in protected)

        from_t1, from_t2 = candidates(self.t1), candidates(self.t2)
        t1_size = len(self.t1)
        victims: list[tuple[OffloadKey, bool]] = []
        for _ in range(n):
            key = next(from_t1, None) if t1_size >= int(self.target) else None
            in_t1 = key is not None
            if key is None:
                key = next(from_t2, None)
            if key is None:
                key = next(from_t1, None)
                if key is None:
                    return None
                in_t1 = True
            if in_t1:
                t1_size -= 1
            victims.append((key, in_t1))
        out = []
        for key, in_t1 in victims:
            if in_t1:
                out.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                out.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            for key in list(ghost)[:max(0, len(ghost) - self.capacity)]:
                del ghost[key]
        return out

    def evictable(self, chunk: Chunk) -> bool:
        """ARC reads the ref count when it evicts: ready and unpinned (``ref_cnt == 0``)."""
        return chunk.ref_cnt == 0

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target = 0.0

    def mark_evictable(self, key: OffloadKey) -> None:
        """ARC reads ``ref_cnt`` when it evicts; nothing to mark."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """See ``mark_evictable``."""

    def resident(self) -> dict[OffloadKey, Chunk]:
        return {**self.t1, **self.t2}

    def snapshot(self) -> dict[str, object]:
        return {name: [key_text(k) for k in lst] for name, lst in
                (("t1", self.t1), ("t2", self.t2), ("b1", self.b1), ("b2", self.b2))} | {
                "target_t1_size": float(self.target)}

    def _check(self) -> None:
        """T1, T2 disjoint; ghosts disjoint from each other and from T1 and T2; each ghost
        list at most ``capacity``; ``0 <= target <= capacity``."""
        assert not set(self.t1) & set(self.t2)
        assert not set(self.b1) & set(self.b2)
        assert not (set(self.b1) | set(self.b2)) & (set(self.t1) | set(self.t2))
        assert len(self.b1) <= self.capacity and len(self.b2) <= self.capacity
        assert 0 <= self.target <= self.capacity
