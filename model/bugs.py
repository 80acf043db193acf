"""The known-bug catalogue: variants of the model that reintroduce real bugs.

Each variant is a target like any other. It is *found* when fuzzing it violates an
invariant in its ``oracle`` (the guarantees of the policy it is a variant of, or the
property the change claimed to restore) — never by comparison with the correct
model, which an engine author without kvspec would not have. Several bugs are fixed
in vLLM 0.33.0; their variants stay as regression targets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import KVConnectorOutput, RequestView, SchedulerOutput
from kvspec.model.block_pool import BlockPool
from kvspec.model.hashing import BlockKey
from kvspec.model.repair import RepairScheduler
from kvspec.model.scheduler import IN_FLIGHT, OffloadScheduler, StoreBatch, StoreState
from kvspec.model.signal_rescan import SignalRescanScheduler


@dataclass(frozen=True)
class Bug:
    name: str
    source: str  # where the bug is from
    summary: str
    policy: str  # the configuration policy the variant runs under
    cls: Callable[[OffloadConfig, BlockPool], OffloadScheduler]
    oracle: tuple[str, ...] | None  # invariant ids the fuzzer checks; None: the policy's claims


# -- variants of vLLM 0.33.0 (baseline) ------------------------------------------------------


class InFlightReoffload(OffloadScheduler):
    """PR #41289 reverted: the scan does not consult the in-flight set."""

    def _classify(self, gid: int) -> str:
        kind = super()._classify(gid)
        if kind == IN_FLIGHT:
            key = self.gpu_pool.block_hash[gid]
            assert key is not None, "IN_FLIGHT: classify_store_candidate ranks not-hashed first"
            return "already_cached" if self.cpu_pool.get_one_block(key) is not None else "ready"
        return kind


class StampedUnregistered(OffloadScheduler):
    """#53498 bug 1: CPU destinations are stamped with the hash at scheduling, so the
    registration at completion returns early and the map never lists them."""

    def _allocate_store(self, batch: StoreBatch, rid: str | None, selected: list[int]) -> None:
        start = len(batch.cpu_ids)
        super()._allocate_store(batch, rid, selected)
        for g, c in zip(selected, batch.cpu_ids[start:], strict=True):
            self.cpu_pool.block_hash[c] = self.gpu_pool.block_hash[g]


class PinLeakOnRetry(OffloadScheduler):
    """A new lookup forgets (instead of releasing) the stale Phase-A pin of an earlier attempt."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        self.pending_cpu_hits.pop(request.request_id, None)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class WorldSizeIgnored(OffloadScheduler):
    """Store events complete on the first worker report, whatever the world size."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = connector_output.completed_store_events
        connector_output.completed_store_events = {e: self.config.world_size for e in events}
        try:
            super().update_connector_output(connector_output)
        finally:
            connector_output.completed_store_events = events


class ResetReleasesInFlight(OffloadScheduler):
    """The first reset_cache (PRs #39723/#39725): in-flight stores are released at reset
    instead of abandoned, although the workers are still copying."""

    def reset(self) -> bool:
        for t in self.store_event_to_blocks.values():
            self._release_transfer_refs(t)
        self.store_event_to_blocks.clear()
        self.store_event_pending_counts.clear()
        return super().reset()


# -- variants of PR #47235 -----------------------------------------------------------------


class RelativeCursorRescan(SignalRescanScheduler):
    """PR #47235 without its absolute cursor: Phase 1a selections also advance the cursor."""

    def _select(self, st: StoreState, ids_by_group: list[list[int]], rescan: bool) -> tuple[list[int], list[int]]:
        selected, cursor = super()._select(st, ids_by_group, rescan)
        extra = len(selected) - sum(c - s for c, s in zip(cursor, st.num_stored_blocks, strict=True))
        if extra > 0:
            cursor[0] += extra
        return selected, cursor


# -- variants of repair (each drops one rule) ------------------------------------------------


class RepairNoRecords(RepairScheduler):
    """R1 dropped: evictions are not recorded, so the cursor goes stale (the FIXME, T2)."""

    def _record_losses(self, evicted: list[tuple[int, BlockKey]]) -> None:
        return None


class RepairNoSameStepPin(RepairScheduler):
    """R5 dropped: "already cached" entries can be evicted by the same step (T3)."""

    def _protect_cached(self, cb: int) -> None:
        return None


