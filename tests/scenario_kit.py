"""Small helpers for tests that drive a model scheduler by hand (no engine).

They play the parts vLLM's own scheduler tests play by hand: a request with chained
block hashes, GPU blocks allocated and registered in the GPU prefix cache, a
hand-built ``SchedulerOutput``, and worker completions; and one engine-level scenario
(``T1_OPS``) shared by the snapshot tests.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput
from kvspec.model import make_scheduler
from kvspec.model.hashing import block_hashes
from kvspec.model.hit_search import find_longest_cache_hit
from kvspec.model.scheduler import OffloadScheduler
from kvspec.oracle.catalogue import LOCAL_INVARIANTS, check

B = 16
# Hand-written, step-by-step stories are told under synchronous scheduling (one batch at a time,
# a request runs until `finish`); random traces and the lockstep cover async scheduling too.
SYNC: dict[str, Any] = {"async_scheduling": False}


@dataclass
class Req:
    """A ``RequestView``: tokens of one family (same family, same prefix, same hashes)."""

    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    skip_reading_prefix_cache: bool = False
    block_hashes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_hashes = block_hashes(self.tokens, B)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def tokens(family: int, n: int) -> list[int]:
    return [family * 1_000_000 + i for i in range(n)]


def req(rid: str, num_blocks: int, extra: int = 1, family: int | None = None) -> Req:
    """``num_blocks`` full blocks plus ``extra`` tokens; distinct families by default."""
    fam = family if family is not None else zlib.crc32(rid.encode()) % 10_000 + 1
    return Req(rid, tokens(fam, num_blocks * B + extra))


def make(policy: str = "baseline", cpu: int = 5, gpu: int = 16, **kw: object) -> OffloadScheduler:
    return make_scheduler(OffloadConfig(num_cpu_blocks=cpu, num_gpu_blocks=gpu, policy=policy, **{**SYNC, **kw}))  # type: ignore[arg-type]


def alloc(s: OffloadScheduler, r: Req, n: int, first_pos: int = 0) -> list[int]:
    """``n`` new GPU blocks for positions ``first_pos..``; full known blocks get their key."""
    ids = s.gpu_pool.get_new_blocks(n)
    for i, b in enumerate(ids):
        p = first_pos + i
        if p < len(r.block_hashes):
            s.gpu_pool.insert_block_hash((r.block_hashes[p], 0), b)
    return ids


def out(new: list[tuple[str, list[int]]] = (), cached: list[tuple[str, list[int] | None]] = (),  # type: ignore[assignment]
        sched: dict[str, int] | None = None, preempted: set[str] | None = None,
        resumed: set[str] | None = None) -> SchedulerOutput:
    """A ``SchedulerOutput``: new requests with full tables, cached ones with new ids (or None)."""
    nrs = [NewRequestData(rid, (list(ids),)) for rid, ids in new]
    cr = CachedRequestData(
        req_ids=[rid for rid, _ in cached],
        new_block_ids=[None if ids is None else (list(ids),) for _, ids in cached],
        resumed_req_ids=set(resumed or ()),
    )
    names = [rid for rid, _ in new] + [rid for rid, _ in cached]
    return SchedulerOutput(
        scheduled_new_reqs=nrs, scheduled_cached_reqs=cr,
        num_scheduled_tokens=dict(sched) if sched is not None else dict.fromkeys(names, 1),
        preempted_req_ids=set(preempted or ()),
    )


def complete(s: OffloadScheduler, event: int) -> None:
    s.update_connector_output(KVConnectorOutput(completed_store_events={event: s.config.world_size}))


def load_done(s: OffloadScheduler, rid: str) -> None:
    s.update_connector_output(KVConnectorOutput(finished_recving={rid}))


def cpu_map(s: OffloadScheduler) -> dict[str, list[int]]:
    """CPU prefix map as {hash: [block ids]} (group 0 only)."""
    return {k[0]: ids for k, ids in s.cpu_pool.cached.items()}


def cpu_queue(s: OffloadScheduler) -> list[int]:
    return list(s.cpu_pool.free_queue)


def gpu_queue(s: OffloadScheduler) -> list[int]:
    return list(s.gpu_pool.free_queue)


def cpu_hit(s: OffloadScheduler, r: Req, local: int = 0) -> int:
    """The CPU hit (tokens) ``get_num_new_matched_tokens`` would report, without pinning."""
    max_len = r.num_tokens - 1 - local
    if max_len <= 0:
        return 0
    _, n = find_longest_cache_hit(s.cpu_pool, r.block_hashes[local // B:], max_len, s.config.groups, B)
    return n


def store_and_complete(s: OffloadScheduler, r: Req, n_blocks: int) -> list[int]:
    """Allocate ``n_blocks`` confirmed GPU blocks for ``r``, store them, complete; returns GPU ids."""
    ids = alloc(s, r, n_blocks)
    r.num_computed_tokens = n_blocks * B
    s.update_state_after_alloc(r, (list(ids),), 0)
    meta = s.build_connector_meta(out(new=[(r.request_id, ids)]))
    if meta.store_event >= 0:
        complete(s, meta.store_event)
    return ids


def assert_clean(s: OffloadScheduler) -> None:
    """The scheduler-local invariants hold on ``s``'s snapshot."""
    assert check(s.snapshot(), LOCAL_INVARIANTS) == []


# §8 T1 as engine operations, on a GPU of T1_CONFIG's size: R is stored, its GPU copy evicted,
# R2 loads it back (pins, loads and events all appear)
T1_OPS: list[dict[str, Any]] = [
    {"op": "add", "rid": "R", "family": 1, "prompt_len": 33, "max_tokens": 1},
    {"op": "step", "admit": ["R"]}, {"op": "step"}, {"op": "report", "event": 0},
    {"op": "finish", "rid": "R"},
    {"op": "add", "rid": "Q", "family": 2, "prompt_len": 33, "max_tokens": 1},
    {"op": "step", "admit": ["Q"]}, {"op": "finish", "rid": "Q"}, {"op": "step"}, {"op": "report", "event": 1},
    {"op": "add", "rid": "R2", "family": 1, "prompt_len": 33, "max_tokens": 1},
    {"op": "step", "admit": ["R2"]},
]
T1_CONFIG = {"num_gpu_blocks": 4}
