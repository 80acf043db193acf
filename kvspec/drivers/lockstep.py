"""Lockstep: two schedulers fed the same operations, compared after every one.

A *side* takes kvspec's engine operations and shows what it did: ``EngineSide`` is
``kvspec.drivers.engine.Engine`` over the model's ``baseline`` policy (synchronous or async
scheduling, as its configuration says); ``VllmSide`` is vLLM 0.33.0's real
``Scheduler`` or ``AsyncScheduler`` with the real SimpleCPUOffloadConnector
(``kvspec.drivers.scheduler_driver``). ``Lockstep(left, right)`` applies each operation to
both and compares, in this order:

1. the outcome: accepted, or rejected with the same ``KVSpecError`` class (an operation vLLM
   has no counterpart for, or a crash, is an outcome of its own);
2. for a ``step``: tokens scheduled per request (in scheduling order), preempted and finished
   ids, new and cached request data (block ids), the connector metadata (store and load events
   with their block lists);
3. the unfinished requests (phase, tokens, computed tokens, placeholders, block table);
4. the GPU pool, the CPU pool and the connector's scheduler state (kvspec's snapshot format).

The first divergence is reported with its section, the first differing field (as
``path: reference L != target R``, the left side being the reference), and every section that
differs. ``kvspec.drivers.divergence`` names the causes and measures them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

from kvspec.adapters.vllm_scheduler import SchedulerOptions, StepObservation, observe_step
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import KVSpecError
from kvspec.contract.types import ConnectorMetadata, OffloadTarget, SchedulerOutput
from kvspec.drivers.engine import FINISHED, Engine
from kvspec.drivers.harness import first_difference
from kvspec.drivers.scheduler_driver import OutsideVllmError, VllmSchedulerDriver

STEP_SECTIONS = ("scheduled", "preempted", "finished", "new_reqs", "cached_reqs", "drafts", "metadata")
STATE_SECTIONS = ("requests", "gpu_pool", "cpu_pool", "scheduler")
REQUEST_FIELDS = ("status", "num_tokens", "num_computed_tokens", "num_output_placeholders", "table")


# -- sides ---------------------------------------------------------------------------------------


class Side(Protocol):
    """One scheduler under comparison."""

    name: str

    def apply(self, op: dict[str, Any]) -> Any: ...
    def observed_step(self) -> StepObservation: ...
    def state(self) -> dict[str, Any]: ...


class RecordingTarget:
    """An ``OffloadTarget`` that forwards everything and keeps the last ``SchedulerOutput`` the
    engine planned with and the metadata it got back, so the engine's decisions can be observed."""

    def __init__(self, target: OffloadTarget) -> None:
        self._target = target
        self.last_output: SchedulerOutput | None = None
        self.last_meta: ConnectorMetadata | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        self.last_output = scheduler_output
        self.last_meta = self._target.build_connector_meta(scheduler_output)
        return self.last_meta


class EngineSide:
    """The engine over the model's ``baseline`` policy, scheduling as ``config.async_scheduling`` says."""

    name = "engine"

    def __init__(self, config: OffloadConfig) -> None:
        from kvspec.model import make_scheduler

        self.recorder = RecordingTarget(make_scheduler(replace(config, policy="baseline")))
        self.engine = Engine(cast(OffloadTarget, self.recorder))

    def apply(self, op: dict[str, Any]) -> Any:
        self.recorder.last_output = self.recorder.last_meta = None
        return self.engine.apply(op)

    def observed_step(self) -> StepObservation:
        return observe_step(self.recorder.last_output or SchedulerOutput(), self.recorder.last_meta)

    def state(self) -> dict[str, Any]:
        """The engine's snapshot in the driver's format (unfinished requests only). O(state)."""
        snap = self.engine.snapshot()
        requests = {rid: {key: r[key] for key in REQUEST_FIELDS}
                    for rid, r in snap["engine"]["requests"].items() if r["status"] != FINISHED}
        return {"gpu_pool": snap["gpu_pool"], "cpu_pool": snap["cpu_pool"], "scheduler": snap["scheduler"],
                "requests": requests}


class VllmSide:
    """vLLM's scheduler through ``VllmSchedulerDriver``: ``AsyncScheduler`` or ``Scheduler`` as
    ``options`` say, by default as ``config.async_scheduling`` says."""

    def __init__(self, config: OffloadConfig, options: SchedulerOptions | None = None) -> None:
        options = options or SchedulerOptions(async_scheduling=config.async_scheduling)
        self.driver = VllmSchedulerDriver(replace(config, policy="baseline"), options)
        self.name = "vLLM async" if self.driver.vllm.async_scheduling else "vLLM"

    def apply(self, op: dict[str, Any]) -> Any:
        return self.driver.apply(op)

    def observed_step(self) -> StepObservation:
        return self.driver.last_step

    def state(self) -> dict[str, Any]:
        return self.driver.snapshot()


