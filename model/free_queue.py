"""vLLM's ``FreeKVCacheBlockQueue``: the free blocks of a pool in eviction order.

Rule: the head is the least recently used end; ``popleft`` takes from it, so it is
also the next block to be re-allocated (and its cached entry evicted). vLLM links
blocks in a doubly-linked list with no membership check; the model keeps an
ordered dict (insertion order = queue order) and *refuses* what would corrupt
vLLM's list: inserting a block that is already queued, or unlinking one that is
not. Every operation is O(1) per block moved.
"""

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvspec.contract.errors import OutOfBlocksError, QueueCorruptionError


class FreeBlockQueue:
    """Block ids in eviction order (head first)."""

    def __init__(self, block_ids: Iterable[int] = ()) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self.append_n(list(block_ids))

    def __len__(self) -> int:
        """``num_free_blocks``. O(1)."""
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        """Membership (vLLM: both link pointers set). O(1)."""
        return block_id in self._order

    def __iter__(self) -> Iterator[int]:
        """Head to tail (vLLM ``get_all_free_blocks``). O(n)."""
        return iter(self._order)

    def popleft_n(self, n: int) -> list[int]:
        """Unlink and return the first ``n`` blocks, head first. O(n)."""
        if n > len(self._order):
            raise OutOfBlocksError(f"cannot pop {n} blocks from a free queue of {len(self._order)}")
        return [self._order.popitem(last=False)[0] for _ in range(n)]

    def remove(self, block_id: int) -> None:
        """Unlink one block from anywhere in the queue. O(1)."""
        if block_id not in self._order:
            raise QueueCorruptionError(f"block {block_id} is not in the free queue")
        del self._order[block_id]

    def append_n(self, block_ids: list[int]) -> None:
        """Link blocks at the tail in list order (``list[-1]`` becomes the last). O(len)."""
        self._refuse_queued(block_ids)
        for b in block_ids:
            self._order[b] = None

    def prepend_n(self, block_ids: list[int]) -> None:
        """Link blocks at the head in list order (``list[0]`` becomes the next popped). O(len)."""
        self._refuse_queued(block_ids)
        for b in reversed(block_ids):
            self._order[b] = None
            self._order.move_to_end(b, last=False)

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        """vLLM ``iter_blocks_after``: blocks after ``cursor`` (from the head when None).

        A cursor that is no longer queued yields nothing, as vLLM's unlinked node
        with no ``next`` pointer does. O(k) for k blocks consumed.
        """
        it = iter(list(self._order))
        if cursor is None:
            return it
        if cursor not in self._order:
            return iter(())
        for b in it:
            if b == cursor:
                break
        return it

    def _refuse_queued(self, block_ids: list[int]) -> None:
        seen: set[int] = set()
        for b in block_ids:
            if b in self._order or b in seen:
                raise QueueCorruptionError(f"block {b} would be in the free queue twice")
            seen.add(b)

    def _check(self, num_blocks: int) -> None:
        """Invariant: every queued id is a usable block id ``1..num_blocks-1`` (the null block is
        never queued); no duplicates holds by construction (dict keys). O(n)."""
        for b in self._order:
            assert isinstance(b, int) and 1 <= b < num_blocks, f"free queue holds {b!r}"
