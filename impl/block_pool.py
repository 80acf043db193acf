"""A block pool on tensors: vLLM's ``BlockPool`` with batched operations.

Per block an int64 ref count and an int64 key id (-1 = unhashed); the free queue is a
``FreeList`` and the prefix map a ``PrefixIndex``. Block 0 is the null block: never
queued, never hashed, ref count 0.

Two faces:

* the **batch face** (``alloc``, ``touch_t``, ``free_t``, ``register_many``,
  ``first_of``) takes and returns int64 tensors and is what the scheduler plans with;
  it trusts its caller (ids valid, counts available);
* the **pool face** (``get_new_blocks``, ``touch``, ``free_blocks``,
  ``insert_block_hash``, ``get_cached_block``, ``reset_prefix_cache``, plus the
  ``ref_cnt``/``block_hash``/``free_queue`` views) speaks lists and key tuples, checks
  its input exactly as the model's ``BlockPool`` does, with the same shared checks of
  ``kvspec.contract`` (same ``KVSpecError`` subclasses, nothing changed on error; a
  key's group must be below the key table's number of groups) and then calls the batch
  face. The engine model and the harnesses drive a GPU pool through it.

Rules (vLLM 0.33.0): allocation pops the head and evicts (clears) each block's key;
touch takes ref-0 blocks out of the queue; free lowers refs per listing and queues
the blocks that reach 0, unhashed ones at the head and hashed ones at the tail, each
in the order they reached 0; ``reset_prefix_cache`` needs every non-null block free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from kvspec.contract.checks import (
    check_block_key,
    check_cached_block_query,
    check_free_counts,
    check_id_list,
    check_new_block_count,
    name_of,
)
from kvspec.contract.errors import InvalidBlockError, InvalidCountError, echo
from kvspec.contract.snapshot import pool_section
from kvspec.impl.convert import int_tensor
from kvspec.impl.free_list import FreeList
from kvspec.impl.keys import BlockKey, KeyTable
from kvspec.impl.prefix_index import PrefixIndex

NULL_BLOCK = 0


class TensorBlockPool:
    def __init__(self, num_blocks: int, name: str, keys: KeyTable, device: torch.device) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise InvalidCountError(f"{name_of(name)}: num_blocks must be an int >= 1, got {echo(num_blocks)}")
        self.name = name
        self.num_blocks = num_blocks
        self.keys = keys
        self.device = device
        self.ref = torch.zeros(num_blocks, dtype=torch.int64, device=device)
        self.mark = torch.zeros(num_blocks, dtype=torch.int32, device=device)  # scratch of ``distinct``
        self.key = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.free = FreeList(num_blocks, torch.arange(1, num_blocks, dtype=torch.int64, device=device), device)
        self.index = PrefixIndex(num_blocks, self.key, device)
        self.on_register: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.on_alloc: Callable[[torch.Tensor], None] | None = None
        self._evicted: list[tuple[int, BlockKey]] = []
        self.record_evictions = True

    # == batch face =================================================================================

    def empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def as_ids(self, ids: Iterable[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            return ids.to(dtype=torch.int64, device=self.device)
        return int_tensor(list(ids), self.device)

    def first_of(self, kids: torch.Tensor) -> torch.Tensor:
        return self.index.first_of(kids)

    def alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pop ``n`` head blocks (ref 1, key cleared): (blocks, evicted blocks, their keys)."""
        blocks = self.free.pop_head(n)
        ev_b, ev_k = self.evict_t(blocks)
        self.ref[blocks] = 1
        if self.on_alloc is not None:
            self.on_alloc(blocks)
        return blocks, ev_b, ev_k

    def evict_t(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clear the keys of the hashed blocks among distinct ``ids`` and unlist them from the
        prefix index: (evicted blocks, their keys), in order. O(len)."""
        kids = self.key[ids]
        hashed = kids >= 0
        if not bool(hashed.any()):
            return ids[:0], ids[:0]
        ev_b, ev_k = ids[hashed], kids[hashed]
        self.index.remove_many(ev_b, ev_k)
        self.key[ev_b] = -1
        if self.record_evictions:
            self._evicted.extend(zip(ev_b.tolist(), map(self.keys.key, ev_k.tolist()), strict=True))
        return ev_b, ev_k

    def touch_t(self, ids: torch.Tensor) -> None:
        """+1 per listing; blocks at ref 0 leave the free queue."""
        if ids.numel() == 0:
            return
        at_zero = self.ref[ids] == 0
        if bool(at_zero.any()):
            zero = ids[at_zero]
            self.free.remove(torch.unique(zero) if zero.numel() > 1 else zero)
        self.ref.index_add_(0, ids, torch.ones_like(ids))

    def distinct(self, ids: torch.Tensor) -> bool:
        """Whether no block is listed twice in ``ids``: each position writes its index into a
        scratch column and reads it back (a repeated block reads another position's). O(len)."""
        pos = torch.arange(ids.numel(), dtype=torch.int32, device=self.device)
        self.mark[ids] = pos
        return bool(torch.equal(self.mark.index_select(0, ids), pos))

    def free_t(self, ids: torch.Tensor) -> None:
        """-1 per listing; blocks reaching 0 are queued (unhashed at the head, hashed at the
        tail), in the order of their last listing. Distinct ``ids`` (the usual case) take a
        path without the sort that groups repeated listings."""
        n = ids.numel()
        if n == 0:
            return
        if n == 1 or self.distinct(ids):
            left = self.ref.index_select(0, ids) - 1
            self.ref[ids] = left
            zero = left == 0
            if n == 1 and not bool(zero[0]):
                return
            zb = torch.masked_select(ids, zero)
            if zb.numel() == 0:
                return
        else:
            uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            left = self.ref[uniq] - counts
            self.ref[uniq] = left
            zero = left == 0
            if not bool(zero.any()):
                return
            last = torch.full_like(uniq, -1).scatter_reduce_(
                0, inverse, torch.arange(n, device=self.device), reduce="amax")
            zb = uniq[zero]
            zb = zb[torch.argsort(last[zero])]
        hashed = self.key.index_select(0, zb) >= 0
        self.free.prepend(zb[~hashed])
        self.free.append(zb[hashed])

    def register_many(self, kids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Give distinct unhashed ``blocks`` their keys and list them (in order)."""
        if blocks.numel() == 0:
            return
        self.key[blocks] = kids
        self.index.insert_many(kids, blocks)
        if self.on_register is not None:
            self.on_register(kids, blocks)

    def num_used(self) -> int:
        return self.num_blocks - 1 - self.free.count

    # == pool face (model-compatible, validated) ========================================================

    def get_num_free_blocks(self) -> int:
        return self.free.count

    @property
    def num_groups(self) -> int:
        """Group ids of keys are ``0..num_groups-1`` (the key table's, the configuration's)."""
        return self.keys.num_groups

    def get_one_block(self, key: BlockKey) -> int | None:
        check_block_key(key, self.keys.num_groups, self.name, "look up", lookup=True)
        b = self.index.get_one(self.keys.known_key_id(key))
        return None if b < 0 else b

    def get_cached_block(self, block_hash: str, group_ids: list[int]) -> list[int] | None:
        check_cached_block_query(block_hash, group_ids, self.keys.num_groups, self.name)
        out = []
        for gid in group_ids:
            b = self.index.get_one(self.keys.known_key_id((block_hash, gid)))
            if b < 0:
                return None
            out.append(b)
        return out

    def get_new_blocks(self, n: int) -> list[int]:
        check_new_block_count(n, self.free.count, self.name)
        return self.alloc(n)[0].tolist()

    def touch(self, block_ids: Iterable[int]) -> None:
        ids = self._validate(block_ids, "touch")
        self.touch_t(self.as_ids(ids))

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        ids = self._validate(block_ids, "free")
        if not ids:
            return
        t = self.as_ids(ids)
        uniq, counts = torch.unique(t, return_counts=True)
        over = counts > self.ref[uniq]
        if bool(over.any()):
            check_free_counts(ids, lambda b: int(self.ref[b]), self.name)
        self.free_t(t)

    def insert_block_hash(self, key: BlockKey, block_id: int) -> None:
        check_block_key(key, self.keys.num_groups, self.name, "register")
        self._validate([block_id], "register")
        current = int(self.key[block_id])
        kid = self.keys.known_key_id(key)
        if current >= 0 and current == kid:
            return
        if current >= 0:
            raise InvalidBlockError(
                f"{self.name}: block {block_id} already cached as {name_of(self.keys.key_text(current))}, "
                f"cannot also register {name_of(f'{key[0]}:{key[1]}')}"
            )
        kid = self.keys.key_id(key)
        self.key[block_id] = kid
        self.index.insert(kid, block_id)
        if self.on_register is not None:
            b = int_tensor([block_id], self.device)
            self.on_register(int_tensor([kid], self.device), b)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        ids = self._validate(block_ids, "evict", allow_null=True)
        for b in ids:
            kid = int(self.key[b])
            if kid >= 0:
                self.index.remove(b, kid)
                self.key[b] = -1
                self._evicted.append((b, self.keys.key(kid)))

    def reset_prefix_cache(self) -> bool:
        if self.num_used() != 0:
            return False
        self.index.clear()
        self.key.fill_(-1)
        return True

    def take_evicted(self) -> list[tuple[int, BlockKey]]:
        out, self._evicted = self._evicted, []
        return out

    def _validate(self, block_ids: Iterable[Any], what: str, allow_null: bool = False) -> list[int]:
        return check_id_list(block_ids, self.num_blocks, self.name, what, allow_null)

    def _check(self) -> None:
        """The free list's and the prefix index's own invariants, then the pool's: ref counts are
        >= 0; the null block is free, unhashed and never queued; a block is queued iff its ref
        count is 0 (I1); the index shares the pool's key tensor; key ids were handed out.
        O(blocks + key ids)."""
        self.free._check()
        self.index._check()
        assert self.index.block_key is self.key, f"{self.name}: the prefix index reads another key tensor"
        ref, key, pos = self.ref.tolist(), self.key.tolist(), self.free.position.tolist()
        assert ref[NULL_BLOCK] == 0 and key[NULL_BLOCK] == -1, f"{self.name}: null block used"
        assert pos[NULL_BLOCK] < 0, f"{self.name}: the null block is queued"
        for b in range(1, self.num_blocks):
            assert ref[b] >= 0, f"{self.name}: block {b} ref {ref[b]} < 0"
            assert (pos[b] >= 0) == (ref[b] == 0), f"{self.name}: block {b} is queued iff its ref is 0 (I1)"
        assert max(key) < max(self.keys.key_capacity, 1), f"{self.name}: key id never handed out"

    # -- views the engine reads ----------------------------------------------------------------------

    @property
    def ref_cnt(self) -> _RefView:
        return _RefView(self)

    @property
    def block_hash(self) -> _HashView:
        return _HashView(self)

    @property
    def free_queue(self) -> _QueueView:
        return _QueueView(self)

    # -- observation -----------------------------------------------------------------------------------

    def key_texts(self, kids: list[int]) -> list[str | None]:
        text = self.keys.key_text
        return [None if k < 0 else text(k) for k in kids]

    def snapshot(self) -> dict[str, Any]:
        text = self.keys.key_text
        return pool_section(self.num_blocks, self.ref.tolist(), self.key_texts(self.key.tolist()),
                            self.free.order_list(), {text(k): chain for k, chain in self.index.items()})

    def memory_bytes(self) -> int:
        """Bytes of bookkeeping tensors (payloads excluded)."""
        ts = [self.ref, self.mark, self.key, self.free.ring, self.free.position, self.index.nxt, self.index.prv,
              self.index.first, self.index.last, self.index.stamp]
        return sum(t.numel() * t.element_size() for t in ts)


class _RefView:
    def __init__(self, pool: TensorBlockPool) -> None:
        self._pool = pool

    def __getitem__(self, b: int) -> int:
        return int(self._pool.ref[b])

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __iter__(self) -> Iterator[int]:
        return iter(self._pool.ref.tolist())


class _HashView:
    def __init__(self, pool: TensorBlockPool) -> None:
        self._pool = pool

    def __getitem__(self, b: int) -> BlockKey | None:
        k = int(self._pool.key[b])
        return None if k < 0 else self._pool.keys.key(k)

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __iter__(self) -> Iterator[BlockKey | None]:
        keys = self._pool.keys
        return iter([None if k < 0 else keys.key(k) for k in self._pool.key.tolist()])


class _QueueView:
    def __init__(self, pool: TensorBlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.free.count

    def __contains__(self, b: object) -> bool:
        return isinstance(b, int) and 0 <= b < self._pool.num_blocks and self._pool.free.contains(b)

    def __iter__(self) -> Iterator[int]:
        return iter(self._pool.free.order_list())

    def iter_after(self, cursor: int | None) -> Iterator[int]:
        if cursor is None:
            return iter(self)
        return iter(self._pool.free.after(cursor, self._pool.free.count).tolist())
