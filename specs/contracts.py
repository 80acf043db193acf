"""CrossHair contracts on the model's free queue and hit search.

``FreeBlockQueue`` is a small class and the hit-search functions take a pool object, so
their contracts are stated here, on thin pure wrappers that build the model's own
objects from plain lists and call the model's code. (The pure scan rules carry their
contracts in ``kvspec.model.rules`` itself.) ``crosshair check kvspec.specs.contracts``
searches for inputs that break a ``post:`` (tests/test_crosshair.py).
"""

from __future__ import annotations

from kvspec.model.free_queue import FreeBlockQueue
from kvspec.model.hit_search import full_attention_hit, sliding_window_hit


def queue_pop(ids: list[int], n: int) -> tuple[list[int], list[int]]:
    """``popleft_n`` takes the ``n`` oldest blocks, head first, and keeps the rest in order.

    pre: len(set(ids)) == len(ids)
    pre: 0 <= n <= len(ids)
    post: __return__ == (ids[:n], ids[n:])
    """
    q = FreeBlockQueue(ids)
    got = q.popleft_n(n)
    return got, list(q)


def queue_free(ids: list[int], fresh: list[int], cached: list[int]) -> list[int]:
    """``free_blocks``'s queue rule: fresh (unhashed) blocks go to the head in list order,
    cached ones to the tail in list order.

    pre: len(set(ids + fresh + cached)) == len(ids) + len(fresh) + len(cached)
    post: __return__ == fresh + ids + cached
    """
    q = FreeBlockQueue(ids)
    q.prepend_n(fresh)
    q.append_n(cached)
    return list(q)


def queue_remove(ids: list[int], k: int) -> list[int]:
    """``remove`` (a touch of a free block) unlinks it and keeps the others' order.

    pre: len(set(ids)) == len(ids)
    pre: 0 <= k < len(ids)
    post: __return__ == ids[:k] + ids[k + 1:]
    """
    q = FreeBlockQueue(ids)
    q.remove(ids[k])
    return list(q)


def queue_after(ids: list[int], k: int) -> list[int]:
    """``iter_after`` (the lazy cursor's walk) yields the blocks after the cursor block.

    pre: len(set(ids)) == len(ids)
    pre: 0 <= k < len(ids)
    post: __return__ == ids[k + 1:]
    """
    return list(FreeBlockQueue(ids).iter_after(ids[k]))


class _Pool:
    """A prefix cache keyed by integer hashes (the hit search is generic in its key type: no
    string conversion for the solver to reason through), one block per cached hash (block id =
    hash + 1, never null)."""

    def __init__(self, cached: list[int]) -> None:
        self.cached = cached

    def get_cached_block(self, block_hash: int, group_ids: list[int]) -> list[int] | None:
        return [block_hash + 1 for _ in group_ids] if block_hash in self.cached else None


def full_hit(cached: list[int], hashes: list[int], max_blocks: int) -> int:
    """Full attention: the hit is the longest run of cached hashes from index 0, at most
    ``max_blocks``.

    pre: all(h >= 0 for h in hashes)
    pre: max_blocks >= 0
    post: 0 <= __return__ <= min(max_blocks, len(hashes))
    post: all(h in cached for h in hashes[:__return__])
    post: __return__ == min(max_blocks, len(hashes)) or hashes[__return__] not in cached
    """
    got = full_attention_hit(_Pool(cached), hashes, max_blocks, [0])
    return len(got[0])


def _need(window: int) -> int:
    """Cached blocks a sliding-window hit needs at block size 1 (at least one)."""
    return max(window - 1, 1)


def _later_run(cached: list[int], hashes: list[int], start: int, cap: int, need: int) -> bool:
    """Some run of ``need`` cached hashes ends at a position in ``[start, cap]``."""
    return any(all(h in cached for h in hashes[e - need:e]) for e in range(max(start, need), cap + 1))


def _extends(cached: list[int], hashes: list[int], n: int, max_blocks: int) -> bool:
    """A run of ``n`` blocks could be one longer within the cap: position ``n`` is cached."""
    return n < min(max_blocks, len(hashes)) and hashes[n] in cached


def window_hit(cached: list[int], hashes: list[int], max_blocks: int, window: int) -> list[int]:
    """Sliding window (block size 1, so a hit needs ``_need(window)`` consecutive cached blocks):
    the hit ends at the end of the *rightmost* such run within the cap, with null placeholders
    before the run; with no such run, it is the run of cached blocks from index 0.

    pre: all(h >= 0 for h in hashes)
    pre: max_blocks >= 0
    pre: 1 <= window <= 4
    post: len(__return__) <= min(max_blocks, len(hashes))
    post: all(b == 0 or (hashes[i] in cached and b == hashes[i] + 1) for i, b in enumerate(__return__))
    post: all((b != 0) == (i >= len(__return__) - _need(window)) for i, b in enumerate(__return__))
    post: not _later_run(cached, hashes, len(__return__) + 1, min(max_blocks, len(hashes)), _need(window))
    post: len(__return__) >= _need(window) or not _extends(cached, hashes, len(__return__), max_blocks)
    """
    got = sliding_window_hit(_Pool(cached), hashes, max_blocks, [0], window, 1)
    return got[0]
