"""Z3 counterexamples turned into engine traces that replay on the model.

A counterexample of ``obligations.py`` is an abstract step: a state where a completeness
claim holds, one transition, and a state where it does not. The builders here read the
numbers that matter from the Z3 model (the cursor, the positions that became holes) and
write a trace for ``kvspec.drivers.engine.Engine`` whose CPU pool is sized so the same
thing happens to a real request, block for block:

* ``T2`` (baseline, eviction): request R stores its first ``c`` blocks (cursor ``c``),
  then its own store of ``e`` new blocks evicts its ``e`` oldest entries; the cursor has
  passed them. C1 reports ``e`` holes, and they stay (the baseline never looks back).
* ``H1`` (signal-rescan, flag consumed by another request): R stores ``c`` blocks and
  stops generating (idle, not finished); Q's store evicts R's oldest ``e`` entries and
  sets the flag; in the next step only Q is scheduled, so Q consumes the flag. R's holes
  stay with no flag left to repair them.
* ``H3`` (signal-rescan, rescan out of space): R's ``h`` entries are all evicted by Q's
  store, which is still in flight at the next step: the CPU free count is 0, Phase 1a
  re-stores nothing, and the flag is consumed. Once Q's store lands nothing sets the
  flag again, and R's holes stay.

Each trace ends with a few more steps, so the test sees that the holes are permanent.
"""

from __future__ import annotations

from typing import Any

from kvspec.contract.config import OffloadConfig

B = 16  # the engine's default block size


def _holes(cex: dict[str, Any]) -> int:
    """Positions below the pre-state cursor that are owned, hashed and uncovered afterwards."""
    c = cex["pre.cur0"]
    return sum(1 for i in range(min(c, 8))
               if cex["post.owned0"][i] and cex["post.hashed0"][i]
               and not cex["post.cached0"][i] and not cex["post.infl0"][i])


def trace_t2(cex: dict[str, Any]) -> tuple[OffloadConfig, list[dict[str, Any]]]:
    c = max(1, min(cex["pre.cur0"], 4))
    e = max(1, min(_holes(cex), c))
    cfg = OffloadConfig(num_cpu_blocks=c + 1, num_gpu_blocks=2 * (c + e) + 4, policy="baseline",
                        async_scheduling=False)
    ops: list[dict[str, Any]] = [
        {"op": "add", "rid": "R", "family": 1, "prompt_len": (c + e) * B + 1, "max_tokens": 8},
        {"op": "step", "admit": ["R"], "chunk": c * B},  # prefill c blocks
        {"op": "step", "chunk": e * B + 1},  # c blocks confirmed: stored, cursor c; the rest computed
        {"op": "report", "event": 0},
        {"op": "step", "chunk": 1},  # e blocks confirmed: stored, evicting R's oldest e entries
        {"op": "report", "event": 1},
        {"op": "step", "chunk": 1},
        {"op": "step", "chunk": 1},
    ]
    return cfg, ops


def trace_h1(cex: dict[str, Any]) -> tuple[OffloadConfig, list[dict[str, Any]]]:
    c = max(1, min(cex["pre.cur0"], 4))
    e = max(1, min(_holes(cex), c))
    cfg = OffloadConfig(num_cpu_blocks=c + 1, num_gpu_blocks=2 * (c + e) + 6, policy="signal-rescan",
                        async_scheduling=False)
    ops: list[dict[str, Any]] = [
        {"op": "add", "rid": "R", "family": 1, "prompt_len": c * B + 1, "max_tokens": 1},
        {"op": "step", "admit": ["R"], "chunk": c * B + 1},  # prefill; R samples its only token
        {"op": "step", "chunk": 1},  # R's c blocks stored (cursor c); R is now idle
        {"op": "report", "event": 0},
        {"op": "add", "rid": "Q", "family": 2, "prompt_len": e * B + 1, "max_tokens": 8},
        {"op": "step", "admit": ["Q"], "chunk": e * B + 1},
        {"op": "step", "chunk": 1},  # Q's e blocks stored, evicting R's oldest e: the flag is set
        {"op": "report", "event": 1},
        {"op": "step", "chunk": 1},  # only Q is scheduled: Q consumes the flag
        {"op": "step", "chunk": 1},
        {"op": "step", "chunk": 1},
    ]
    return cfg, ops


def trace_h3(cex: dict[str, Any]) -> tuple[OffloadConfig, list[dict[str, Any]]]:
    h = max(1, min(_holes(cex), 4))
    cfg = OffloadConfig(num_cpu_blocks=h + 1, num_gpu_blocks=4 * h + 8, policy="signal-rescan",
                        async_scheduling=False)
    ops: list[dict[str, Any]] = [
        {"op": "add", "rid": "R", "family": 1, "prompt_len": h * B + 1, "max_tokens": 40},
        {"op": "step", "admit": ["R"], "chunk": h * B + 1},
        {"op": "step", "chunk": 1},  # R's h blocks stored (cursor h)
        {"op": "report", "event": 0},
        {"op": "add", "rid": "Q", "family": 2, "prompt_len": h * B + 1, "max_tokens": 40},
        {"op": "step", "admit": ["Q"], "chunk": h * B + 1},
        {"op": "step", "chunk": 1},  # Q's h blocks stored, evicting all of R's: the flag is set
        {"op": "step", "chunk": 1},  # R scheduled, flag consumed, Q's store in flight: free 0, no re-store
        {"op": "report", "event": 1},
        {"op": "step", "chunk": 1},
        {"op": "step", "chunk": 1},
    ]
    return cfg, ops


BUILDERS = {
    "completeness-c1:T2": trace_t2,
    "completeness-flag:H1": trace_h1,
    "completeness-flag:H3": trace_h3,
}
