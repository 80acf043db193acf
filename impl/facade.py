"""What a re-store policy of the implementation sees of its scheduler.

``TensorOffloadScheduler`` builds its policy from ``POLICY_REGISTRY[name].impl`` and hands it
itself typed as ``SchedulerFacade``: a policy uses these members and nothing else of the
scheduler (mypy checks both sides). The policy classes implement ``ImplStorePolicy``, the
contract's ``StorePolicy`` with the implementation's batch, eviction and completion types.

The members, and why a policy needs each:

* ``config``, ``device``: the groups (kind, window), the block size, where tensors live;
* ``keys``: key ids (``key_capacity`` sizes per-key tensors) and key texts (the snapshot);
* ``gpu_pool``, ``cpu_pool``: the policy reads keys, ref counts and the prefix index, and
  on the CPU pool pins entries (``touch_t``/``free_t``), allocates and evicts the way
  vLLM's policy code does (``repair``'s re-stores choose their own victims);
* ``stores``: the per-request store state (cursors, ids, hash ids) the scan reads and
  advances;
* ``scheduled_segments``: the step's preemption reset and its requests, segment by segment,
  each segment's ids applied when the loop reaches it;
* ``scan_and_store``: the batched positional scan of vLLM with its allocations (the whole
  step for ``baseline``, with the rescan of ``[0, cursor)`` for ``signal-rescan``);
* ``batch_requests``, ``ready_blocks``: a batch's slots and request objects, and its
  confirmed blocks per group (``rules.ready_blocks``, batched);
* ``flush_candidates``, ``select_flush``: the finish flush's candidates over the live table,
  and the baseline's selection among them;
* ``start_stores``, ``mark_in_flight``, ``queue_flush``: begin stores (allocate CPU blocks,
  telling the policy what was evicted; mark the GPU blocks in flight and pin them), or only
  mark and pin blocks whose CPU side the policy took itself; queue a finish-flush transfer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias

import torch

from kvspec.contract.config import OffloadConfig
from kvspec.contract.policy import StorePolicy
from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.impl.block_pool import TensorBlockPool
from kvspec.impl.keys import KeyTable
from kvspec.impl.planner import Layout
from kvspec.impl.request_table import StoreTable
from kvspec.impl.segments import BatchRequests, ScanBatch
from kvspec.impl.transfers import Evictions, StoreBatch

ImplStorePolicy: TypeAlias = StorePolicy[StoreBatch, Evictions, torch.Tensor]
"""A policy of the implementation: steps are ``StoreBatch``es, evictions ``Evictions``, and a
completed store is told as the key ids of its blocks."""


class FlushCandidates(NamedTuple):
    """The finish flush's positions ``[cursor, ready)`` over the live table (one request)."""

    layout: Layout
    blocks: torch.Tensor  # the live table's block at each position (0: the null block)


class SchedulerFacade(Protocol):
    """The scheduler as its policy sees it (see the module docstring for why each member)."""

    @property
    def config(self) -> OffloadConfig: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def keys(self) -> KeyTable: ...

    @property
    def gpu_pool(self) -> TensorBlockPool: ...

    @property
    def cpu_pool(self) -> TensorBlockPool: ...

    @property
    def stores(self) -> StoreTable: ...

    def scheduled_segments(self, out: SchedulerOutput) -> Iterator[ScanBatch]:
        """Preemption reset now; then per segment (applied when reached) the requests to scan."""
        ...

    def scan_and_store(self, batch: ScanBatch, step: StoreBatch, rescan: bool) -> None:
        """vLLM's positional scan of the batch's requests, committed into ``step``."""
        ...

    def batch_requests(self, slots: list[int]) -> BatchRequests: ...

    def ready_blocks(self, requests: Sequence[Any], lengths: torch.Tensor) -> torch.Tensor:
        """``rules.ready_blocks`` per (request, group): ``[k, G]`` from ``[k, G]`` id counts."""
        ...

    def flush_candidates(self, slot: int, block_ids: list[list[int]]) -> FlushCandidates | None:
        """The positions a finish flush of the slot's request scans (None: none)."""
        ...

    def select_flush(self, request: RequestView, block_ids: list[list[int]]) -> torch.Tensor:
        """The baseline finish-flush scan over the live table: the GPU blocks to store."""
        ...

    def start_stores(self, gpu: torch.Tensor, step: StoreBatch | None) -> torch.Tensor:
        """Allocate CPU blocks for ``gpu`` (evictions told to the policy), mark in flight and pin,
        add the pairs to ``step`` when given; the CPU blocks."""
        ...

    def mark_in_flight(self, gpu: torch.Tensor) -> None:
        """Mark store sources in flight and pin them until their store completes."""
        ...

    def queue_flush(self, gpu: torch.Tensor, cpu: torch.Tensor) -> None:
        """A finish-flush transfer, joining the next store event."""
        ...
