"""The known-bug catalogue: variants of the model that reintroduce real bugs.

Each variant is a target like any other. It is *found* when fuzzing it violates an
invariant in its ``oracle`` (the guarantees of the policy it is a variant of, or the
property the change claimed to restore) — never by comparison with the correct
model, which an engine author without kvspec would not have. Several bugs are fixed
in vLLM 0.33.0; their variants stay as regression targets.

A variant changes one thing through the contract, never through a private method:
either its policy is a subclass of a model policy overriding ``StorePolicy`` methods
or the policy's documented public steps (``BaselinePolicy.select``, the repair rules
``record_losses``, ``protect_cached``, ``choose_victims``, ``classify_key``), or its
scheduler is a subclass of ``OffloadScheduler`` overriding methods of the target
contract (``kvspec.contract.types.OffloadTarget``) or of the scheduler's documented
policy-facing interface (``classify``, ``allocate_store``, ``ready_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from kvspec.contract.checks import check_scheduler_output
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError
from kvspec.contract.types import (
    BlockIds,
    CachedRequestData,
    ConnectorMetadata,
    KVConnectorOutput,
    RequestView,
    SchedulerOutput,
)
from kvspec.model.baseline import Selection
from kvspec.model.block_pool import BlockPool
from kvspec.model.repair import RepairPolicy
from kvspec.model.rules import ALREADY_CACHED, IN_FLIGHT, READY, window_floor
from kvspec.model.scheduler import Evicted, OffloadScheduler, PolicyFactory, StoreBatch, StoreState
from kvspec.model.signal_rescan import SignalRescanPolicy


@dataclass(frozen=True)
class Bug:
    """One variant: where the bug is from, what it does, the configuration policy it runs
    under, the invariants the fuzzer checks (None: that policy's claims), and what it changes:
    the scheduler class, the policy class (None: the registry's class for ``policy``), or both."""

    name: str
    source: str
    summary: str
    policy: str
    oracle: tuple[str, ...] | None
    scheduler: type[OffloadScheduler] = OffloadScheduler
    store_policy: PolicyFactory | None = None


# -- variants of vLLM 0.33.0 (baseline) ------------------------------------------------------


class InFlightReoffload(OffloadScheduler):
    """PR #41289 reverted: the classification does not consult the in-flight set."""

    def classify(self, gid: int) -> str:
        kind = super().classify(gid)
        if kind == IN_FLIGHT:
            key = self.gpu_pool.block_hash[gid]
            assert key is not None, "IN_FLIGHT: classify_store_candidate ranks not-hashed first"
            return ALREADY_CACHED if self.cpu_pool.get_one_block(key) is not None else READY
        return kind


class StampedUnregistered(OffloadScheduler):
    """#53498 bug 1: CPU destinations are stamped with the hash at scheduling, so the
    registration at completion returns early and the map never lists them."""

    def allocate_store(self, batch: StoreBatch, rid: str, gpu_ids: list[int]) -> None:
        start = len(batch.cpu_ids)
        super().allocate_store(batch, rid, gpu_ids)
        for g, c in zip(gpu_ids, batch.cpu_ids[start:], strict=True):
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
            self.cpu_pool.free_blocks(t.cpu_ids)
            self.gpu_pool.free_blocks(t.gpu_ids)
        self.store_event_to_blocks.clear()
        self.store_event_pending_counts.clear()
        return super().reset()


# -- variants of PR #47235 -----------------------------------------------------------------


class RelativeCursorRescan(SignalRescanPolicy):
    """PR #47235 without its absolute cursor: Phase 1a selections also advance the cursor."""

    def select(self, st: StoreState, ids_by_group: list[list[int]]) -> Selection:
        selection = super().select(st, ids_by_group)
        cursor = selection.cursors
        extra = len(selection.gpu_ids) - sum(c - s for c, s in zip(cursor, st.num_stored_blocks, strict=True))
        if extra > 0:
            cursor[0] += extra
        return selection


# -- variants of repair (each drops one rule) ------------------------------------------------


class RepairNoRecords(RepairPolicy):
    """R1 dropped: evictions are not recorded, so the cursor goes stale (the FIXME, T2)."""

    def record_losses(self, evicted: Evicted) -> None:
        return None


class RepairNoSameStepPin(RepairPolicy):
    """R5 dropped: "already cached" entries can be evicted by the same step (T3)."""

    def protect_cached(self, cb: int) -> None:
        return None


class RepairNoVictimRule(RepairPolicy):
    """R7 dropped: re-stores evict whatever the LRU head holds (thrash, H6)."""

    def choose_victims(self, n: int) -> list[int]:
        return list(islice(self.sched.cpu_pool.free_queue, n))


class RepairDedupByGpuId(RepairPolicy):
    """R4 weakened to vLLM's dedup by GPU block id: equal keys on different blocks are both
    stored (H5)."""

    def classify_key(self, gid: int) -> str:
        kind = super().classify_key(gid)
        if kind == IN_FLIGHT and gid not in self.sched.in_flight_store_gpu_blocks:
            return READY
        return kind


class RepairNoFinishFlush(RepairPolicy):
    """#41704: blocks confirmed in the final step are never stored (no finish flush)."""

    def finish_flush(self, request: RequestView, block_ids: list[list[int]]) -> None:
        return None


class RepairRecoversReferenced(RepairPolicy):
    """vLLM 0.33.0's null recovery inside repair: a position the request does not own is stored
    from any GPU block carrying its key, referenced or not (the table's, else the GPU prefix
    cache's), not only from a free one."""

    def retained_block(self, st: StoreState, ids: list[int], g: int, p: int) -> int | None:
        hashes = st.request.block_hashes
        if p >= len(hashes) or p >= len(ids):
            return None
        b = ids[p]
        if b != 0 and self.sched.gpu_pool.block_hash[b] == (hashes[p], g):
            return b
        got = self.sched.gpu_pool.get_cached_block(hashes[p], [g])
        return None if got is None else got[0]


class RepairWindowOnDrafts(RepairPolicy):
    """repair's sliding-window ownership floor on computed tokens, output placeholders included:
    under async scheduling with speculative decoding, drafts in flight push a position out of
    the window, its CPU copy's eviction makes no record, and the drafts' rejection brings the
    position back, owned and lost."""

    def owned_block(self, st: StoreState, ids: list[int], g: int, p: int) -> int | None:
        spec, r = self.sched.config.groups[g], st.request
        if spec.kind == "sliding" and p < window_floor(r.num_computed_tokens, 0, spec.sliding_window,
                                                       self.sched.block_size):
            return None
        return super().owned_block(st, ids, g, p)


class OldResume(OffloadScheduler):
    """#57816: the connector as it read a step before the fix. It ignores preemptions (the
    stale ids and cursors are kept, and the policy drops nothing), and a full table, new
    or resumed, is appended to the ids like new blocks."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        out = scheduler_output
        check_scheduler_output(out, self.num_groups, self.gpu_pool.num_blocks)
        cached = out.scheduled_cached_reqs
        tables: list[BlockIds | None] = [nr.block_ids for nr in out.scheduled_new_reqs]
        appended = CachedRequestData(req_ids=[nr.req_id for nr in out.scheduled_new_reqs] + list(cached.req_ids),
                                     new_block_ids=tables + list(cached.new_block_ids))
        meta = super().build_connector_meta(SchedulerOutput(scheduled_cached_reqs=appended,
                                                            num_scheduled_tokens=out.num_scheduled_tokens,
                                                            finished_req_ids=out.finished_req_ids))
        meta.need_flush = bool(out.preempted_req_ids)
        return meta


class UnconfirmedStores(OffloadScheduler):
    """Stores are planned from hashed blocks instead of confirmed ones (no one-step lag)."""

    def ready_blocks(self, st: StoreState, ids: list[int]) -> int:
        return min(len(ids), len(st.request.block_hashes))


BUGS: dict[str, Bug] = {b.name: b for b in [
    Bug("vllm-fixme", "vLLM 0.33.0 FIXME (T2), §10.15", "baseline itself: the stale cursor never re-stores "
        "an entry evicted below it", "baseline", ("C1",)),
    Bug("stale-cursor", "FIXME (T2) in repair", "repair without loss records", "repair", None,
        store_policy=RepairNoRecords),
    Bug("self-eviction", "T3, §10.16", "repair without the same-step pin", "repair", None,
        store_policy=RepairNoSameStepPin),
    Bug("thrash", "#47235 H6", "repair without the victim rule", "repair", None,
        store_policy=RepairNoVictimRule),
    Bug("dedup-by-gpu-id", "#47235 H5", "repair deduplicating by GPU id, not key", "repair", None,
        store_policy=RepairDedupByGpuId),
    Bug("final-step-lost", "#41704", "repair without the finish flush", "repair", None,
        store_policy=RepairNoFinishFlush),
    Bug("recover-referenced", "vLLM 0.33.0 null recovery (§7.6)", "repair storing an unowned position from "
        "a referenced GPU block under its key", "repair", None, store_policy=RepairRecoversReferenced),
    Bug("window-on-drafts", "kvspec fuzzing, speculative decoding", "repair's window floor counts "
        "unverified drafts as confirmed", "repair", None, store_policy=RepairWindowOnDrafts),
    Bug("mrv2-resume", "#57816", "preemption keeps stale ids; resumed tables are appended", "repair", None,
        scheduler=OldResume),
    Bug("unconfirmed-store", "#45704 (scheduler side)", "stores planned before the data is computed", "repair",
        None, scheduler=UnconfirmedStores),
    Bug("inflight-reoffload", "PR #41289", "in-flight GPU blocks stored again", "baseline", None,
        scheduler=InFlightReoffload),
    Bug("stamped-unregistered", "#53498", "CPU blocks stamped at scheduling are never registered", "baseline",
        None, scheduler=StampedUnregistered),
    Bug("pin-leak", "#39702 fix, retry path", "a retried lookup leaks the stale pin", "baseline", None,
        scheduler=PinLeakOnRetry),
    Bug("world-size-ignored", "§7.8", "store events complete on the first worker report", "baseline", None,
        scheduler=WorldSizeIgnored),
    Bug("reset-releases-inflight", "PRs #39723/#39725", "reset releases stores the workers still copy",
        "baseline", None, scheduler=ResetReleasesInFlight),
    Bug("pr47235-flag", "#47235 H1/H3", "one pool-wide flag, consumed by whoever is scheduled",
        "signal-rescan", ("C1",)),
    Bug("pr47235-relative-cursor", "#47235 §9.2", "Phase 1a selections advance the cursor", "signal-rescan",
        ("C1", "I9"), store_policy=RelativeCursorRescan),
]}


def make_bug_target(name: str, config: OffloadConfig) -> OffloadScheduler:
    """The variant ``name`` under ``config``, which must have the bug's policy and no lazy offload
    (``ConfigError`` otherwise, as ``kvspec fuzz`` refuses ``--target bug:X --policy Y``: a trace
    recorded under another configuration would be judged under one it never ran)."""
    bug = BUGS[name]
    if config.policy != bug.policy or config.lazy_offload:
        got = f"policy {config.policy!r}" + (" with lazy_offload" if config.lazy_offload else "")
        raise ConfigError(f"bug:{name} runs under policy {bug.policy!r} without lazy offload, "
                          f"not under {got} (the trace's configuration); pass a target of that policy")
    cfg = config
    cfg.validate()
    return bug.scheduler(cfg, BlockPool(cfg.num_gpu_blocks, "gpu", cfg.num_groups), bug.store_policy)
