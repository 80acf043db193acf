"""``find_longest_cache_hit``: the longest run of cached blocks a request can reuse.

Rules (vLLM §5, with one block size for all groups, so alignment = block size and
no fine-grained phase):

* **Full attention:** consecutive hits from index 0; the first miss ends the hit.
* **Sliding window:** scanning right to left, the first run of
  ``need = cdiv(window - 1, bs)`` consecutive hits ends the search; positions
  before the run are null placeholders. With no such run, only a run touching
  index 0 counts.
* **Several groups:** groups with equal specs are searched together (a hit needs
  every group's key); spec groups are visited full attention first, each keeping
  or shortening the candidate length, until nothing shrinks. Full-attention lists
  are truncated to the final length.

``pool`` is anything with ``get_cached_block(hash, group_ids) -> list[int] | None``.
Cost: O(hashes x groups) per pass; passes are bounded by the number of spec groups.
"""

from collections.abc import Sequence
from typing import Protocol, TypeVar

from kvspec.contract.config import KVGroup
from kvspec.model.block_pool import NULL_BLOCK

_Key = TypeVar("_Key")
_Key_contra = TypeVar("_Key_contra", contravariant=True)


class CachedBlockLookup(Protocol[_Key_contra]):
    """A pool keyed like ``hashes``: by block hash (``BlockPool``), or by position (the
    implementation's gathered lookups, ``kvspec.impl.hit_search``)."""

    def get_cached_block(self, block_hash: _Key_contra, group_ids: list[int]) -> list[int] | None: ...


def full_attention_hit(pool: CachedBlockLookup[_Key], hashes: Sequence[_Key], max_blocks: int,
                       gids: list[int]) -> list[list[int]]:
    """Consecutive hits from index 0, at most ``max_blocks``."""
    hits: list[list[int]] = [[] for _ in gids]
    for h in hashes[:max_blocks]:
        got = pool.get_cached_block(h, gids)
        if got is None:
            break
        for k, b in enumerate(got):
            hits[k].append(b)
    return hits


def sliding_window_hit(pool: CachedBlockLookup[_Key], hashes: Sequence[_Key], max_blocks: int,
                       gids: list[int], window: int, block_size: int) -> list[list[int]]:
    """Rightmost run of ``cdiv(window-1, bs)`` hits, null placeholders before it."""
    need = -(-(window - 1) // block_size)
    maxb = min(max_blocks, len(hashes))
    hits: list[list[int]] = [[NULL_BLOCK] * maxb for _ in gids]
    run = 0
    for i in range(maxb - 1, -1, -1):
        got = pool.get_cached_block(hashes[i], gids)
        if got is None:
            run = 0
            continue
        for k, b in enumerate(got):
            hits[k][i] = b
        run += 1
        if run >= need:
            return [h[: i + run] for h in hits]
    return [h[:run] for h in hits]


def find_longest_cache_hit(pool: CachedBlockLookup[_Key], hashes: Sequence[_Key], max_length: int,
                           groups: Sequence[KVGroup], block_size: int) -> tuple[list[list[int]], int]:
    """(blocks per group, hit length in tokens) for ``hashes`` capped at ``max_length`` tokens."""
    spec_groups: list[tuple[KVGroup, list[int]]] = []
    for gid, spec in enumerate(groups):
        for s, gids in spec_groups:
            if s == spec:
                gids.append(gid)
                break
        else:
            spec_groups.append((spec, [gid]))
    spec_groups.sort(key=lambda sg: sg[0].kind != "full")  # full attention first (stable)

    per_group: list[list[int]] = [[] for _ in groups]
    hit_len = max_length
    while True:
        cur = hit_len
        for spec, gids in spec_groups:
            max_blocks = cur // block_size
            if spec.kind == "full":
                got = full_attention_hit(pool, hashes, max_blocks, gids)
            else:
                got = sliding_window_hit(pool, hashes, max_blocks, gids, spec.sliding_window, block_size)
            for gid, blocks in zip(gids, got, strict=True):
                per_group[gid] = blocks
            cur = len(got[0]) * block_size
        if cur >= hit_len:
            break
        hit_len = cur
    hit_len = min(hit_len, cur)
    n = hit_len // block_size
    return [blocks[:n] for blocks in per_group], hit_len
