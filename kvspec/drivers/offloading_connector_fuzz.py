"""Random traces against vLLM's real scheduler with the real OffloadingConnector
(``kvspec.adapters.vllm_offloading_connector``, any release of ``CONNECTOR_RELEASES``), judged
after every operation by the second manager's catalogue (O1-O15; no model alongside).

A trace is a configuration, a scheduling mode and a list of operations (plain dicts, so a
trace is saved, shrunk and replayed on any release): ``add`` (a prompt and ``max_tokens``;
vLLM stops the request there), ``step`` (one engine-core step with every waiting request
offered, vLLM preempting by itself when the small GPU pool runs out; ``chunk`` is the step's
prefill chunk), ``work`` (the workers finish the jobs in flight of one request, or all of them,
optionally of one kind; reported with the next output of a batch that ran them), ``abort``
(``finish_requests(FINISHED_ABORTED)``) and ``reset`` (``reset_prefix_cache(reset_connector=
True)``). An operation that no longer applies (an abort of a finished request) is skipped. The
trace ends by draining: steps with every job finished until vLLM has nothing left.

``run_trace`` draws the operations from a seed, online (what is drawn depends on the state),
with the weights and configurations of a *profile*: ``mixed`` (everything), ``preempt`` (a small
GPU pool, many requests, stores left in flight, an abort weight drawn per trace: preemption and
re-admission while a preempted request's stores are not reported, vLLM #46014), ``window`` (a
sliding-window group, repeated prefixes for CPU hits, windows not a multiple of the block size:
vLLM #48959) and ``decode`` (async scheduling, ``offload_prompt_only`` False, long outputs:
decode blocks stored, #36052/#46824). Under swarm testing (``draw_mix``; what ``campaign`` does
unless told otherwise) each trace also draws its own mix on top of its profile: each kind
but ``step`` left out, kept or emphasised, the step chunks from a subset, the number of shared
prefixes; a trace that never finishes a job piles stores in flight onto its preemptions, one
that resets often reaches the reset paths, one without aborts or resets keeps the state they would
undo. A finding is a violation (invariant ids), a crash (vLLM
raised: the exception type and the innermost vLLM function, its *signature*) or ``stuck`` (the
drain makes no progress: ``stuck:head-of-line`` when the state left is the scheduler's
head-of-line block, else ``stuck:stall``; or it never ends: ``stuck:drain``). An exception
raised in kvspec's own code is not a finding: it propagates. ``shrink`` removes operations
while the finding's signature stays.
"""

from __future__ import annotations

import linecache
import random
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.adapters.vllm_offloading_connector import ConnectorConfig, VllmConnectorScheduler
from kvspec.adapters.vllm_scheduler import SchedulerOptions
from kvspec.oracle.catalogue import OFFLOADING_CATALOGUE, check

#: The drain: at most ``DRAIN_STEPS`` plus ``DRAIN_STEPS_PER_REQUEST`` for each unfinished
#: request (a small pool serves a long queue one request at a time); ``STALL_STEPS`` steps in a
#: row with nothing changing (every job finished each step) is a stall.
DRAIN_STEPS, DRAIN_STEPS_PER_REQUEST, STALL_STEPS = 200, 60, 50
PROFILES = ("mixed", "preempt", "window", "decode")
#: Operation weights per profile: add, step, work, abort, reset.
WEIGHTS = {"mixed": (3, 8, 4, 0.6, 0.25), "preempt": (4, 8, 1.5, 0.2, 0.0),
           "window": (3, 8, 4, 0.3, 0.0), "decode": (2, 10, 3, 0.3, 0.0)}
#: The ``preempt`` profile's abort weight, drawn per trace.
PREEMPT_ABORTS = (0.2, 1.0, 4.0)
KINDS = ("add", "step", "work", "abort", "reset")
#: Swarm testing: the factors one trace's mix may multiply each kind's weight by (a kind its
#: profile leaves out starts from the ``mixed`` weight; steps stay as they are), and the step
#: chunk sets, as multiples of the block size (64: a whole prompt at once).
SWARM_FACTORS = {"add": (0.5, 1.0, 2.0), "work": (0.0, 0.25, 1.0, 3.0), "abort": (0.0, 1.0, 4.0),
                 "reset": (0.0, 1.0, 8.0)}
