"""The ``baseline`` and ``signal-rescan`` policies of ``TensorOffloadScheduler``.

* ``baseline``: vLLM 0.33.0 (the FIXME: an entry evicted below a cursor is never
  stored again); the whole step is planned by the batched planner.
* ``signal-rescan``: PR #47235 as described (§9): a pool-wide flag set by any CPU
  eviction and consumed once per planning step; when it was set every scanned request
  also rescans ``[0, min(cursor, ready))`` (default options of the model's policy).

``repair`` lives in ``kvspec.impl.repair``. Each policy implements ``ImplStorePolicy`` and
sees the scheduler only through ``SchedulerFacade`` (``kvspec.impl.facade``).
"""

from __future__ import annotations

from typing import Any, final

import torch

from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.impl.facade import ImplStorePolicy, SchedulerFacade
from kvspec.impl.transfers import Evictions, StoreBatch


class BaselinePolicy(ImplStorePolicy):
    """vLLM's eager scan: no policy state."""

    name = "baseline"

    def __init__(self, host: SchedulerFacade) -> None:
        self.host = host

    def rescan_now(self) -> bool:
        """Whether this step's scan also rescans below the cursors (never, for the baseline)."""
        return False

    def plan_eager(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        rescan = self.rescan_now()
        for scan in self.host.scheduled_segments(out):
            self.host.scan_and_store(scan, batch, rescan)
        batch.req_ids = list(dict.fromkeys(batch.req_ids))  # a request listed twice is served once

    def finish_flush(self, request: RequestView, block_ids: list[list[int]]) -> None:
        selected = self.host.select_flush(request, block_ids)
        if selected.numel():
            self.host.queue_flush(selected, self.host.start_stores(selected, None))

    def on_cpu_evictions(self, evicted: Evictions) -> None:
        pass

    def on_store_completed(self, completed: torch.Tensor) -> None:
        pass

    def on_request_finished(self, rid: str) -> None:
        pass

    def on_reset(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {}


@final  # mypy then reports any StorePolicy member left unimplemented (here or in the baseline)
class SignalRescanPolicy(BaselinePolicy):
    """The baseline plus a pool-wide eviction flag that triggers one rescan step."""

    name = "signal-rescan"

    def __init__(self, host: SchedulerFacade) -> None:
        super().__init__(host)
        self.eviction_flag = False

    def rescan_now(self) -> bool:
        """Consume the flag: True once after any eviction."""
        was, self.eviction_flag = self.eviction_flag, False
        return was

    def on_cpu_evictions(self, evicted: Evictions) -> None:
        self.eviction_flag = True

    def snapshot(self) -> dict[str, Any]:
        return {"eviction_flag": self.eviction_flag}
