"""``find_longest_cache_hit`` over one batched lookup.

The caller looks up every (group, position) key of the request's remaining hashes in one
gather (``firsts[g][i]``: the first cached block, -1 on a miss). The search rules over
those results (full attention, sliding window, the hybrid fixed point; vLLM §5) are the
model's own ``kvspec.model.hit_search``, run on positions instead of hashes: the batched
gather is what the implementation adds, the rule lives in one place.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.contract.config import KVGroup
from kvspec.model.hit_search import find_longest_cache_hit


class _GatheredLookup:
    """``get_cached_block`` answered from the gathered ``firsts`` table, keyed by position."""

    def __init__(self, firsts: list[list[int]]) -> None:
        self.firsts = firsts

    def get_cached_block(self, position: int, group_ids: list[int]) -> list[int] | None:
        got = [self.firsts[g][position] for g in group_ids]
        return None if min(got) < 0 else got


def longest_hit(firsts: list[list[int]], groups: Sequence[KVGroup], max_length: int,
                block_size: int) -> tuple[list[list[int]], int]:
    """(blocks per group, hit length in tokens) from the gathered lookups."""
    positions = range(len(firsts[0]) if firsts else 0)
    return find_longest_cache_hit(_GatheredLookup(firsts), positions, max_length, groups, block_size)