# -- outcomes and divergences ----------------------------------------------------------------------


@dataclass
class Outcome:
    """How one side took an operation: ``ok``, ``rejected`` (error class), ``outside`` (no vLLM
    counterpart) or ``crash`` (exception class and message)."""

    kind: str
    detail: str = ""

    def same_as(self, other: Outcome) -> bool:
        def key(o: Outcome) -> tuple[str, str]:
            return o.kind, o.detail if o.kind == "rejected" else ""

        return key(self) == key(other)


def apply_op(side: Side, op: dict[str, Any]) -> Outcome:
    """``op`` (without its ``expect`` key) on ``side``; what happened."""
    clean = {k: v for k, v in op.items() if k != "expect"}
    try:
        side.apply(clean)
    except KVSpecError as exc:
        return Outcome("rejected", type(exc).__name__)
    except OutsideVllmError as exc:
        return Outcome("outside", str(exc))
    except Exception as exc:  # a crash of either side is a finding, named by its class
        return Outcome("crash", f"{type(exc).__name__}: {exc}")
    return Outcome("ok")


@dataclass
class Divergence:
    """The first disagreement of a trace."""

    op_index: int
    op: dict[str, Any]
    section: str
    detail: str
    sections: list[str] = field(default_factory=list)
    klass: str = "unclassified"

    def describe(self) -> str:
        return (f"operation {self.op_index} {self.op}: [{self.klass}] {self.section}: {self.detail}"
                f" (sections differing: {', '.join(self.sections)})")


def compare_sections(left: dict[str, Any], right: dict[str, Any], sections: tuple[str, ...]) -> list[tuple[str, str]]:
    """(section, first difference) for every one of ``sections`` that differs."""
    out = []
    for section in sections:
        d = first_difference(left[section], right[section], section)
        if d is not None:
            out.append((section, d))
    return out


# -- the lockstep ---------------------------------------------------------------------------------


class Lockstep:
    """Two sides fed the same operations."""

    def __init__(self, left: Side, right: Side) -> None:
        self.left, self.right = left, right
        self.ops_compared = 0

    def step(self, index: int, op: dict[str, Any]) -> Divergence | None:
        """Apply ``op`` to both sides; the divergence it causes, or None."""
        mine, theirs = apply_op(self.left, op), apply_op(self.right, op)
        if not mine.same_as(theirs):
            return Divergence(index, op, "outcome", f"{self.left.name} {mine.kind} {mine.detail!r} != "
                                                    f"{self.right.name} {theirs.kind} {theirs.detail!r}", ["outcome"])
        self.ops_compared += 1
        if mine.kind != "ok":
            return None
        diffs = []
        if op["op"] == "step":
            diffs += compare_sections(self.left.observed_step().to_json(), self.right.observed_step().to_json(),
                                      STEP_SECTIONS)
        diffs += compare_sections(self.left.state(), self.right.state(), STATE_SECTIONS)
        if not diffs:
            return None
        return Divergence(index, op, diffs[0][0], diffs[0][1], [s for s, _ in diffs])

    def run(self, ops: list[dict[str, Any]]) -> Divergence | None:
        """Apply ``ops`` in order; the first divergence, or None."""
        for i, op in enumerate(ops):
            if (d := self.step(i, op)) is not None:
                return d
        return None


def engine_vs_vllm(config: OffloadConfig, options: SchedulerOptions | None = None) -> Lockstep:
    """The engine (left) against vLLM (right), both scheduling as ``config.async_scheduling`` says
    (vLLM as ``options`` say, when given)."""
    return Lockstep(EngineSide(config), VllmSide(config, options))


def sync_vs_async(config: OffloadConfig) -> Lockstep:
    """vLLM's ``Scheduler`` (left) against its ``AsyncScheduler`` (right), both stopping requests at
    ``max_tokens`` themselves: what differs is what async scheduling does."""
    return Lockstep(VllmSide(config, SchedulerOptions(async_scheduling=False, auto_finish=True)),
                    VllmSide(config, SchedulerOptions(async_scheduling=True)))


def run_lockstep(config: OffloadConfig, ops: list[dict[str, Any]],
                 options: SchedulerOptions | None = None) -> tuple[Divergence | None, int]:
    """The first divergence of ``ops`` between the engine and vLLM, or None; and the operations
    compared."""
    lock = engine_vs_vllm(config, options)
    return lock.run(ops), lock.ops_compared
