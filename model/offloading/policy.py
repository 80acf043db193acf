"""What the two cache policies share: chunks, request contexts, and the policy interface.

vLLM 0.33.0, ``vllm/v1/kv_offload/cpu/policies/base.py``. A *chunk* is one CPU slot holding
one key's data: its ``chunk_id`` (the slot) and its ``ref_cnt``, the number of loads reading
it, or -1 while its store is in flight ("being stored": not readable, not evictable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvspec.contract.offloading import OffloadKey

STORING = -1  # ref_cnt of a chunk whose store has not completed


@dataclass
class Chunk:
    """vLLM ``ChunkStatus``. Rule: a new chunk is being stored (``ref_cnt == STORING``)."""

    chunk_id: int
    ref_cnt: int = STORING

    @property
    def is_ready(self) -> bool:
        """Readable: the store completed (``ref_cnt >= 0``)."""
        return self.ref_cnt >= 0


@dataclass
class AccessRecord:
    """vLLM ``_RequestCacheAccess``: the keys one request has touched, for its finish.

    ``key_groups`` keeps, per KV group, the keys in the order first seen; ``inserted`` the
    keys whose chunks this request allocated; ``reused`` ready keys it loaded or offered
    (never one it inserted itself); ``store_misses`` keys it offered that were not cached."""

    generation: int
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


@dataclass
class RequestContext:
    """vLLM ``ReqContext``: a request's id, the end-token position of each key the scheduler
    declared, and the per-request state the manager and the policy keep in it.

    State is stamped with the cache generation it was made in; ``reset_cache`` bumps the
    generation, so state from before a reset is stale and made anew on next use."""

    req_id: str
    positions: dict[OffloadKey, int] = field(default_factory=dict)
    access: AccessRecord | None = None
    lru_rank: tuple[int, int] | None = None  # (LRU generation, the request's shared rank)
    closed: bool = False  # on_request_finished was called: no more submit-side calls


def order_request_keys(key_groups: list[list[OffloadKey]], ctx: RequestContext) -> list[OffloadKey]:
    """vLLM ``order_request_keys``: all groups' keys concatenated, then sorted by position
    when every key has one (stable, so equal positions keep group order). O(k log k)."""
    keys = [key for group in key_groups for key in group]
    if all(key in ctx.positions for key in keys):
        keys.sort(key=ctx.positions.__getitem__)
    return keys


class CachePolicy(Protocol):
    """vLLM ``CachePolicy``: where chunks live and which one is evicted next."""

    def get(self, key: OffloadKey) -> Chunk | None: ...
    def insert(self, key: OffloadKey, chunk: Chunk, ctx: RequestContext) -> None: ...
    def remove(self, key: OffloadKey) -> None: ...
    def touch(self, keys: list[OffloadKey], ctx: RequestContext) -> None: ...
    def on_store_miss(self, keys: list[OffloadKey], ctx: RequestContext) -> None: ...
    def on_request_access(self, keys: list[OffloadKey], ctx: RequestContext) -> None: ...
    def on_request_finished(self, key_groups: list[list[OffloadKey]], insertion_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: RequestContext) -> None: ...
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None: ...
    def clear(self) -> None: ...
    def mark_evictable(self, key: OffloadKey) -> None: ...
    def mark_non_evictable(self, key: OffloadKey) -> None: ...
    def resident(self) -> dict[OffloadKey, Chunk]: ...
    def snapshot(self) -> dict[str, object]: ...
    def _check(self) -> None: ...
