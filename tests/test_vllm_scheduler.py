"""vLLM 0.33.0's real scheduler behind kvspec's engine operations, and the lockstep with the engine.

``kvspec.adapters.vllm_scheduler`` builds vLLM's ``Scheduler``/``AsyncScheduler`` with the real
SimpleCPUOffloadConnector from a real ``VllmConfig``; ``kvspec.drivers.scheduler_driver`` feeds
it the engine's operations; ``kvspec.drivers.lockstep`` compares it with the engine after every
operation and ``kvspec.drivers.divergence`` names the causes. These tests check that the
schedulers are built as vLLM builds them, that bad input is refused as the engine refuses it,
that hand-written streams and random traces agree with the engine operation by operation, and
that every saved divergence trace (tests/traces/vllm_scheduler/) is judged: one of the engine
against vLLM's synchronous or asynchronous scheduler shows a difference the engine once had and
must now agree throughout (a regression test); one of vLLM's sync scheduler against its async one
documents what async scheduling changes.

Marked ``vllm`` and skipped, with the reason, where vLLM 0.33.0 cannot be imported;
``KVSPEC_REQUIRE_VLLM=1`` (set by scripts/ci-vllm-stage.sh) makes that an error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvspec.adapters.vllm_scheduler import SchedulerOptions, scheduler_driver_available
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.drivers.trace import read

VLLM_OK, VLLM_WHY = scheduler_driver_available()
if os.environ.get("KVSPEC_REQUIRE_VLLM") == "1" and not VLLM_OK:
    raise RuntimeError(f"KVSPEC_REQUIRE_VLLM=1 but {VLLM_WHY}")

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")]

TRACES = Path(__file__).parent / "traces" / "vllm_scheduler"
ENGINE_MODES = ("engine", "engine-async")  # the engine against vLLM's sync and async schedulers
RANDOM_TRACES = int(os.environ.get("KVSPEC_VLLM_SCHEDULER_TRACES", "5"))  # per family and engine mode
ASYNC_TRACES = 5  # per family, vLLM sync against async


def add(rid: str, family: int, prompt_len: int, max_tokens: int = 1) -> dict[str, Any]:
    return {"op": "add", "rid": rid, "family": family, "prompt_len": prompt_len, "max_tokens": max_tokens}


def step(admit: tuple[str, ...] = (), chunk: int = 64, **kw: Any) -> dict[str, Any]:
    return {"op": "step", "admit": list(admit), "chunk": chunk, **kw}


def report(event: int, count: int = 1) -> dict[str, Any]:
    return {"op": "report", "event": event, "count": count}


def finish(rid: str) -> dict[str, Any]:
    return {"op": "finish", "rid": rid}


def _config(**kw: Any) -> OffloadConfig:
    """The hand-written streams' configuration: synchronous scheduling unless ``kw`` says otherwise
    (their comments tell what happens step by step under it)."""
    fields: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 10, "num_cpu_blocks": 12, "policy": "baseline",
                              "async_scheduling": False}
    return OffloadConfig(**{**fields, **kw})


# -- construction ---------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True, None])
def test_builds_vllms_scheduler_with_the_real_connector(async_scheduling: bool | None) -> None:
    """Sync and async schedulers are vLLM's own classes with the SimpleCPUOffloadConnector; left
    unset, vLLM 0.33.0 resolves async scheduling on; ``schedule()`` returns the connector's
    ``SimpleCPUOffloadMetadata``."""
    from kvspec.adapters.vllm_scheduler import VllmScheduler

    vllm = VllmScheduler(_config(world_size=2), SchedulerOptions(async_scheduling=async_scheduling),
                         lambda rid, n: 1000 + n)
    expected = "Scheduler" if async_scheduling is False else "AsyncScheduler"
    assert type(vllm.scheduler).__name__ == expected
    assert type(vllm.scheduler.connector).__name__ == "SimpleCPUOffloadConnector"
    assert vllm.manager.num_cpu_blocks == 12 and vllm.manager._expected_worker_count == 2
    vllm.add_request("r", list(range(9)), 2)
    out = vllm.scheduler.schedule()
    assert type(out.kv_connector_metadata).__name__ == "SimpleCPUOffloadMetadata"
    assert out.num_scheduled_tokens == {"r": 9}


def test_sliding_window_groups_become_vllm_specs() -> None:
    from kvspec.drivers.scheduler_driver import VllmSchedulerDriver

    driver = VllmSchedulerDriver(_config(groups=(KVGroup(), KVGroup("sliding", 6)), num_gpu_blocks=20))
    groups = driver.vllm.scheduler.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert groups[1].kv_cache_spec.sliding_window == 6


# -- bad input ------------------------------------------------------------------------------------


BAD_OPS = [
    {"op": "no-such-op"},
    {"op": "add", "rid": "", "family": 0, "prompt_len": 4},
    {"op": "add", "rid": "a", "family": 0, "prompt_len": 4},  # a exists
    {"op": "add", "rid": "z", "family": 0, "prompt_len": 0},
    {"op": "add", "rid": "z", "family": -1, "prompt_len": 4},
    {"op": "step", "chunk": 0},
    {"op": "step", "admit": ["a"]},  # a is running
    {"op": "step", "admit": "b"},
    {"op": "step", "preempt": ["b"]},  # b is waiting
    {"op": "step", "resume": "mrv3"},
    {"op": "step", "admit": ["b", "b"]},
    {"op": "step", "extra": 1},
    {"op": "report", "event": 99},
    {"op": "report", "event": 0, "count": 3},
    {"op": "report", "event": 0, "count": 0},
    {"op": "load_done", "rid": "a"},
    {"op": "finish", "rid": "nobody"},
    {"op": "finish", "rid": "c"},  # c finished
]


@pytest.mark.parametrize("bad", BAD_OPS, ids=[str(i) for i in range(len(BAD_OPS))])
def test_rejects_what_the_engine_rejects_and_changes_nothing(bad: dict[str, Any]) -> None:
    from kvspec.drivers.lockstep import apply_op, engine_vs_vllm

    lock = engine_vs_vllm(_config(world_size=2))
    for i, op in enumerate([add("a", 0, 12), add("b", 1, 4), add("c", 2, 4), finish("c"), step(("a",), 8),
                            step(chunk=8)]):
        assert lock.step(i, op) is None
    assert lock.right.driver.reports_left == {0: 2}
    before = lock.right.state()
    engine, vllm = apply_op(lock.left, bad), apply_op(lock.right, bad)
    assert engine.kind == "rejected", engine
    assert (vllm.kind, vllm.detail) == (engine.kind, engine.detail)
    assert lock.right.state() == before


# -- hand-written streams --------------------------------------------------------------------------

CPU_HIT_STREAM = [
    # a prefills in two chunks and decodes; its two full blocks are stored (two ranks report)
    add("a", 0, 8), step(("a",), 4), step(chunk=4), step(), report(0), report(0), report(1, 2), finish("a"),
    # b takes the whole GPU pool, evicting a's blocks, and its finish flushes its own blocks
    add("b", 1, 35, max_tokens=1), step(("b",), 35), finish("b"),
    # c shares a's prefix: no room until the flush lands, then a CPU hit loaded asynchronously
    add("c", 0, 9), step(("c",)), report(2, 2), step(("c",)), {"op": "load_done", "rid": "c"}, step(), step(),
    finish("c"), {"op": "reset"},
]
STREAMS = {
    "cpu-hit-load": (_config(world_size=2), CPU_HIT_STREAM),
    "preempt-and-resume": (_config(num_gpu_blocks=16, world_size=3), [
        add("a", 0, 10, 3), step(("a",)), step(), report(0, 3), step(preempt=["a"], resume="mrv1"),
        step(("a",), resume="mrv1"), step(), step(), finish("a")]),
    "finish-in-every-phase": (_config(num_gpu_blocks=16), [
        add("w", 0, 6), add("r", 1, 6), finish("w"), step(("r",), 4), finish("r"), add("p", 2, 9), step(("p",)),
        step(preempt=["p"]), finish("p"), add("q", 3, 5), step(("q",)), {"op": "reset"}, step(), finish("q")]),
    "sliding-window": (_config(num_gpu_blocks=24, groups=(KVGroup(), KVGroup("sliding", 6))), [
        add("a", 0, 14, 3), step(("a",), 8), step(chunk=8), step(), step(), report(0), report(1), finish("a")]),
    "lazy": (_config(num_gpu_blocks=16, lazy_offload=True, max_num_batched_tokens=16), [
        add("a", 0, 12, 2), step(("a",)), step(), finish("a"), add("b", 1, 30), step(("b",)), finish("b")]),
    # three requests share a 10-token budget under a threshold of 4: a and b get 4, c the 2 left;
    # alone, a request is not held to the threshold (vLLM drops it) and takes the whole budget
    "token-budget": (_config(num_gpu_blocks=24), [
        add("a", 0, 9), add("b", 1, 9), add("c", 2, 9), step(("a", "b", "c"), 4, budget=10),
        step(chunk=4, budget=3), finish("b"), finish("c"), step(chunk=2, budget=10)]),
    # the running queue is in admission order, and a failed allocation preempts from its tail
    "admission-order-and-preemption": (_config(num_gpu_blocks=6), [
        add("a", 0, 4, 8), add("b", 1, 4, 8), step(("b",)), step(("a",)), *[step()] * 8]),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", list(STREAMS))
def test_hand_written_streams_agree_with_the_engine_after_every_operation(name: str, async_scheduling: bool) -> None:
    from dataclasses import replace

    from kvspec.drivers.lockstep import run_lockstep

    config, ops = STREAMS[name]
    d, compared = run_lockstep(replace(config, async_scheduling=async_scheduling), ops)
    assert d is None, d.describe() if d else ""
    assert compared == len(ops)


def test_the_cpu_hit_stream_really_loads_from_the_cpu() -> None:
    """The stream above is not vacuous: c's prefix comes back from the CPU through a load."""
    from kvspec.drivers.lockstep import engine_vs_vllm

    lock = engine_vs_vllm(STREAMS["cpu-hit-load"][0])
    loads = []
    for i, op in enumerate(CPU_HIT_STREAM):
        assert lock.step(i, op) is None
        if op["op"] == "step":
            loads.append(lock.right.observed_step().metadata["load_event"])
    assert 0 in loads