SWARM_CHUNKS = ((1,), (1, 2), (1, 2, 4, 64), (64,))
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
    mix: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "profile": self.profile, "config": self.config,
                "async_scheduling": self.async_scheduling, "ops": self.ops, "steps": self.steps,
                "finding": self.finding, "mix": self.mix}


def signature(finding: dict[str, Any] | None) -> str | None:
    """What identifies a finding across traces and releases: ``violation:O11,O14``,
    ``crash:KeyError@offloading/scheduler.py:_build_store_jobs``, ``stuck:drain``; None for clean."""
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
        self.draining = False
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
        if (kind == "add" and op["rid"] in s.requests) or (kind == "abort" and op["rid"] not in self.unfinished()):
            return False
        self.result.ops.append(op)
        self._do(op)
        return True

    def _do(self, op: Op) -> None:
        s, kind = self.s, op["op"]
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

    def judge(self) -> bool:
        """Check the state after the last operation (the step snapshot too, after a schedule())."""
        s = self.s
        violations = []
        if s.step_snapshot is not None:  # right after a schedule(): the issue-time invariants too
            violations = check(s.step_snapshot)
            s.step_snapshot = None
        violations = violations or check(s.snapshot())
        if violations:
            self.result.finding = {"kind": "violation", "op_index": self.op_index(),
                                   "ids": sorted({v.id for v in violations}),
                                   "violations": [str(v) for v in violations[:8]]}
            return True
        return False

    def op_index(self) -> int:
        """Where the trace is: the index of the operation last applied, or ``len(ops)`` in the
        drain (which records no operation: a replay drains the same way)."""
        return len(self.result.ops) - (0 if self.draining else 1)

    def drain(self) -> None:
        """Steps with every job finished until vLLM has nothing left, judged after each (the
        steps are not recorded as operations: each needs the finishing before it). Stuck when
        nothing changes for ``STALL_STEPS`` steps (``stuck:head-of-line`` or ``stuck:stall``)
        or the steps run out while things still change (``stuck:drain``)."""
        s = self.s
        self.draining = True
        limit = DRAIN_STEPS + DRAIN_STEPS_PER_REQUEST * len(self.unfinished())
        last: tuple[Any, ...] | None = None
        still = steps = 0
        while steps < limit and still < STALL_STEPS:
            s.finish_jobs(list(s.jobs))
            if not s.scheduler.has_requests() and not s.in_flight:
                return
            self._do({"op": "step", "chunk": 64})
            steps += 1
            if self.judge():
                return
            state = self._progress()
            still, last = (still + 1 if state == last else 0), state
        stuck = [f"{r}:{s.requests[r].status.name}" for r in self.unfinished()]
        blocked = _head_of_line(s) if still >= STALL_STEPS else None
        kind = "drain" if still < STALL_STEPS else "stall" if blocked is None else "head-of-line"
        what = (f"vLLM still has work after {steps} drain steps" if kind == "drain" else
                f"vLLM makes no progress: the same state for {STALL_STEPS} drain steps in a row")
        self.result.finding = {"kind": "stuck", "op_index": len(self.result.ops), "ids": [kind],
                               "violations": [f"{what} (every job finished before each): {len(s.jobs)} jobs, "
                                              f"requests {stuck}", *([blocked] if blocked else [])]}

    def _progress(self) -> tuple[Any, ...]:
        """What a drain step can change: each request's status and token counts, the jobs in
        flight and reported, the batches in flight."""
        s = self.s
        return (tuple((rid, r.status.name, r.num_computed_tokens, r.num_output_tokens)
                      for rid, r in sorted(s.requests.items())), len(s.jobs), len(s.reported), len(s.in_flight))


