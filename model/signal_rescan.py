"""The ``signal-rescan`` policy: PR #47235 as its description states it (§9.1-9.2).

Rules added to the baseline:

* **Eviction signal:** any CPU allocation that removes a cached entry sets one
  pool-wide flag; ``consume_eviction_signal`` reads and clears it. The flag follows
  *removals* (what the CPU pool reports as evicted), not "a hash was cleared".
* **Consumed once per planning step**, before the request loop.
* **Phase 1a:** when the flag was set, every scanned request re-scans its stored
  positions ``[0, cursor)`` (capped at ``ready`` by default) with the baseline's
  per-position rules and re-stores what the CPU no longer holds. Phase 1a never
  moves the cursor.
* **Phase 1b:** the baseline scan of ``[cursor, ready)``.
* **Absolute cursor:** the cursor is *assigned* ``cursor + Phase-1b advance``.

Open details of §9.2, as options with their defaults:

* ``cap_rescan_at_ready`` (True): Phase 1a stops at ``min(cursor, ready)``.
* ``rescan_oos_stops_scan`` (False): running out of CPU space in Phase 1a skips
  Phase 1b of that group entirely (True) or lets it still advance past skippable
  positions (False).
* ``reset_clears_flag`` (False): ``reset()`` leaves the flag set (one spurious
  rescan follows, harmless).
* ``flush_rescans`` (False): the finish flush does not rescan.

Cost: Phase 1a visits ``cursor`` positions per scanned request whenever any entry
was evicted since the last step, i.e. O(sum of cursors) per step under CPU pressure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import SchedulerOutput
from kvspec.model.block_pool import BlockPool
from kvspec.model.hashing import BlockKey
from kvspec.model.scheduler import READY, OffloadScheduler, StoreBatch, StoreState


@dataclass(frozen=True)
class SignalRescanOptions:
    cap_rescan_at_ready: bool = True
    rescan_oos_stops_scan: bool = False
    reset_clears_flag: bool = False
    flush_rescans: bool = False


class SignalRescanScheduler(OffloadScheduler):
    policy_name = "signal-rescan"

    @classmethod
    def claims(cls, config: OffloadConfig) -> tuple[str, ...]:
        """The baseline's guarantees. The PR also claims completeness (C1); that claim is false
        (H1, H3, H6) and is checked as a known bug (``pr47235-flag`` in the bug catalogue)."""
        return super().claims(config)

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool,
                 options: SignalRescanOptions | None = None) -> None:
        super().__init__(config, gpu_pool)
        self.options = options or SignalRescanOptions()
        self.eviction_flag = False
        self._rescan = False
        self.visits_last_plan = 0

    def consume_eviction_signal(self) -> bool:
        """Read and clear the eviction flag. O(1)."""
        was, self.eviction_flag = self.eviction_flag, False
        return was

    def _on_cpu_evictions(self, evicted: list[tuple[int, BlockKey]]) -> None:
        if evicted:
            self.eviction_flag = True

    def _plan_before_scan(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        self._rescan = self.consume_eviction_signal()
        self.visits_last_plan = 0

    def _select_eager_blocks_to_store(self, st: StoreState,
                                      ids_by_group: list[list[int]]) -> tuple[list[int], list[int]]:
        return self._select(st, ids_by_group, self._rescan)

    def _select_finish_flush(self, st: StoreState, block_ids: list[list[int]]) -> list[int]:
        return self._select(st, block_ids, self.options.flush_rescans and self.eviction_flag)[0]

    def _select(self, st: StoreState, ids_by_group: list[list[int]], rescan: bool) -> tuple[list[int], list[int]]:
        """Phase 1a over [0, cursor) when ``rescan``, then Phase 1b; returns absolute cursors."""
        selected: list[int] = []
        cursor = list(st.num_stored_blocks)
        free = self.cpu_pool.get_num_free_blocks()
        for g, ids in enumerate(ids_by_group):
            if len(selected) >= free:
                break
            already, ready = st.num_stored_blocks[g], self._ready_blocks(st, ids)
            out_of_space = False
            if rescan:
                end = min(already, ready) if self.options.cap_rescan_at_ready else min(already, len(ids))
                for i in range(end):
                    self.visits_last_plan += 1
                    gid = self._store_source(st, g, i, ids[i])
                    if gid is None or self._classify(gid) != READY:
                        continue
                    if len(selected) >= free:
                        out_of_space = True
                        break
                    selected.append(gid)
            if out_of_space and self.options.rescan_oos_stops_scan:
                continue
            for i in range(already, ready):
                self.visits_last_plan += 1
                gid = self._store_source(st, g, i, ids[i])
                if gid is None or self._classify(gid) != READY:
                    cursor[g] += 1
                    continue
                if len(selected) >= free:
                    break
                selected.append(gid)
                cursor[g] += 1
        return selected, cursor

    def _advance_cursors(self, st: StoreState, advance: list[int]) -> None:
        """Absolute cursor: assign, do not add."""
        st.num_stored_blocks = list(advance)

    def _on_reset(self) -> None:
        if self.options.reset_clears_flag:
            self.eviction_flag = False

    def _policy_snapshot(self) -> dict[str, Any]:
        return {"eviction_flag": self.eviction_flag}
