"""vLLM's ``BlockPool`` (GPU and CPU pools are the same class), 0.33.0 semantics.

State: block ids ``0..N-1``; block 0 is the null block, never free, never hashed,
ref count 0 forever (usable capacity N-1). Per block a ref count and an optional
hash key; a free queue in eviction order; a prefix map key -> block ids
(duplicates allowed).

Rules, each stated once:

* **Free-queue membership (I1):** a non-null block is queued iff its ref count is 0.
* **Allocation evicts:** ``get_new_blocks(n)`` pops the n blocks at the head; each
  loses its cached entry and its hash (*eviction always clears the hash*, even if
  the map no longer listed it) and gets ref count 1. Evicted (block, key) pairs are
  recorded for ``take_evicted`` (vLLM's ``BlockRemoved`` events).
* **touch** raises the ref count by one per listing; a block at 0 leaves the queue.
* **free_blocks** lowers the ref count per listing, in order; a block that reaches
  0 joins a *fresh* list (unhashed) or a *cached* list (hashed). Fresh blocks are
  then prepended (re-used first), cached ones appended (kept longest), each in
  walk order. A block listed twice reaches 0 at most once, so it is queued once.
* **Registration** (``insert_block_hash``, vLLM ``_insert_block_hash``): no-op if the
  block already has that key; otherwise the block gets the key and the map lists it.
* **reset_prefix_cache** succeeds only when no non-null block is in use.

Where vLLM would silently corrupt itself or rely on its callers, the model raises:
an id out of range, the null block in touch/free (vLLM skips it; every caller in
the modelled system filters it first), a free below ref count 0 (``DoubleFreeError``),
or ``n`` beyond the free count. Arguments of the wrong shape are refused too: ids that
are not an iterable of ints, a count that is not an int (a bool included), a key that
is not ``(block_hash: str, group: int)`` with the group below ``num_groups`` (when the
pool was given it: the configuration's number of KV groups). Every check runs before
any change (the shared checks of ``kvspec.contract``, as the implementation's pool).
"""

from collections.abc import Iterable
from typing import Any

from kvspec.contract.checks import (
    check_block_key,
    check_cached_block_query,
    check_free_counts,
    check_id_list,
    check_new_block_count,
    check_num_groups,
    name_of,
)
from kvspec.contract.errors import InvalidBlockError, InvalidCountError, echo
from kvspec.contract.snapshot import pool_section
from kvspec.model.free_queue import FreeBlockQueue
from kvspec.model.hashing import BlockKey, key_str
from kvspec.model.prefix_map import PrefixMap

NULL_BLOCK = 0


