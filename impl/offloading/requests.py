"""Per-request records, by key id: what vLLM keeps in a ``ReqContext`` and its
``_RequestCacheAccess``.

A request's records are small and private to it (the keys one request names), so they are
Python sets of key ids; the cache's own state is in tensors. Records are stamped with the
cache generation they were made in; after ``reset_cache`` a stale record reads as absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Access:
    generation: int
    groups: dict[int, list[int]] = field(default_factory=dict)  # KV group -> key ids, first seen first
    seen: set[int] = field(default_factory=set)
    inserted: set[int] = field(default_factory=set)
    reused: set[int] = field(default_factory=set)
    store_misses: set[int] = field(default_factory=set)
    finished: bool = False


@dataclass
class Request:
    positions: dict[int, int] = field(default_factory=dict)  # key id -> end-token position
    access: Access | None = None
    lru_rank: tuple[int, int] | None = None  # (generation, the request's shared LRU rank)
    closed: bool = False
