"""Random traces against vLLM's real scheduler with the real OffloadingConnector
(``kvspec.adapters.vllm_offloading_connector``), judged after every operation by the
second manager's catalogue (O1-O15; no model alongside).

A trace is a seed and a configuration: the operations are drawn from the seed, so
``run_trace(config, async_scheduling, seed, ops)`` replays it exactly. Operations: ``add`` (a
prompt of a shared prefix plus a suffix, and ``max_tokens``; vLLM stops the request there),
``step`` (one engine-core step with every waiting request offered, vLLM preempting by itself
when the small GPU pool runs out), ``work`` (the workers finish some jobs in flight; reported
with the next output), ``abort`` (``finish_requests(FINISHED_ABORTED)``) and ``reset``
(``reset_prefix_cache(reset_connector=True)``). The trace ends by draining: steps with every job
finished until vLLM has nothing left. A finding is a violation (an invariant's id and message)
or a crash (vLLM raised).
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvspec.adapters.vllm_offloading_connector import ConnectorConfig, VllmConnectorScheduler
from kvspec.adapters.vllm_scheduler import SchedulerOptions
from kvspec.oracle.catalogue import OFFLOADING_CATALOGUE, check

DRAIN_STEPS = 200


@dataclass
class TraceResult:
    """One trace: its seed, configuration, operations run, and the finding (None: clean)."""

    seed: int
    config: dict[str, Any]
    async_scheduling: bool
    ops: list[str] = field(default_factory=list)
    steps: int = 0
    finding: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "config": self.config, "async_scheduling": self.async_scheduling,
                "ops": self.ops, "steps": self.steps, "finding": self.finding}


def draw_config(rng: random.Random) -> ConnectorConfig:
    """A small configuration: GPU pools that force preemption, a few CPU chunks, either policy,
    now and then a sliding-window group or decode blocks stored too."""
    block_size = rng.choice([2, 4])
    return ConnectorConfig(block_size=block_size, num_gpu_blocks=rng.randint(8, 20), num_chunks=rng.randint(2, 10),
                           eviction_policy=rng.choice(["lru", "arc"]),
                           sliding_window=rng.choice([0, 0, 0, 2 * block_size, 3 * block_size]),
                           offload_prompt_only=rng.random() < 0.7, max_num_batched_tokens=64)


# long function: one trace's loop with its three local steps (judge, unfinished, step) sharing its state
def run_trace(config: ConnectorConfig, async_scheduling: bool, seed: int, num_ops: int = 60,
              hook: Callable[[VllmConnectorScheduler], object] | None = None) -> TraceResult:
    """One trace of ``num_ops`` drawn operations plus the drain, checked after every operation;
    ``hook`` sees the scheduler once built, before any request (the connector lockstep wraps it)."""
    rng = random.Random(seed)
    result = TraceResult(seed, config.to_json(), async_scheduling)
    s = VllmConnectorScheduler(config, SchedulerOptions(async_scheduling=async_scheduling, auto_finish=True),
                               lambda rid, n: 100 + (sum(map(ord, rid)) + 7 * n) % 5)
    if hook is not None:
        hook(s)
    B = config.block_size
    groups = 2 if config.sliding_window else 1
    # a request must fit the GPU pool alone (vLLM would refuse a longer one at admission)
    room = ((config.num_gpu_blocks - 1) // groups - 1) * B
    prefixes = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 4) * B)] for _ in range(3)]
    ids = iter(range(10**6))

    def judge(op: str) -> bool:
        result.ops.append(op)
        violations = []
        if s.step_snapshot is not None:  # right after a schedule(): the issue-time invariants too
            violations = check(s.step_snapshot)
            s.step_snapshot = None
        violations = violations or check(s.snapshot())
        if violations:
            result.finding = {"kind": "violation", "op_index": len(result.ops) - 1, "op": op,
                              "ids": sorted({v.id for v in violations}),
                              "violations": [str(v) for v in violations[:8]]}
            return True
        return False

    def unfinished() -> list[str]:
        return [rid for rid, r in s.requests.items() if not r.is_finished()]

    def step() -> str:
        waiting = [r.request_id for r in s.scheduler.waiting]
        chunk = rng.choice([B, 2 * B, 4 * B, 64])
        s.step(waiting, chunk, [], "mrv1")
        result.steps += 1
        return f"step chunk={chunk}"

    current = ["?"]
    try:
        for _ in range(num_ops):
            kind = rng.choices(["add", "step", "work", "abort", "reset"], [3, 8, 4, 0.6, 0.25])[0]
            current[0] = kind
            if kind == "add" or not s.requests:
                rid = f"r{next(ids)}"
                prompt = rng.choice(prefixes) + [rng.randrange(3, 90) for _ in range(rng.randint(0, 3 * B))]
                max_tokens = rng.randint(1, 3 * B)
                prompt = prompt[:max(1, room - max_tokens)]
                max_tokens = min(max_tokens, max(1, room - len(prompt)))
                s.add_request(rid, prompt, max_tokens)
                op = f"add {rid} len={len(prompt)}"
            elif kind == "step":
                op = step()
            elif kind == "work":
                pending = sorted(j for j, job in s.jobs.items() if not job.done)
                chosen = [j for j in pending if rng.random() < 0.6]
                s.finish_jobs(chosen)
                op = f"work {chosen}"
            elif kind == "abort":
                live = unfinished()
                if not live:
                    continue
                rid = rng.choice(live)
                s.finish(rid)
                op = f"abort {rid}"
            else:
                ok = s.reset()
                op = f"reset -> {ok}"
            if judge(op):
                return result
        current[0] = "drain step"
        for _ in range(DRAIN_STEPS):
            s.finish_jobs(list(s.jobs))
            if not s.scheduler.has_requests() and not s.in_flight:
                break
            if judge(step()):
                return result
        else:
            stuck = [f"{r}:{s.requests[r].status.name}" for r in unfinished()]
            result.finding = {"kind": "stuck", "op_index": len(result.ops), "op": "drain", "ids": ["drain"],
                              "violations": [f"vLLM still has work after {DRAIN_STEPS} drain steps: "
                                             f"{len(s.jobs)} jobs, requests {stuck}"]}
    except Exception as exc:  # vLLM raised: a crash finding
        result.finding = {"kind": "crash", "op_index": len(result.ops), "op": current[0],
                          "ids": [type(exc).__name__],
                          "violations": [f"{type(exc).__name__}: {exc}",
                                         *traceback.format_exc().splitlines()[-6:]]}
    return result


def campaign(budget_s: float, seed: int, async_modes: tuple[bool, ...] = (False, True),
             num_ops: int = 60) -> Iterator[TraceResult]:
    """Traces with drawn configurations until ``budget_s`` seconds have passed."""
    assert set(OFFLOADING_CATALOGUE) >= {"O11", "O12", "O13", "O14", "O15"}
    rng = random.Random(seed)
    deadline = time.monotonic() + budget_s
    i = 0
    while time.monotonic() < deadline:
        config = draw_config(rng)
        yield run_trace(config, async_modes[i % len(async_modes)], rng.randrange(2**31), num_ops)
        i += 1