class BlockPool:
    """One pool of KV blocks: ref counts, hashes, LRU free queue, prefix map."""

    def __init__(self, num_blocks: int, name: str = "pool", num_groups: int | None = None) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise InvalidCountError(f"{name_of(name)}: num_blocks must be an int >= 1, got {echo(num_blocks)}")
        self.name = name
        self.num_blocks = num_blocks
        self.num_groups = check_num_groups(num_groups, name)  # None: group ids not bounded
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockKey | None] = [None] * num_blocks
        self.free_queue = FreeBlockQueue(range(1, num_blocks))  # block 0 is popped as the null block
        self.cached = PrefixMap()
        self._evicted: list[tuple[int, BlockKey]] = []

    # -- queries ---------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included. O(1)."""
        return len(self.free_queue)

    def get_one_block(self, key: BlockKey) -> int | None:
        """First block cached under ``key``. O(1)."""
        check_block_key(key, self.num_groups, self.name, "look up", lookup=True)
        return self.cached.get_one_block(key)

    def get_cached_block(self, block_hash: str, group_ids: list[int]) -> list[int] | None:
        """One cached block per group for ``block_hash``, or None if any group misses. O(groups)."""
        check_cached_block_query(block_hash, group_ids, self.num_groups, self.name)
        out = []
        for gid in group_ids:
            b = self.cached.get_one_block((block_hash, gid))
            if b is None:
                return None
            out.append(b)
        return out

    # -- allocation and ref counts ---------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the LRU head, evict their entries, ref 1 each. O(n)."""
        check_new_block_count(n, len(self.free_queue), self.name)
        blocks = self.free_queue.popleft_n(n)
        for b in blocks:
            self._maybe_evict_cached_block(b)
            self.ref_cnt[b] = 1
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """+1 ref per listing; a block at ref 0 leaves the free queue. O(len)."""
        ids = self._validate(block_ids, "touch")
        for b in ids:
            if self.ref_cnt[b] == 0:
                self.free_queue.remove(b)
            self.ref_cnt[b] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """-1 ref per listing, in order; zero-ref blocks: fresh to the head, cached to the tail. O(len)."""
        ids = self._validate(block_ids, "free")
        check_free_counts(ids, self.ref_cnt.__getitem__, self.name)
        fresh: list[int] = []
        cached: list[int] = []
        for b in ids:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                (fresh if self.block_hash[b] is None else cached).append(b)
        self.free_queue.prepend_n(fresh)
        self.free_queue.append_n(cached)

    # -- hashes ----------------------------------------------------------------------------

    def insert_block_hash(self, key: BlockKey, block_id: int) -> None:
        """Register ``block_id`` under ``key`` (vLLM ``_insert_block_hash``). O(1).

        A block that already carries a different key is refused: the modelled
        configurations have no secondary (fine-grained) keys.
        """
        check_block_key(key, self.num_groups, self.name, "register")
        self._validate([block_id], "register")
        current = self.block_hash[block_id]
        if current == key:
            return
        if current is not None:
            raise InvalidBlockError(
                f"{self.name}: block {block_id} already cached as {name_of(key_str(current))}, "
                f"cannot also register {name_of(key_str(key))}"
            )
        self.block_hash[block_id] = key
        self.cached.insert(key, block_id)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached entries (and hashes) of blocks, whatever their ref count. O(len)."""
        ids = self._validate(block_ids, "evict", allow_null=True)
        for b in ids:
            self._maybe_evict_cached_block(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached entry; refused (False) while any non-null block is in use. O(N)."""
        if self.num_blocks - 1 - len(self.free_queue) != 0:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def take_evicted(self) -> list[tuple[int, BlockKey]]:
        """(block, key) pairs evicted since the last call, in eviction order. O(k)."""
        out, self._evicted = self._evicted, []
        return out

    def _maybe_evict_cached_block(self, b: int) -> None:
        key = self.block_hash[b]
        self.block_hash[b] = None  # always cleared (0.33.0)
        if key is not None and self.cached.pop(key, b):
            self._evicted.append((b, key))

    def _validate(self, block_ids: Iterable[int], what: str, allow_null: bool = False) -> list[int]:
        return check_id_list(block_ids, self.num_blocks, self.name, what, allow_null)

    # -- observation -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Canonical JSON-able picture: ref counts, hashes, queue order, map (keys sorted; the
        order of a key's blocks is kept). O(N log N)."""
        return pool_section(self.num_blocks, self.ref_cnt,
                            [None if k is None else key_str(k) for k in self.block_hash],
                            self.free_queue, {key_str(k): ids for k, ids in self.cached.items_in_key_order()},
                            fresh_sorted=True)

    def _check(self) -> None:
        """Pool-local invariants (I1, I2, I3); raises AssertionError naming the block. O(N)."""
        self.free_queue._check(self.num_blocks)
        assert NULL_BLOCK not in self.free_queue and self.ref_cnt[NULL_BLOCK] == 0
        assert self.block_hash[NULL_BLOCK] is None
        for b in range(1, self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"{self.name}: block {b} ref {self.ref_cnt[b]} < 0"
            assert (b in self.free_queue) == (self.ref_cnt[b] == 0), f"{self.name}: block {b} I1"
            key = self.block_hash[b]
            if key is not None and b in self.free_queue:
                assert self.cached.contain(key, b), f"{self.name}: free hashed block {b} not in map"
        for key, ids in self.cached.items():
            for b in ids:
                assert self.block_hash[b] == key, f"{self.name}: map {key_str(key)} lists block {b}"
