"""Random traces against vLLM's real scheduler with the real OffloadingConnector
(``kvspec.adapters.vllm_offloading_connector``, any release of ``CONNECTOR_RELEASES``), judged
after every operation by the second manager's catalogue (O1-O15; no model alongside).

A trace is a configuration, a scheduling mode and a list of operations (plain dicts, so a
trace is saved, shrunk and replayed on any release): ``add`` (a prompt and ``max_tokens``;
vLLM stops the request there), ``step`` (one engine-core step with every waiting request
offered, vLLM preempting by itself when the small GPU pool runs out; ``chunk`` is the step's
prefill chunk), ``work`` (the workers finish the jobs in flight of one request, or all of them,
optionally of one kind; reported with the next output), ``abort``
(``finish_requests(FINISHED_ABORTED)``) and ``reset`` (``reset_prefix_cache(reset_connector=
True)``). An operation that no longer applies (an abort of a finished request) is skipped. The
trace ends by draining: steps with every job finished until vLLM has nothing left.

``run_trace`` draws the operations from a seed, online (what is drawn depends on the state),
with the weights and configurations of a *profile*: ``mixed`` (everything), ``preempt`` (a small
GPU pool, many requests, stores left in flight: preemption and re-admission while a preempted
request's stores are not reported, vLLM #46014), ``window`` (a sliding-window group, repeated
prefixes for CPU hits, windows not a multiple of the block size: vLLM #48959) and ``decode``
(async scheduling, ``offload_prompt_only`` False, long outputs: decode blocks stored,
#36052/#46824). A finding is a violation (invariant ids), a crash (vLLM raised: the exception
type and the innermost vLLM function, its *signature*) or ``stuck`` (the drain never ends).
``shrink`` removes operations while the finding's signature stays.
"""

from __future__ import annotations

import linecache
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
PROFILES = ("mixed", "preempt", "window", "decode")
#: Operation weights per profile: add, step, work, abort, reset.
WEIGHTS = {"mixed": (3, 8, 4, 0.6, 0.25), "preempt": (4, 8, 1.5, 0.2, 0.0),
           "window": (3, 8, 4, 0.3, 0.0), "decode": (2, 10, 3, 0.3, 0.0)}
Op = dict[str, Any]
Hook = Callable[[VllmConnectorScheduler], object]  # sees the scheduler once built, before any request


@dataclass
class TraceResult:
    """One trace: its seed (None: replayed), profile, configuration, the operations run (each as
    applied), steps, and the finding (None: clean)."""

    seed: int | None
    config: dict[str, Any]
    async_scheduling: bool
    profile: str = "mixed"
    ops: list[Op] = field(default_factory=list)
    steps: int = 0
    finding: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "profile": self.profile, "config": self.config,
                "async_scheduling": self.async_scheduling, "ops": self.ops, "steps": self.steps,
                "finding": self.finding}


def signature(finding: dict[str, Any] | None) -> str | None:
    """What identifies a finding across traces and releases: ``violation:O11,O14``,
    ``crash:KeyError@offloading/scheduler.py:_build_store_jobs``, ``stuck``; None for clean."""
    if finding is None:
        return None
    if finding["kind"] == "crash":
        return f"crash:{finding['ids'][0]}@{finding.get('where', '?')}"
    return f"{finding['kind']}:{','.join(finding['ids'])}"


def draw_config(rng: random.Random, profile: str = "mixed") -> tuple[ConnectorConfig, bool]:
    """A small configuration for ``profile`` and the scheduling mode (True: async)."""
    B = rng.choice([2, 4])
    if profile == "preempt":
        return ConnectorConfig(block_size=B, num_gpu_blocks=rng.randint(6, 11), num_chunks=rng.randint(4, 12),
                               eviction_policy=rng.choice(["lru", "arc"]),
                               offload_prompt_only=rng.random() < 0.7), rng.random() < 0.8
    if profile == "window":
        window = rng.choice([2 * B, 3 * B, 2 * B + 1, 3 * B - 1, B + 1])
        return ConnectorConfig(block_size=B, num_gpu_blocks=rng.randint(12, 24), num_chunks=rng.randint(6, 16),
                               eviction_policy=rng.choice(["lru", "arc"]), sliding_window=window,
                               offload_prompt_only=rng.random() < 0.5), rng.random() < 0.5
    if profile == "decode":
        return ConnectorConfig(block_size=B, num_gpu_blocks=rng.randint(10, 20), num_chunks=rng.randint(6, 16),
                               eviction_policy=rng.choice(["lru", "arc"]), offload_prompt_only=False), True
    return ConnectorConfig(block_size=B, num_gpu_blocks=rng.randint(8, 20), num_chunks=rng.randint(2, 10),
                           eviction_policy=rng.choice(["lru", "arc"]),
                           sliding_window=rng.choice([0, 0, 0, 2 * B, 3 * B]),
                           offload_prompt_only=rng.random() < 0.7), rng.random() < 0.5


