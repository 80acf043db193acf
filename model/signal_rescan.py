"""The ``signal-rescan`` policy: PR #47235 as its description states it (§9.1-9.2).

Rules added to the baseline (``kvspec.model.baseline``):

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

Both phases of one group are ``rules.rescan_group`` (Phase 1a's end is
``rules.rescan_end``); the group loop is the baseline's.

Open details of §9.2, as options with their defaults:

* ``cap_rescan_at_ready`` (True): Phase 1a stops at ``min(cursor, ready)``. Either choice ends
  it at the cursor in every reachable state, since the proved bound ``cursor <= ready <= N``
  (``specs.transitions.bounds``, I9 strengthened) holds; the option names the PR's open detail, no behaviour.
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
from typing import Any, ClassVar

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.model.baseline import BaselinePolicy, GroupSelection
from kvspec.model.block_pool import NULL_BLOCK
from kvspec.model.rules import rescan_end, rescan_group
from kvspec.model.scheduler import Evicted, OffloadScheduler, StoreBatch, StoreState


@dataclass(frozen=True)
class SignalRescanOptions:
    """The open details of §9.2 (see the module docstring)."""

    cap_rescan_at_ready: bool = True
    rescan_oos_stops_scan: bool = False
    reset_clears_flag: bool = False
    flush_rescans: bool = False


class SignalRescanPolicy(BaselinePolicy):
    """PR #47235: one pool-wide eviction flag; a step that consumes it rescans every cursor."""

    name: ClassVar[str] = "signal-rescan"

    @classmethod
    def claims(cls, config: OffloadConfig) -> tuple[str, ...]:
        """The baseline's guarantees. The PR also claims completeness (C1); that claim is false
        (H1, H3, H6) and is checked as a known bug (``pr47235-flag`` in the bug catalogue)."""
        return super().claims(config)

    def __init__(self, sched: OffloadScheduler, options: SignalRescanOptions | None = None) -> None:
        super().__init__(sched)
        self.options = options or SignalRescanOptions()
        self.eviction_flag = False
        self.rescan = False  # whether the scan running now includes Phase 1a
        self.visits_last_plan = 0  # positions the last planning step (and flushes since) looked at

    def consume_eviction_signal(self) -> bool:
        """Read and clear the eviction flag. O(1)."""
        was, self.eviction_flag = self.eviction_flag, False
        return was

    def on_cpu_evictions(self, evicted: Evicted) -> None:
        """Any removal sets the flag. O(1)."""
        if evicted:
            self.eviction_flag = True

    def plan_eager(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        """The flag is consumed once, before the request loop: it decides Phase 1a for the
        whole step. Then the baseline's loop. O(positions scanned)."""
        self.rescan = self.consume_eviction_signal()
        self.visits_last_plan = 0
        super().plan_eager(out, batch)

    def finish_flush(self, request: RequestView, block_ids: list[list[int]]) -> None:
        """The baseline's flush; it rescans only under ``flush_rescans`` while the flag is set,
        without consuming it. O(positions scanned)."""
        self.rescan = self.options.flush_rescans and self.eviction_flag
        super().finish_flush(request, block_ids)

    def select_group(self, st: StoreState, g: int, ids: list[int], taken: int, free: int) -> GroupSelection:
        """``rules.rescan_group``: Phase 1a over ``[0, rescan_end)`` when rescanning, Phase 1b
        over ``[cursor, ready)``; the advance is Phase 1b's. O(rescan_end + ready - cursor)."""
        cursor, ready = st.num_stored_blocks[g], self.sched.ready_blocks(st, ids)
        end = rescan_end(cursor, ready, len(ids), self.options.cap_rescan_at_ready) if self.rescan else 0
        stored = self.sched.ready_sources(st, g, ids, range(end))
        new = self.sched.ready_sources(st, g, ids, range(cursor, ready))
        scan = rescan_group([gid != NULL_BLOCK for gid in stored], [gid != NULL_BLOCK for gid in new], taken, free,
                            self.options.rescan_oos_stops_scan)
        self.visits_last_plan += scan.visits
        return GroupSelection([stored[k] for k in scan.restored] + [new[k] for k in scan.picked], scan.advance)

    def on_reset(self) -> None:
        """Under ``reset_clears_flag`` the flag is cleared."""
        if self.options.reset_clears_flag:
            self.eviction_flag = False

    def snapshot(self) -> dict[str, Any]:
        """``eviction_flag``."""
        return {"eviction_flag": self.eviction_flag}
