"""vLLM-shaped inputs and outputs and the target Protocol.

Everything a target (the model, the implementation, a policy, a bug variant, real vLLM behind
an adapter, an engine author's own code) must offer lives here, once. The dataclasses are small
stand-ins for vLLM's objects with vLLM's field names.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvspec.contract.config import OffloadConfig

_T_co = TypeVar("_T_co", covariant=True)


# -- vLLM-shaped inputs ----------------------------------------------------------------------


class RequestView(Protocol):
    """What the offload manager reads of a ``vllm.v1.request.Request``."""

    request_id: str
    block_hashes: list[str]
    num_computed_tokens: int
    num_output_placeholders: int
    skip_reading_prefix_cache: bool

    @property
    def num_tokens(self) -> int: ...


BlockIds = tuple[list[int], ...]  # one list of GPU block ids per KV group


@dataclass
class NewRequestData:
    req_id: str
    block_ids: BlockIds


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # draft tokens per request


def yield_req_data(out: SchedulerOutput) -> Iterator[tuple[str, BlockIds | None, bool]]:
    """vLLM ``yield_req_data``: (req_id, block ids or None, is_full_table), new requests first."""
    for nr in out.scheduled_new_reqs:
        yield nr.req_id, nr.block_ids, True
    cr = out.scheduled_cached_reqs
    for rid, ids in zip(cr.req_ids, cr.new_block_ids, strict=True):
        yield rid, ids, rid in cr.resumed_req_ids


@dataclass
class KVConnectorOutput:
    """Worker reports: load completions by request, store completions by event (counts summed over ranks)."""

    finished_recving: set[str] = field(default_factory=set)
    completed_store_events: dict[int, int] = field(default_factory=dict)


@dataclass
class ConnectorMetadata:
    """vLLM ``SimpleCPUOffloadMetadata``: what the workers are told to copy this step."""

    load_event: int = -1
    load_gpu_blocks: list[int] = field(default_factory=list)
    load_cpu_blocks: list[int] = field(default_factory=list)
    load_event_to_reqs: dict[int, list[str]] = field(default_factory=dict)
    store_event: int = -1
    store_gpu_blocks: list[int] = field(default_factory=list)
    store_cpu_blocks: list[int] = field(default_factory=list)
    need_flush: bool = False


# -- the target Protocol ---------------------------------------------------------------------


class BlockIndexed(Protocol[_T_co]):
    """A read-only per-block table: indexed by block id (a list, or a view of vLLM's blocks)."""

    def __getitem__(self, block_id: int, /) -> _T_co: ...
    def __len__(self) -> int: ...


@runtime_checkable
class GpuPool(Protocol):
    """The GPU ``BlockPool`` operations the engine model uses (ids, not block objects)."""

    num_blocks: int

    @property
    def ref_cnt(self) -> BlockIndexed[int]:
        """Per block id: how many holders it has (the engine reads it at admission)."""
        ...

    @property
    def block_hash(self) -> BlockIndexed[tuple[str, int] | None]:
        """Per block id: its ``(hash, group)`` key, or None (read at schedule time and for C7)."""
        ...

    def get_num_free_blocks(self) -> int: ...
    def get_new_blocks(self, n: int) -> list[int]: ...
    def touch(self, block_ids: Sequence[int]) -> None: ...
    def free_blocks(self, block_ids: Sequence[int]) -> None: ...
    def insert_block_hash(self, key: tuple[str, int], block_id: int) -> None: ...
    def get_cached_block(self, block_hash: str, group_ids: list[int]) -> list[int] | None: ...
    def reset_prefix_cache(self) -> bool: ...


@runtime_checkable
class OffloadTarget(Protocol):
    """A scheduler-side CPU offload manager bound to a GPU pool, vLLM's method names.

    The model, the implementation, every policy and bug variant, and real vLLM (through
    ``kvspec.adapters.vllm``) implement it; the engine model drives any of them.
    """

    # Read-only members, so that a target may declare its own pool class (a subtype of GpuPool).
    @property
    def config(self) -> OffloadConfig: ...
    @property
    def gpu_pool(self) -> GpuPool: ...

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]: ...
    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None: ...
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata: ...
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None: ...
    def request_finished_all_groups(self, request: RequestView, block_ids: BlockIds) -> tuple[bool, None]: ...
    def reset(self) -> bool: ...
    def has_pending_stores(self) -> bool: ...
    def snapshot(self) -> dict[str, Any]:
        """Pools and scheduler state in the canonical format (``kvspec.contract.snapshot``)."""
        ...

