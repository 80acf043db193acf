"""``kvspec.model.hit_search`` against a brute-force reading of its rules, on every small case.

The fuzzer's configurations only have windows that are whole multiples of the block size, where
``cdiv(window - 1, bs)`` and ``cdiv(window, bs)`` agree; here windows of every size are used."""

from __future__ import annotations

import itertools

import pytest

from kvspec.model.block_pool import NULL_BLOCK
from kvspec.model.hit_search import sliding_window_hit


class _Pool:
    """Position ``p`` (the hash is the position) is cached as block ``100 + p`` when ``hits[p]``."""

    def __init__(self, hits: tuple[bool, ...]) -> None:
        self.hits = hits

    def get_cached_block(self, block_hash: int, group_ids: list[int]) -> list[int] | None:
        return [100 + block_hash + 1000 * g for g in group_ids] if self.hits[block_hash] else None


def _brute(hits: tuple[bool, ...], max_blocks: int, need: int) -> list[int]:
    """The rule read literally: the rightmost run of ``need`` consecutive hits among the first
    ``max_blocks`` positions ends the hit, null placeholders before it; with no such run, the
    run of hits from position 0."""
    m = min(max_blocks, len(hits))
    for end in range(m, need - 1, -1):
        if all(hits[end - need:end]):
            return [NULL_BLOCK] * (end - need) + [100 + p for p in range(end - need, end)]
    run = 0
    while run < m and hits[run]:
        run += 1
    return [100 + p for p in range(run)]


@pytest.mark.parametrize("block_size", [1, 4])
def test_sliding_window_hit_is_the_rightmost_run_of_enough_hits(block_size: int) -> None:
    cases = 0
    for n in range(6):
        for hits in itertools.product((False, True), repeat=n):
            for window in range(2, 3 * block_size + 2):  # need = cdiv(window - 1, block_size) >= 1
                need = -(-(window - 1) // block_size)
                for max_blocks in range(n + 2):
                    got = sliding_window_hit(_Pool(hits), list(range(n)), max_blocks, [0], window, block_size)
                    assert got == [_brute(hits, max_blocks, need)], (hits, window, max_blocks)
                    cases += 1
    assert cases > 1000


def test_groups_searched_together_hit_only_where_every_group_hits() -> None:
    got = sliding_window_hit(_Pool((True, False, True, True)), [0, 1, 2, 3], 4, [0, 2], 3, 1)
    assert got == [[NULL_BLOCK, NULL_BLOCK, 102, 103], [NULL_BLOCK, NULL_BLOCK, 2102, 2103]]
