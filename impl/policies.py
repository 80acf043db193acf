"""Re-store policies as strategies of ``TensorOffloadScheduler``.

* ``baseline``: vLLM 0.33.0 (the FIXME: an entry evicted below a cursor is never
  stored again); the whole step is planned by the batched planner.
* ``signal-rescan``: PR #47235 as described (§9): a pool-wide flag set by any CPU
  eviction and consumed once per planning step; when it was set every scanned request
  also rescans ``[0, min(cursor, ready))`` (default options of the model's policy).
* ``repair``: kvspec's exact loss records (``kvspec.impl.repair``).

A policy plans the eager part of a step (``plan_eager``), the finish flush
(``finish_flush``), and hears about CPU evictions, store completions, finishes and
resets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvspec.contract.errors import ConfigError
from kvspec.contract.types import RequestView, SchedulerOutput

if TYPE_CHECKING:
    from kvspec.impl.scheduler import StepBatch, TensorOffloadScheduler


class BaselinePolicy:
    name = "baseline"

    def __init__(self, sched: TensorOffloadScheduler) -> None:
        self.s = sched

    def rescan_now(self) -> bool:
        return False

    def plan_eager(self, out: SchedulerOutput, batch: StepBatch) -> None:
        s = self.s
        segs = s.eager_segments(out)
        rescan = self.rescan_now()
        for seg in segs:
            rids, slots = s.apply_segment(seg, out)
            s.plan_scan(rids, slots, batch, rescan)
        if len(segs) > 1:  # a segment lists each request once; only a repeated request can repeat
            batch.req_ids = list(dict.fromkeys(batch.req_ids))

    def finish_flush(self, request: RequestView, slot: int, block_ids: list[list[int]]) -> None:
        sel = self.s.flush_select(slot, block_ids)
        if sel.numel():
            self.s.queue_flush(sel)

    def on_evictions(self, blocks: torch.Tensor, kids: torch.Tensor) -> None:
        pass

    def on_store_completed(self, kids: torch.Tensor) -> None:
        pass

    def on_request_finished(self, rid: str) -> None:
        pass

    def on_reset(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {}


class SignalRescanPolicy(BaselinePolicy):
    name = "signal-rescan"

    def __init__(self, sched: TensorOffloadScheduler) -> None:
        super().__init__(sched)
        self.eviction_flag = False

    def rescan_now(self) -> bool:
        was, self.eviction_flag = self.eviction_flag, False
        return was

    def on_evictions(self, blocks: torch.Tensor, kids: torch.Tensor) -> None:
        self.eviction_flag = True

    def snapshot(self) -> dict[str, Any]:
        return {"eviction_flag": self.eviction_flag}


def make_policy(name: str, sched: TensorOffloadScheduler) -> Any:
    if name == "baseline":
        return BaselinePolicy(sched)
    if name == "signal-rescan":
        return SignalRescanPolicy(sched)
    if name == "repair":
        from kvspec.impl.repair import RepairPolicy

        return RepairPolicy(sched)
    raise ConfigError(f"unknown policy {name!r}")