class RepairNoVictimRule(RepairScheduler):
    """R7 dropped: re-stores evict whatever the LRU head holds (thrash, H6)."""

    def _choose_victims(self, n: int) -> list[int]:
        return list(islice(self.cpu_pool.free_queue, n))


class RepairDedupByGpuId(RepairScheduler):
    """R4 weakened to vLLM's dedup by GPU block id: equal keys on different blocks are both
    stored (H5)."""

    def _classify_key(self, gid: int) -> str:
        kind = super()._classify_key(gid)
        if kind == IN_FLIGHT and gid not in self.in_flight_store_gpu_blocks:
            return "ready"
        return kind


class RepairNoFinishFlush(RepairScheduler):
    """#41704: blocks confirmed in the final step are never stored (no finish flush)."""

    def _queue_finished_eager_store(self, request: RequestView, block_ids: list[list[int]]) -> None:
        return None


class RepairOldResume(RepairScheduler):
    """#57816: preemption keeps the stale ids and cursors, a resumed full table is appended."""

    def _reset_after_preemption(self, st: StoreState) -> None:
        return None

    def _replace_for_full_table(self, st: StoreState) -> None:
        return None

    def _plan_before_scan(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        super()._plan_before_scan(SchedulerOutput(), batch)


class RepairUnconfirmed(RepairScheduler):
    """Stores are planned from hashed blocks instead of confirmed ones (no one-step lag)."""

    def _ready_blocks(self, st: StoreState, ids: list[int]) -> int:
        return min(len(ids), len(st.request.block_hashes))


BUGS: dict[str, Bug] = {b.name: b for b in [
    Bug("vllm-fixme", "vLLM 0.33.0 FIXME (T2), §10.15", "baseline itself: the stale cursor never re-stores "
        "an entry evicted below it", "baseline", OffloadScheduler, ("C1",)),
    Bug("stale-cursor", "FIXME (T2) in repair", "repair without loss records", "repair", RepairNoRecords,
        None),
    Bug("self-eviction", "T3, §10.16", "repair without the same-step pin", "repair", RepairNoSameStepPin,
        None),
    Bug("thrash", "#47235 H6", "repair without the victim rule", "repair", RepairNoVictimRule,
        None),
    Bug("dedup-by-gpu-id", "#47235 H5", "repair deduplicating by GPU id, not key", "repair",
        RepairDedupByGpuId, None),
    Bug("final-step-lost", "#41704", "repair without the finish flush", "repair", RepairNoFinishFlush,
        None),
    Bug("mrv2-resume", "#57816", "preemption keeps stale ids; resumed tables are appended", "repair",
        RepairOldResume, None),
    Bug("unconfirmed-store", "#45704 (scheduler side)", "stores planned before the data is computed", "repair",
        RepairUnconfirmed, None),
    Bug("inflight-reoffload", "PR #41289", "in-flight GPU blocks stored again", "baseline", InFlightReoffload,
        None),
    Bug("stamped-unregistered", "#53498", "CPU blocks stamped at scheduling are never registered", "baseline",
        StampedUnregistered, None),
    Bug("pin-leak", "#39702 fix, retry path", "a retried lookup leaks the stale pin", "baseline", PinLeakOnRetry,
        None),
    Bug("world-size-ignored", "§7.8", "store events complete on the first worker report", "baseline",
        WorldSizeIgnored, None),
    Bug("reset-releases-inflight", "PRs #39723/#39725", "reset releases stores the workers still copy",
        "baseline", ResetReleasesInFlight, None),
    Bug("pr47235-flag", "#47235 H1/H3", "one pool-wide flag, consumed by whoever is scheduled",
        "signal-rescan", SignalRescanScheduler, ("C1",)),
    Bug("pr47235-relative-cursor", "#47235 §9.2", "Phase 1a selections advance the cursor", "signal-rescan",
        RelativeCursorRescan, ("C1", "I9")),
]}


def make_bug_target(name: str, config: OffloadConfig) -> OffloadScheduler:
    """The variant ``name`` under ``config`` (its policy field is set to the bug's policy)."""
    from dataclasses import replace

    bug = BUGS[name]
    cfg = replace(config, policy=bug.policy, lazy_offload=False)
    cfg.validate()
    return bug.cls(cfg, BlockPool(cfg.num_gpu_blocks, "gpu", cfg.num_groups))
