"""vLLM's ``BlockHashToBlockMap`` (``cached_block_hash_to_block``).

Rule: a key maps to one or more block ids, in insertion order; duplicates (two
blocks cached under one key) are allowed. ``get_one_block`` returns the first.
A key whose last block is popped disappears. Every operation is O(1).
"""

from collections.abc import Iterator

from kvspec.model.hashing import BlockKey


class PrefixMap:
    def __init__(self) -> None:
        self._map: dict[BlockKey, dict[int, None]] = {}

    def __len__(self) -> int:
        """Number of keys. O(1)."""
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def get_one_block(self, key: BlockKey) -> int | None:
        """First block cached under ``key``, or None. O(1)."""
        entry = self._map.get(key)
        return None if entry is None else next(iter(entry))

    def contain(self, key: BlockKey, block_id: int) -> bool:
        """True iff ``key`` maps to ``block_id``. O(1)."""
        return block_id in self._map.get(key, ())

    def insert(self, key: BlockKey, block_id: int) -> None:
        """Add ``block_id`` under ``key`` (after any blocks already there). O(1)."""
        self._map.setdefault(key, {})[block_id] = None

    def pop(self, key: BlockKey, block_id: int) -> bool:
        """Remove ``block_id`` from ``key``; True iff it was there. O(1)."""
        entry = self._map.get(key)
        if entry is None or block_id not in entry:
            return False
        del entry[block_id]
        if not entry:
            del self._map[key]
        return True

    def items(self) -> Iterator[tuple[BlockKey, list[int]]]:
        for key, entry in self._map.items():
            yield key, list(entry)

    def items_in_key_order(self) -> list[tuple[BlockKey, list[int]]]:
        """(key, blocks) sorted by key: by hash, then by group. O(K log K)."""
        return [(key, list(entry)) for key, entry in sorted(self._map.items())]

    def clear(self) -> None:
        self._map.clear()