class _Run:
    """One trace being run: vLLM with the connector, the operations applied, the judge."""

    def __init__(self, config: ConnectorConfig, async_scheduling: bool, result: TraceResult,
                 hook: Hook | None = None) -> None:
        self.config, self.result = config, result
        self.s = VllmConnectorScheduler(config, SchedulerOptions(async_scheduling=async_scheduling, auto_finish=True),
                                        lambda rid, n: 100 + (sum(map(ord, rid)) + 7 * n) % 5)
        if hook is not None:
            hook(self.s)

    def unfinished(self) -> list[str]:
        return [rid for rid, r in self.s.requests.items() if not r.is_finished()]

    def apply(self, op: Op) -> bool:
        """Apply one operation, recorded first (a crash's operation is the trace's last); False
        when it no longer applies (skipped, not recorded)."""
        s, kind = self.s, op["op"]
        self.result.ops.append(op)
        if (kind == "add" and op["rid"] in s.requests) or (kind == "abort" and op["rid"] not in self.unfinished()):
            self.result.ops.pop()
            return False
        if kind == "add":
            s.add_request(op["rid"], list(op["prompt"]), int(op["max_tokens"]))
        elif kind == "step":
            s.step([r.request_id for r in s.scheduler.waiting], int(op["chunk"]), [], "mrv1")
            self.result.steps += 1
        elif kind == "work":
            s.finish_jobs([j for j, job in s.jobs.items() if not job.done
                           and op.get("req") in (None, job.req) and op.get("kind") in (None, job.kind)])
        elif kind == "abort":
            s.finish(op["rid"])
        elif kind == "reset":
            s.reset()
        else:
            raise ValueError(f"unknown connector operation {kind!r}")
        return True

    def judge(self) -> bool:
        """Check the state after the last operation (the step snapshot too, after a schedule())."""
        s = self.s
        violations = []
        if s.step_snapshot is not None:  # right after a schedule(): the issue-time invariants too
            violations = check(s.step_snapshot)
            s.step_snapshot = None
        violations = violations or check(s.snapshot())
        if violations:
            self.result.finding = {"kind": "violation", "op_index": len(self.result.ops) - 1,
                                   "ids": sorted({v.id for v in violations}),
                                   "violations": [str(v) for v in violations[:8]]}
            return True
        return False

    def drain(self) -> None:
        s = self.s
        for _ in range(DRAIN_STEPS):
            s.finish_jobs(list(s.jobs))
            if not s.scheduler.has_requests() and not s.in_flight:
                return
            if self.apply({"op": "step", "chunk": 64}) and self.judge():
                return
        stuck = [f"{r}:{s.requests[r].status.name}" for r in self.unfinished()]
        self.result.finding = {"kind": "stuck", "op_index": len(self.result.ops), "ids": ["drain"],
                               "violations": [f"vLLM still has work after {DRAIN_STEPS} drain steps: "
                                              f"{len(s.jobs)} jobs, requests {stuck}"]}


def _crash(result: TraceResult, exc: BaseException) -> None:
    """A crash finding: the exception and the innermost frame in vLLM's code."""
    where = "?"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/vllm/" in frame.filename:
            last = frame.end_lineno or frame.lineno or 0
            text = " ".join(linecache.getline(frame.filename, n).strip() for n in range(frame.lineno or 0, last + 1))
            where = f"{frame.filename.split('/vllm/')[-1].removeprefix('distributed/kv_transfer/kv_connector/v1/')}" \
                    f":{frame.name}: {' '.join(text.split())[:90]}"
            break
    result.finding = {"kind": "crash", "op_index": len(result.ops) - 1, "ids": [type(exc).__name__], "where": where,
                      "violations": [f"{type(exc).__name__}: {exc}", *traceback.format_exc().splitlines()[-6:]]}


def _execute(config: ConnectorConfig, async_scheduling: bool, result: TraceResult,
             ops: Iterator[Op] | list[Op], drain: bool = True, hook: Hook | None = None) -> TraceResult:
    try:
        run = _Run(config, async_scheduling, result, hook)
        if isinstance(ops, list):
            ops = iter(ops)
        for op in _bind(ops, run):
            if op["op"] == "drain":
                break
            if run.apply(op) and run.judge():
                return result
        if drain:
            run.drain()
    except Exception as exc:  # vLLM raised: a crash finding
        _crash(result, exc)
    return result


def _bind(ops: Iterator[Op], run: _Run) -> Iterator[Op]:
    """The operations, each drawn (when ``ops`` is a generator) after the previous one ran."""
    gen_send = getattr(ops, "send", None)
    if gen_send is None:
        yield from ops
        return
    op = next(ops)
    while True:
        yield op
        try:
            op = gen_send(run)
        except StopIteration:
            return


