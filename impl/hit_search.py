"""``find_longest_cache_hit`` over one batched lookup (vLLM §5, one block size for all groups).

The caller looks up every (group, position) key of the request's remaining hashes in
one gather (``firsts[g][i]``: the first cached block, -1 on a miss); the search then
runs on plain lists:

* full attention: the longest run of hits from position 0 (all groups of the spec);
* sliding window: scanning right to left, the first run of ``cdiv(window - 1, bs)``
  hits ends the search, earlier positions become null (0); without one only a run
  touching position 0 counts;
* spec groups (equal specs searched together) are visited full attention first, each
  keeping or shortening the candidate length, until nothing shrinks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.interfaces import KVGroup


def _full(firsts: list[list[int]], gids: list[int], max_blocks: int) -> list[list[int]]:
    n = 0
    limit = min(max_blocks, len(firsts[gids[0]]) if gids else 0)
    while n < limit and all(firsts[g][n] >= 0 for g in gids):
        n += 1
    return [firsts[g][:n] for g in gids]


def _sliding(firsts: list[list[int]], gids: list[int], max_blocks: int, need: int) -> list[list[int]]:
    maxb = min(max_blocks, len(firsts[gids[0]]))
    out = [[0] * maxb for _ in gids]
    run = 0
    for i in range(maxb - 1, -1, -1):
        if not all(firsts[g][i] >= 0 for g in gids):
            run = 0
            continue
        for k, g in enumerate(gids):
            out[k][i] = firsts[g][i]
        run += 1
        if run >= need:
            return [o[: i + run] for o in out]
    return [o[:run] for o in out]


def longest_hit(firsts: list[list[int]], groups: Sequence[KVGroup], max_length: int,
                block_size: int) -> tuple[list[list[int]], int]:
    specs: list[tuple[KVGroup, list[int]]] = []
    for gid, spec in enumerate(groups):
        for s, gids in specs:
            if s == spec:
                gids.append(gid)
                break
        else:
            specs.append((spec, [gid]))
    specs.sort(key=lambda sg: sg[0].kind != "full")
    per_group: list[list[int]] = [[] for _ in groups]
    hit_len = max_length
    while True:
        cur = hit_len
        for spec, gids in specs:
            mb = cur // block_size
            if spec.kind == "full":
                got = _full(firsts, gids, mb)
            else:
                got = _sliding(firsts, gids, mb, -(-(spec.sliding_window - 1) // block_size))
            for gid, blocks in zip(gids, got, strict=True):
                per_group[gid] = blocks
            cur = len(got[0]) * block_size
        if cur >= hit_len:
            break
        hit_len = cur
    hit_len = min(hit_len, cur)
    n = hit_len // block_size
    return [b[:n] for b in per_group], hit_len