def _head_of_line(s: VllmConnectorScheduler) -> str | None:
    """What a stuck drain looks like when it is the scheduler's head-of-line block: nothing
    running, and at the head of ``skipped_waiting`` a request that is not waiting for anything
    (only for GPU blocks) ahead of requests that hold GPU blocks (a finished load, in
    ``finished_recving_kv_req_ids``, or a preempted request that still holds blocks):
    ``schedule()`` stops at the first allocation that fails, so they are never promoted. None
    when the state is other."""
    sched = s.scheduler
    if not hasattr(sched, "skipped_waiting"):  # 0.31.0 on: blocks holders have a queue of their own
        return None
    queue = list(sched.skipped_waiting)
    if sched.running or not queue or queue[0].status.name.startswith("WAITING_FOR_"):
        return None
    recved: set[str] = getattr(sched, "finished_recving_kv_req_ids", set())
    held = {f"{r.request_id} ({'load finished' if r.request_id in recved else r.status.name})":
            sum(b != 0 for ids in sched.kv_cache_manager.get_block_ids(r.request_id) for b in ids) for r in queue[1:]}
    held = {rid: n for rid, n in held.items() if n}
    if not held:
        return None
    return (f"head-of-line: {queue[0].request_id} ({queue[0].status.name}) heads skipped_waiting and cannot get "
            f"GPU blocks ({s.pool.get_num_free_blocks()} free); behind it, GPU blocks held: {held}; nothing runs")


class Verdict(Exception):
    """Raised by a hook to end a trace with a finding of the hook's own (the connector lockstep's
    divergence); recorded as a crash, which the hook's driver then names."""


_KVSPEC = str(Path(__file__).resolve().parents[1])


def _raised_by_kvspec(exc: BaseException) -> bool:
    """Whether the innermost frame of vLLM's or kvspec's code in the traceback is kvspec's: then
    the error is the harness's (a bad configuration, a kvspec bug), not a finding about vLLM."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/vllm/" in frame.filename:
            return False
        if str(Path(frame.filename).resolve()).startswith(_KVSPEC):
            return True
    return False


def _crash(result: TraceResult, exc: BaseException, op_index: int) -> None:
    """A crash finding: the exception and the innermost frame in vLLM's code."""
    where = "?"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/vllm/" in frame.filename:
            last = frame.end_lineno or frame.lineno or 0
            text = " ".join(linecache.getline(frame.filename, n).strip() for n in range(frame.lineno or 0, last + 1))
            where = f"{frame.filename.split('/vllm/')[-1].removeprefix('distributed/kv_transfer/kv_connector/v1/')}" \
                    f":{frame.name}: {' '.join(text.split())[:90]}"
            break
    result.finding = {"kind": "crash", "op_index": op_index, "ids": [type(exc).__name__], "where": where,
                      "violations": [f"{type(exc).__name__}: {exc}", *traceback.format_exc().splitlines()[-6:]]}


def _execute(config: ConnectorConfig, async_scheduling: bool, result: TraceResult,
             ops: Iterator[Op] | list[Op], drain: bool = True, hook: Hook | None = None) -> TraceResult:
    run: _Run | None = None
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
    except Exception as exc:
        if not isinstance(exc, Verdict) and _raised_by_kvspec(exc):
            raise
        _crash(result, exc, run.op_index() if run is not None else -1)  # vLLM raised: a crash finding
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


@dataclass(frozen=True)
class Mix:
    """One trace's operation mix: each kind's weight (in ``KINDS`` order), the step chunks (tokens)
    and how many of the trace's shared prefixes its prompts start with."""

    weights: tuple[float, ...]
    chunks: tuple[int, ...]
    prefixes: int = 3

    def to_json(self) -> dict[str, Any]:
        return {"weights": dict(zip(KINDS, self.weights, strict=True)), "chunks": list(self.chunks),
                "prefixes": self.prefixes}


