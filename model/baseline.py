"""The ``baseline`` policy: vLLM 0.33.0's eager store scan, rule for rule (§7.6, §7.13).

Rules:

* **Scan:** each scheduled request is scanned from its per-group cursor up to its
  *confirmed* full blocks (tokens computed in earlier steps, ``rules.ready_blocks``). A
  position is passed for good (the cursor advances) when its block is null and not
  recoverable from the GPU prefix cache, unhashed, in flight, or already cached on CPU
  (``rules.classify_store_candidate``); otherwise it is selected. Out of CPU space stops
  the group's scan without advancing, and a group is not scanned at all once the step's
  selection fills the free count (``rules.scan_group``).
* **Stores:** the selection gets CPU blocks (possibly evicting cached entries) and is
  pinned until the store completes (``OffloadScheduler.allocate_store``).
* **The FIXME:** the cursor never looks back, and evictions are ignored: an entry evicted
  below a cursor is never stored again.
* **Finish flush (§7.13):** the same scan over the live table; the cursors are not
  written back.

``BaselinePolicy`` is also the base of the other model policies: its public methods
(``select``, ``select_group``, ``allocate``) are the steps they and the
known-bug variants override.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.model.block_pool import NULL_BLOCK
from kvspec.model.rules import scan_group
from kvspec.model.scheduler import Evicted, ModelPolicy, OffloadScheduler, StoreBatch, StoreState, Transfer


class Selection(NamedTuple):
    """What a scan of one request selects: the GPU blocks to store, and the cursor of each
    group after it (absolute)."""

    gpu_ids: list[int]
    cursors: list[int]


class GroupSelection(NamedTuple):
    """What a scan of one group selects, and how far its cursor advances."""

    gpu_ids: list[int]
    advance: int


class BaselinePolicy(ModelPolicy):
    """vLLM 0.33.0's re-store policy: the positional scan, and nothing on eviction."""

    name: ClassVar[str] = "baseline"

    def __init__(self, sched: OffloadScheduler) -> None:
        self.sched = sched

    @classmethod
    def claims(cls, config: OffloadConfig) -> tuple[str, ...]:
        """Invariant ids this policy guarantees under ``config`` (vLLM 0.33.0's own guarantees).
        Stale sliding-window ids break I8 and I10 (§10.6, H4), so they are claimed only for
        full-attention-only configurations; completeness (C1) is not claimed: the FIXME. The finish
        flush is claimed as C8 (what was on CPU nowhere is stored), not C7: the flush's own
        allocations may evict an entry of the finishing request that it found cached."""
        ids = ["I1", "I2", "I3", "I4", "I5", "I6", "I7", "I9", "I11", "I12", "I13", "I14", "I15", "C8"]
        if all(g.kind == "full" for g in config.groups):
            ids += ["I8", "I10"]
        return tuple(ids)

    # -- StorePolicy ------------------------------------------------------------------------------

    def plan_eager(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        """vLLM ``_prepare_eager_store_specs``: scan each scheduled request (``select``), store
        its selection (``allocate``), then move its cursors. O(positions scanned)."""
        for st in self.sched.scheduled_store_states(out):
            selection = self.select(st, st.block_ids)
            if selection.gpu_ids:
                self.allocate(batch, st.request.request_id, selection.gpu_ids)
            st.num_stored_blocks = selection.cursors

    def finish_flush(self, request: RequestView, block_ids: list[list[int]]) -> None:
        """vLLM ``_queue_finished_eager_store``: the scan over the live table; its selection gets
        CPU blocks now, is pinned in flight and queued; the cursors are not written back.
        O(positions scanned)."""
        st = self.sched.store_state(request.request_id)
        assert st is not None, "finish_flush is called for requests with store state only"
        selected = self.select(st, block_ids).gpu_ids
        if selected:
            cpu_ids = self.sched.allocate_cpu(len(selected))
            self.sched.mark_in_flight(selected)
            self.sched.queue_flush(Transfer(selected, cpu_ids))

    def on_cpu_evictions(self, evicted: Evicted) -> None:
        """The FIXME: evictions are not looked at."""

    def on_store_completed(self, completed: Transfer) -> None:
        """Nothing to do: the scheduler registered the copies."""

    def on_request_finished(self, rid: str) -> None:
        """No policy state per request."""

    def on_reset(self) -> None:
        """No policy state to forget."""

    def snapshot(self) -> dict[str, Any]:
        """No policy state: empty."""
        return {}

    # -- the steps ----------------------------------------------------------------------------

    def select(self, st: StoreState, ids_by_group: list[list[int]]) -> Selection:
        """vLLM ``_select_eager_blocks_to_store``: the groups in order, each scanned by
        ``select_group`` from its cursor with the CPU free count read once; a group is not
        scanned once the selection fills that count. O(positions scanned)."""
        selected: list[int] = []
        cursors = list(st.num_stored_blocks)
        free = self.sched.cpu_pool.get_num_free_blocks()
        for g, ids in enumerate(ids_by_group):
            if len(selected) >= free:
                break
            group = self.select_group(st, g, ids, len(selected), free)
            selected += group.gpu_ids
            cursors[g] += group.advance
        return Selection(selected, cursors)

    def select_group(self, st: StoreState, g: int, ids: list[int], taken: int, free: int) -> GroupSelection:
        """``rules.scan_group`` over ``[cursor, ready)`` of group ``g``, a position READY when its
        store source is (``OffloadScheduler.ready_sources``). O(ready - cursor)."""
        positions = range(st.num_stored_blocks[g], self.sched.ready_blocks(st, ids))
        sources = self.sched.ready_sources(st, g, ids, positions)
        scan = scan_group([gid != NULL_BLOCK for gid in sources], taken, free)
        return GroupSelection([sources[k] for k in scan.picked], scan.advance)

    def allocate(self, batch: StoreBatch, rid: str, gpu_ids: list[int]) -> None:
        """Store ``gpu_ids`` for ``rid`` in this step's batch (``OffloadScheduler.allocate_store``)."""
        self.sched.allocate_store(batch, rid, gpu_ids)