def run_ops(config: ConnectorConfig, async_scheduling: bool, ops: list[Op], profile: str = "mixed",
            hook: Hook | None = None) -> TraceResult:
    """Replay a trace's operations (then the drain), checked after every operation; ``hook`` as
    for ``run_trace``."""
    return _execute(config, async_scheduling, TraceResult(None, config.to_json(), async_scheduling, profile),
                    list(ops), hook=hook)


# long function: the operation generator's per-kind draws share the trace's prefixes and ids
def _draw_ops(rng: random.Random, config: ConnectorConfig, profile: str, num_ops: int) -> Any:
    """A generator of ``num_ops`` operations; each ``send(run)`` gives it the state to draw from."""
    B = config.block_size
    groups = 2 if config.sliding_window else 1
    room = ((config.num_gpu_blocks - 1) // groups - 1) * B  # a request must fit the GPU pool alone
    prefixes = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 4) * B)] for _ in range(3)]
    ids = iter(range(10**6))
    long_out = profile == "decode"
    run: _Run | None = None
    for _ in range(num_ops):
        kind = rng.choices(["add", "step", "work", "abort", "reset"], WEIGHTS[profile])[0]
        if run is not None and not run.s.requests:
            kind = "add"
        op: Op
        if kind == "add" or run is None:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 90) for _ in range(rng.randint(0, 3 * B))]
            max_tokens = rng.randint(1, 6 * B if long_out else 3 * B)
            prompt = prompt[:max(1, room - max_tokens)]
            max_tokens = min(max_tokens, max(1, room - len(prompt)))
            op = {"op": "add", "rid": f"r{next(ids)}", "prompt": prompt, "max_tokens": max_tokens}
        elif kind == "step":
            op = {"op": "step", "chunk": rng.choice([B, 2 * B, 4 * B, 64])}
        elif kind == "work":
            pending = sorted({job.req for job in run.s.jobs.values() if not job.done})
            op = {"op": "work", "req": rng.choice(pending) if pending and rng.random() < 0.6 else None,
                  "kind": rng.choice([None, None, "load", "store"])}
        elif kind == "abort":
            live = run.unfinished()
            if not live:
                continue
            op = {"op": "abort", "rid": rng.choice(live)}
        else:
            op = {"op": "reset"}
        run = yield op


def run_trace(config: ConnectorConfig, async_scheduling: bool, seed: int, num_ops: int = 60,
              profile: str = "mixed", hook: Hook | None = None) -> TraceResult:
    """One trace of ``num_ops`` operations drawn from ``seed`` under ``profile``, plus the drain;
    ``hook`` sees the scheduler once built, before any request (the connector lockstep wraps it)."""
    rng = random.Random(seed)
    result = TraceResult(seed, config.to_json(), async_scheduling, profile)
    return _execute(config, async_scheduling, result, _draw_ops(rng, config, profile, num_ops), hook=hook)


def shrink(config: ConnectorConfig, async_scheduling: bool, ops: list[Op], wanted: str,
           max_replays: int = 150, profile: str = "mixed") -> tuple[list[Op], TraceResult]:
    """Remove operations (halves, then smaller runs, then single ones) while a replay still makes
    the finding of signature ``wanted``; at most ``max_replays`` replays. O(max_replays x trace)."""
    best = run_ops(config, async_scheduling, ops, profile)
    if signature(best.finding) != wanted:
        return ops, best
    ops = best.ops[:best.finding["op_index"] + 1] if best.finding else ops
    replays = 1
    size = max(1, len(ops) // 2)
    while size >= 1 and replays < max_replays:
        i = 0
        while i < len(ops) and replays < max_replays:
            candidate = ops[:i] + ops[i + size:]
            res = run_ops(config, async_scheduling, candidate, profile)
            replays += 1
            if signature(res.finding) == wanted:
                ops, best = candidate, res
            else:
                i += size
        size //= 2
    return ops, best


def campaign(budget_s: float, seed: int, async_modes: tuple[bool, ...] | None = None, num_ops: int = 60,
             profiles: tuple[str, ...] = PROFILES,
             clock: Callable[[], float] = time.monotonic) -> Iterator[TraceResult]:
    """Traces with drawn profiles and configurations until ``budget_s`` seconds have passed;
    ``async_modes`` alternates the scheduling mode instead of drawing it with the profile."""
    assert set(OFFLOADING_CATALOGUE) >= {"O11", "O12", "O13", "O14", "O15"}
    rng = random.Random(seed)
    deadline = clock() + budget_s
    i = 0
    while clock() < deadline:
        profile = profiles[i % len(profiles)]
        config, drawn_async = draw_config(rng, profile)
        mode = drawn_async if async_modes is None else async_modes[i % len(async_modes)]
        yield run_trace(config, mode, rng.randrange(2**31), num_ops, profile)
        i += 1