def draw_mix(rng: random.Random, config: ConnectorConfig, profile: str, swarm: bool = False) -> Mix:
    """``profile``'s mix for one trace (the ``preempt`` profile's abort weight drawn), or with
    ``swarm`` one drawn on top of it (``SWARM_FACTORS``, ``SWARM_CHUNKS``, one to three prefixes).
    Every operation a swarm mix gives is one its profile could give, bar the kinds the profile
    leaves out; only the proportions differ. Without ``swarm`` nothing but the abort weight is
    drawn. O(1)."""
    B = config.block_size
    weights = list(WEIGHTS[profile])
    if profile == "preempt":  # aborts free GPU blocks between two schedules: room for a preempted
        weights[3] = rng.choice(PREEMPT_ABORTS)  # request to come back in the very next one (#46014)
    if not swarm:
        return Mix(tuple(weights), (B, 2 * B, 4 * B, 64))
    for n, kind in enumerate(KINDS):
        if kind in SWARM_FACTORS:
            weights[n] = (weights[n] or WEIGHTS["mixed"][n]) * rng.choice(SWARM_FACTORS[kind])
    chunks = tuple(64 if c == 64 else c * B for c in rng.choice(SWARM_CHUNKS))
    return Mix(tuple(weights), chunks, rng.randint(1, 3))


def _draw_ops(rng: random.Random, config: ConnectorConfig, profile: str, num_ops: int,
              swarm: bool = False, result: TraceResult | None = None) -> Any:
    """A generator of ``num_ops`` operations; each ``send(run)`` gives it the state to draw from.
    Its mix (``draw_mix``) is recorded in ``result.mix`` under ``swarm``."""
    B = config.block_size
    groups = 2 if config.sliding_window else 1
    room = ((config.num_gpu_blocks - 1) // groups - 1) * B  # a request must fit the GPU pool alone
    prefixes = [[rng.randrange(3, 90) for _ in range(rng.randint(1, 4) * B)] for _ in range(3)]
    mix = draw_mix(rng, config, profile, swarm)
    if swarm and result is not None:
        result.mix = mix.to_json()
    prefixes = prefixes[:mix.prefixes]
    ids = iter(range(10**6))
    long_out = profile == "decode"
    run: _Run | None = None
    for _ in range(num_ops):
        kind = rng.choices(KINDS, mix.weights)[0]
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
            op = {"op": "step", "chunk": rng.choice(mix.chunks)}
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
              profile: str = "mixed", hook: Hook | None = None, swarm: bool = False) -> TraceResult:
    """One trace of ``num_ops`` operations drawn from ``seed`` under ``profile`` (with ``swarm``,
    under a mix of its own: ``draw_mix``), plus the drain; ``hook`` sees the scheduler once built,
    before any request (the connector lockstep wraps it)."""
    rng = random.Random(seed)
    result = TraceResult(seed, config.to_json(), async_scheduling, profile)
    return _execute(config, async_scheduling, result, _draw_ops(rng, config, profile, num_ops, swarm, result),
                    hook=hook)


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
             profiles: tuple[str, ...] = PROFILES, clock: Callable[[], float] = time.monotonic,
             swarm: bool = True) -> Iterator[TraceResult]:
    """Traces with drawn profiles and configurations until ``budget_s`` seconds have passed, each
    under a swarm mix of its own unless ``swarm`` is False (then under its profile's mix);
    ``async_modes`` alternates the scheduling mode instead of drawing it with the profile."""
    assert set(OFFLOADING_CATALOGUE) >= {"O11", "O12", "O13", "O14", "O15"}
    rng = random.Random(seed)
    deadline = clock() + budget_s
    i = 0
    while clock() < deadline:
        profile = profiles[i % len(profiles)]
        config, drawn_async = draw_config(rng, profile)
        mode = drawn_async if async_modes is None else async_modes[i % len(async_modes)]
        yield run_trace(config, mode, rng.randrange(2**31), num_ops, profile, swarm=swarm)
        i += 1