def test_the_token_budget_stream_shares_the_budget() -> None:
    """The budget stream is not vacuous: in its first step the three requests get 4, 4 and 2 tokens."""
    from kvspec.drivers.lockstep import engine_vs_vllm

    config, ops = STREAMS["token-budget"]
    lock = engine_vs_vllm(config)
    for i, op in enumerate(ops[:4]):
        assert lock.step(i, op) is None
    assert lock.right.observed_step().scheduled == [("a", 4), ("b", 4), ("c", 2)]


def test_the_preemption_stream_preempts_from_the_tail() -> None:
    """The preemption stream is not vacuous: when the pool runs out, vLLM itself preempts a, the
    tail of the running queue (admitted after b, though created before it)."""
    from kvspec.drivers.lockstep import engine_vs_vllm

    config, ops = STREAMS["admission-order-and-preemption"]
    lock = engine_vs_vllm(config)
    preempted = []
    for i, op in enumerate(ops):
        assert lock.step(i, op) is None
        if op["op"] == "step":
            preempted += lock.right.observed_step().preempted
    assert preempted == ["a"]


def test_a_divergence_is_reported_where_it_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lockstep is not blind: an engine that puts each admitted request at the head of its
    running queue (vLLM appends it) diverges from vLLM at the step after two admissions made in
    reverse creation order, in the order of the scheduled requests."""
    from kvspec.drivers.engine import Engine
    from kvspec.drivers.lockstep import run_lockstep

    start = Engine._start

    def start_at_head(self: Engine, r: Any, *args: Any) -> None:
        start(self, r, *args)
        self.running.insert(0, self.running.pop())

    config = _config(num_gpu_blocks=16)
    ops = [add("a", 0, 4, 4), add("b", 1, 4, 4), step(("b",)), step(("a",)), step()]
    assert run_lockstep(config, ops)[0] is None
    monkeypatch.setattr(Engine, "_start", start_at_head)
    d, _ = run_lockstep(config, ops)
    assert d is not None and d.op_index == 4 and d.section == "scheduled", d


def test_preempting_a_loaded_request_is_refused_by_both() -> None:
    """vLLM preempts running requests only; a request whose load completed waits to be scheduled,
    so both sides refuse to preempt it, with the same error, and nothing changes."""
    from kvspec.drivers.lockstep import apply_op, engine_vs_vllm

    lock = engine_vs_vllm(_config(world_size=2))
    prefix = CPU_HIT_STREAM[: CPU_HIT_STREAM.index({"op": "load_done", "rid": "c"}) + 1]
    for i, op in enumerate(prefix):
        assert lock.step(i, op) is None
    assert lock.right.driver.status("c") == "loaded"
    before = lock.left.state(), lock.right.state()
    engine, vllm = apply_op(lock.left, step(preempt=["c"])), apply_op(lock.right, step(preempt=["c"]))
    assert (engine.kind, engine.detail) == (vllm.kind, vllm.detail) == ("rejected", "InvalidOperationError")
    assert (lock.left.state(), lock.right.state()) == before


# -- async scheduling -------------------------------------------------------------------------------


def test_async_scheduling_runs_one_batch_ahead() -> None:
    """Under async scheduling a step's sampled token is a placeholder until the next step
    processes its output (engine core's batch queue); sync has the token at once."""
    from kvspec.drivers.lockstep import sync_vs_async

    lock = sync_vs_async(_config())
    for i, op in enumerate([add("a", 0, 6, 3), step(("a",))]):
        lock.step(i, op)
    sync, asynchronous = lock.left.state()["requests"]["a"], lock.right.state()["requests"]["a"]
    assert (sync["num_tokens"], sync["num_output_placeholders"]) == (7, 0)
    assert (asynchronous["num_tokens"], asynchronous["num_output_placeholders"]) == (6, 1)
    lock.step(2, step())
    assert lock.right.state()["requests"]["a"]["num_tokens"] == 7


# -- random traces ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_random_traces_agree_with_vllms_scheduler(mode: str) -> None:
    """Random traces of every configuration family (budgets, preemption pressure, small CPU pools,
    sliding-window CPU hits; 3 % invalid operations): the engine and vLLM's synchronous
    (``engine``) or asynchronous (``engine-async``, vLLM's default) scheduler agree after every
    operation of every trace."""
    from kvspec.drivers.divergence import FAMILIES, measure

    for family in FAMILIES:
        tally = measure(mode, family, seed=1, count=RANDOM_TRACES, n_ops=120)
        found = {k: e.divergence.describe() for k, e in tally.examples.items()}
        assert tally.agreeing == tally.traces == RANDOM_TRACES, f"{mode} / {family}: {found}"
        assert tally.ops == RANDOM_TRACES * 120
    print(f"\n[vllm scheduler lockstep] {mode}: {RANDOM_TRACES} traces x 120 operations per family agree")


def test_async_traces_reach_the_async_rules() -> None:
    """The engine-async traces exercise what async scheduling adds, counted by the engine on the
    traces the lockstep compares: blocks freed only after the batch in flight, output of a
    preempted request appended on return, requests stopped at max_tokens in the processing step,
    the running pass passing over a request whose placeholders reach max_tokens, and a preemption
    refused because the victim's blocks are in flight."""
    seen = _rules_reached(async_scheduling=True)
    assert all(seen.get(rule) for rule in ENGINE_ASYNC_RULES), seen
    print(f"\n[vllm scheduler lockstep] engine-async rules reached: {seen}")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_traces_reach_the_speculative_decoding_rules(async_scheduling: bool) -> None:
    """The lockstep's traces with speculative decoding exercise its rules in both modes: drafts
    scheduled, accepted and rejected (computed tokens lowered again), decodes admitted from the
    waiting queue padded to 1 + k tokens and padding refused by the budget; under async
    scheduling tokens accepted past max_tokens dropped, under sync scheduling the drafter's
    proposals."""
    seen = _rules_reached(async_scheduling)
    rules = SPEC_RULES + (("tokens past max_tokens dropped",) if async_scheduling else ("drafts proposed",))
    assert all(seen.get(rule) for rule in rules), seen
    mode = "async" if async_scheduling else "sync"
    print(f"\n[vllm scheduler lockstep] speculative-decoding rules reached ({mode}): "
          f"{ {rule: seen[rule] for rule in rules} }")


def _rules_reached(async_scheduling: bool) -> dict[str, int]:
    """How often each rule the engine counts applied on the lockstep's random traces (seed 1)."""
    from dataclasses import replace

    from kvspec.drivers.divergence import FAMILIES, traces
    from kvspec.drivers.lockstep import EngineSide, apply_op

    seen: dict[str, int] = {}
    for family in FAMILIES:
        for config, ops in traces(family, 1, RANDOM_TRACES, 120):
            side = EngineSide(replace(config, async_scheduling=async_scheduling))
            for op in ops:
                apply_op(side, op)
            for name, n in side.engine.rule_counts.items():
                seen[name] = seen.get(name, 0) + n
    return seen


ENGINE_ASYNC_RULES = ("deferred free", "stale output appended", "stop at max_tokens", "placeholders reach max_tokens",
                      "no preemption of a request in flight")
SPEC_RULES = ("drafts scheduled", "drafts accepted", "drafts rejected", "decode padded",
              "padded decode refused by the budget")


def test_random_traces_of_async_scheduling_differ_for_known_causes() -> None:
    """vLLM's sync scheduler against its async one: each first divergence has a known cause of
    async scheduling; none crashes."""
    from kvspec.drivers.divergence import FAMILIES, UNCLASSIFIED, measure

    seen: dict[str, int] = {}
    for family in FAMILIES:
        tally = measure("async", family, seed=1, count=ASYNC_TRACES, n_ops=120)
        unknown = {k: tally.examples[k].divergence.describe() for k in tally.classes
                   if k.endswith(UNCLASSIFIED) or "crash" in k}
        assert not unknown, f"async / {family}: divergences of no known cause: {unknown}"
        assert tally.ops > 0
        for klass, n in tally.classes.items():
            seen[klass] = seen.get(klass, 0) + n
    print(f"\n[vllm scheduler lockstep] async: {ASYNC_TRACES} traces per family; first divergences: {seen}")


# -- saved divergence traces ------------------------------------------------------------------------


def _saved() -> list[Any]:
    from kvspec.drivers.divergence import recorded_divergence

    params = []
    for path in sorted(TRACES.glob("*.jsonl")):
        mode, klass = recorded_divergence(read(path))
        params.append(pytest.param(path, mode, klass, id=path.stem))
    return params


def test_there_are_saved_traces() -> None:
    modes = [recorded_divergence_mode(path) for path in TRACES.glob("*.jsonl")]
    assert modes.count("engine") >= 10 and "async" in modes and "engine-async" in modes


def recorded_divergence_mode(path: Path) -> str:
    from kvspec.drivers.divergence import recorded_divergence

    return recorded_divergence(read(path))[0]


@pytest.mark.parametrize(("path", "mode", "klass"), _saved())
def test_saved_trace_shows_its_divergence(path: Path, mode: str, klass: str) -> None:
    """A trace of the engine against vLLM's sync or async scheduler, which once diverged with the
    recorded class, now agrees throughout; one of vLLM sync against async shows its difference."""
    from kvspec.drivers.divergence import first_divergence

    trace = read(path)
    d, compared = first_divergence(mode, trace.config, trace.ops)
    if mode == "async":
        assert d is not None and d.klass == klass, d.describe() if d else "no divergence"
        return
    assert d is None, f"the engine differs from vLLM again ({klass}): {d.describe()}"
    assert compared == len(trace.ops)
