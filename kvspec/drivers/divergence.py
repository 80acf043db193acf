"""Where kvspec's engine model and vLLM's real scheduler differ: causes, measurement, shrinking.

``classify(config, ops, d)`` names the cause of the first divergence ``d`` of a trace
between the engine and vLLM's synchronous scheduler (``kvspec.drivers.lockstep``). It
replays the trace up to ``d`` and judges, in this order:

``RULES``, predicates of the operation and of both sides' states just before and just after it
(vLLM preempted a request the operation did not name, vLLM nulled a block the engine kept, ...),
each naming a difference the engine once had, so that one coming back is recognised; and
``"unclassified"`` otherwise (the engine matches vLLM's synchronous scheduler on every trace
measured, so a divergence there is new). ``classify_async`` does the same for vLLM's synchronous
scheduler against its asynchronous one: what differs there is inherent to async scheduling.
``measure`` runs random traces of a configuration family and counts the classes of their
first divergences; ``shrink`` cuts a trace down while its class stays the same.
``python -m kvspec.drivers.divergence`` prints a measurement (run it in the vLLM venv).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from kvspec.adapters.vllm_scheduler import SchedulerOptions, StepObservation
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.drivers.lockstep import (
    Divergence,
    Lockstep,
    VllmSide,
    engine_vs_vllm,
    run_lockstep,
    sync_vs_async,
)
from kvspec.drivers.trace import Trace
from kvspec.drivers.tracegen import random_ops

NULL_BLOCK = 0
ADMISSIBLE = ("waiting", "preempted")

# -- evidence ---------------------------------------------------------------------------------------


@dataclass
class Evidence:
    """Both sides' states just before and just after the diverging operation, and what vLLM's
    scheduler held before it."""

    config: OffloadConfig
    op: dict[str, Any]
    left_before: dict[str, Any]
    left_after: dict[str, Any]
    right_before: dict[str, Any]
    right_after: dict[str, Any]
    left_step: StepObservation | None
    right_step: StepObservation | None
    right_idle: bool
    reserved_blocks: int  # what vLLM's in-flight prefills reserved, before or after the operation


def gather_evidence(lock: Lockstep, ops: list[dict[str, Any]], index: int) -> Evidence:
    """Replay ``ops[:index]`` on a fresh ``lock``, then capture the states around ``ops[index]``.
    The right side must be a ``VllmSide``. O(trace)."""
    assert isinstance(lock.right, VllmSide)
    vllm = lock.right.driver.vllm
    for i, op in enumerate(ops[:index]):
        lock.step(i, op)
    left_before, right_before = lock.left.state(), lock.right.state()
    reserved = int(vllm.scheduler._inflight_prefill_reserved_blocks())
    lock.step(index, ops[index])
    reserved = max(reserved, int(vllm.scheduler._inflight_prefill_reserved_blocks()))
    op = ops[index]
    stepped = op["op"] == "step"
    return Evidence(
        config=vllm.config, op=op, left_before=left_before, left_after=lock.left.state(),
        right_before=right_before, right_after=lock.right.state(),
        left_step=lock.left.observed_step() if stepped else None,
        right_step=lock.right.observed_step() if stepped else None,
        right_idle=stepped and vllm.last_step_idle, reserved_blocks=reserved,
    )


@dataclass(frozen=True)
class TableDifference:
    """One block-table position where the two sides hold different blocks."""

    rid: str
    group: int
    position: int
    left_block: int
    right_block: int


def table_differences(left: dict[str, Any], right: dict[str, Any]) -> list[TableDifference]:
    """Every position of every unfinished request's table (on both sides) that differs. O(tables)."""
    out = []
    for rid in sorted(left["requests"].keys() & right["requests"].keys()):
        tables = zip(left["requests"][rid]["table"], right["requests"][rid]["table"], strict=True)
        for g, (mine, theirs) in enumerate(tables):
            common = zip(mine, theirs, strict=False)  # a table may be longer on one side
            out += [TableDifference(rid, g, p, a, b) for p, (a, b) in enumerate(common) if a != b]
    return out


def _statuses(state: dict[str, Any]) -> dict[str, str]:
    return {rid: r["status"] for rid, r in state["requests"].items()}


def _sliding(ev: Evidence, g: int) -> bool:
    return ev.config.groups[g].kind == "sliding"


def _window_blocks(ev: Evidence, left_null: bool, rids: set[str] | None = None) -> bool:
    """Some sliding-window position of a request (of ``rids``, if given) is null on exactly one side:
    the left one if ``left_null``."""
    for t in table_differences(ev.left_after, ev.right_after):
        null_here, block_there = (t.left_block, t.right_block) if left_null else (t.right_block, t.left_block)
        if null_here == NULL_BLOCK and block_there != NULL_BLOCK and _sliding(ev, t.group) \
                and (rids is None or t.rid in rids):
            return True
    return False


# -- the engine against vLLM: rules ----------------------------------------------------------------

Rule = Callable[[Divergence, Evidence], bool]


def _outside(d: Divergence, ev: Evidence) -> bool:
    return d.section == "outcome" and " outside " in d.detail


def _vllm_crash(d: Divergence, ev: Evidence) -> bool:
    return d.section == "outcome" and " crash " in d.detail.split("!=")[-1]


def _idle_step(d: Divergence, ev: Evidence) -> bool:
    return ev.right_idle


def _vllm_preempts(d: Divergence, ev: Evidence) -> bool:
    """vLLM preempted a request the operation did not name (an allocation failed)."""
    asked = set(ev.op.get("preempt") or ())
    return ev.right_step is not None and bool(set(ev.right_step.preempted) - asked)


def _window_freed_unscheduled(d: Divergence, ev: Evidence) -> bool:
    """The engine nulled a sliding-window block of a running request it gave no tokens."""
    if ev.left_step is None:
        return False
    idle = {rid for rid, s in _statuses(ev.left_before).items() if s == "running"} - dict(ev.left_step.scheduled).keys()
    return _window_blocks(ev, left_null=True, rids=idle)


def _mrv2_order(d: Divergence, ev: Evidence) -> bool:
    if ev.left_step is None or ev.right_step is None or d.section != "new_reqs":
        return False
    mine, theirs = ev.left_step.to_json()["new_reqs"], ev.right_step.to_json()["new_reqs"]
    return ev.op.get("resume") == "mrv2" and sorted(mine) == sorted(theirs)


def _loaded_resumes(d: Divergence, ev: Evidence) -> bool:
    """vLLM schedules a loaded request that had been preempted as resumed; the engine as new."""
    if ev.left_step is None or ev.right_step is None:
        return False
    new = {rid for rid, _ in ev.left_step.new_reqs}
    resumed = {rid for rid, _, was_resumed in ev.right_step.cached_reqs if was_resumed}
    loaded = {rid for rid, s in _statuses(ev.left_before).items() if s == "loaded"}
    return bool(new & resumed & loaded)


def _loaded_blocks_admission(d: Divergence, ev: Evidence) -> bool:
    """A loaded request vLLM could not allocate for stayed loaded, in a step that admits others:
    vLLM stops its waiting queue there, the engine admits on."""
    still_loaded = {rid for rid, s in _statuses(ev.right_after).items() if s == "loaded"}
    was_loaded = {rid for rid, s in _statuses(ev.left_before).items() if s == "loaded"}
    return bool(ev.op.get("admit")) and bool(was_loaded & still_loaded)


def _load_reservation(d: Divergence, ev: Evidence) -> bool:
    """The engine started a load that vLLM refused while in-flight prefills reserved blocks."""
    theirs = _statuses(ev.right_after)
    return ev.reserved_blocks > 0 and any(
        s == "waiting_for_remote_kvs" and theirs.get(rid) in ADMISSIBLE for rid, s in _statuses(ev.left_after).items())


def _window_admission(d: Divergence, ev: Evidence) -> bool:
    """vLLM admitted a request of a sliding-window configuration that the engine left waiting."""
    theirs = _statuses(ev.right_after)
    return any(g.kind == "sliding" for g in ev.config.groups) and any(
        s in ADMISSIBLE and theirs.get(rid) in ("waiting_for_remote_kvs", "running")
        for rid, s in _statuses(ev.left_after).items())


def _local_hit_kept(d: Divergence, ev: Evidence) -> bool:
    """vLLM nulled a sliding-window block of a request admitted in this step; the engine kept it."""
    admitted = {rid for rid, s in _statuses(ev.left_before).items() if s in ADMISSIBLE}
    return _window_blocks(ev, left_null=False, rids=admitted)


def _vllm_finishes(d: Divergence, ev: Evidence) -> bool:
    """vLLM finished a request in a step (it sampled its last token); the engine still runs it."""
    return ev.op["op"] == "step" and bool(ev.left_after["requests"].keys() - ev.right_after["requests"].keys())


CLASS_PREEMPTS = "vLLM preempts when an allocation fails"
CLASS_OUTSIDE = "no vLLM counterpart for the operation"
CLASS_FINISHES = "vLLM finishes a request in the step that samples its last token"
RULES: list[tuple[str, Rule]] = [
    (CLASS_OUTSIDE, _outside),
    ("vLLM crashed", _vllm_crash),
    ("idle step: engine core does not schedule without requests", _idle_step),
    (CLASS_PREEMPTS, _vllm_preempts),
    ("out-of-window blocks freed for a request given no tokens", _window_freed_unscheduled),
    ("mrv2: resumed requests listed after new ones", _mrv2_order),
    ("a loaded request that had been preempted resumes (engine: starts as new)", _loaded_resumes),
    ("a loaded request that cannot be allocated stops vLLM's admissions (engine: admits on)",
     _loaded_blocks_admission),
    (CLASS_FINISHES, _vllm_finishes),
    ("an async load is admitted only beside in-flight prefills' reserved blocks", _load_reservation),
    ("sliding-window admission with a CPU hit", _window_admission),
    ("local-hit sliding-window blocks pushed out of the window kept", _local_hit_kept),
]
UNCLASSIFIED = "unclassified"


def classify(config: OffloadConfig, ops: list[dict[str, Any]], d: Divergence,
             options: SchedulerOptions | None = None) -> str:
    """The cause of ``d``, the first divergence of ``ops`` between the engine and vLLM under
    ``options`` (``RULES``, in order). O(trace)."""
    ev = gather_evidence(engine_vs_vllm(config, options), ops, d.op_index)
    for klass, rule in RULES:
        if rule(d, ev):
            return klass
    return UNCLASSIFIED


# -- vLLM synchronous against asynchronous ----------------------------------------------------------


def _token_later(d: Divergence, ev: Evidence) -> bool:
    """A sampled token is still a placeholder under async scheduling."""
    return any(r.get("num_output_placeholders", 0) > 0 for r in ev.right_after["requests"].values()) and any(
        rid in ev.left_after["requests"] and ev.left_after["requests"][rid]["num_tokens"] != r["num_tokens"]
        for rid, r in ev.right_after["requests"].items())


def _finish_later(d: Divergence, ev: Evidence) -> bool:
    """A request that finished under sync scheduling is still unfinished under async."""
    return bool(ev.right_after["requests"].keys() - ev.left_after["requests"].keys())


def _no_preemption_in_flight(d: Divergence, ev: Evidence) -> bool:
    """Sync vLLM preempted a request to make room; async did not, since the victim's blocks are
    still written by the batch in flight (a deferred free would not help now)."""
    if ev.left_step is None or ev.right_step is None:
        return False
    asked = set(ev.op.get("preempt") or ())
    return bool(set(ev.left_step.preempted) - asked) and not set(ev.right_step.preempted) - asked


def _free_later(d: Divergence, ev: Evidence) -> bool:
    """An abort or a preemption freed blocks under sync scheduling that async frees only after the
    batch in flight (``defer_block_free``)."""
    freed_now = ev.op["op"] == "finish" or bool(ev.op.get("preempt"))
    return freed_now and ev.left_after["gpu_pool"] != ev.right_after["gpu_pool"]


def _window_later(d: Divergence, ev: Evidence) -> bool:
    """A sliding-window block left the window under sync scheduling and not yet under async."""
    return _window_blocks(ev, left_null=True)


ASYNC_RULES: list[tuple[str, Rule]] = [
    ("async: no preemption while the victim's blocks are in flight (the running loop stops)",
     _no_preemption_in_flight),
    ("async: blocks of an aborted or preempted request freed after the batch in flight", _free_later),
    ("async: a request stops one step later (its last token is processed with the next batch)", _finish_later),
    ("async: out-of-window blocks freed a step later (processed-token basis)", _window_later),
    ("async: sampled tokens arrive one step later (output placeholders)", _token_later),
]


def classify_async(config: OffloadConfig, ops: list[dict[str, Any]], d: Divergence) -> str:
    """The cause of ``d``, the first divergence of ``ops`` between vLLM's sync and async
    schedulers (``ASYNC_RULES``, in order). O(trace)."""
    ev = gather_evidence(sync_vs_async(config), ops, d.op_index)
    for klass, rule in ASYNC_RULES:
        if rule(d, ev):
            return klass
    return "async: " + UNCLASSIFIED


# -- measurement ------------------------------------------------------------------------------------


def random_config(rng: random.Random, family: str) -> OffloadConfig:
    """A configuration of ``family``: block sizes 1-16, one to three full/sliding groups, world sizes
    1-3, eager or lazy. ``mixed`` draws pools of every size; ``pressure`` has GPU pools near one
    request's need (preemption); ``small-cpu`` CPU pools below the working set; ``window-hits`` a
    sliding-window group always, a large CPU pool and a GPU pool small enough for its cached blocks
    to be evicted (CPU hits). Every family has n-gram speculative decoding with 1-3 drafts in 3 of
    5 configurations."""
    bs = rng.choice([1, 2, 3, 4, 5, 8, 16])
    groups = [KVGroup()]
    extra = rng.choice([1, 1, 2]) if family == "window-hits" else rng.choice([0, 0, 1, 1, 2])
    for i in range(extra):
        sliding = rng.random() < 0.8 or (family == "window-hits" and i == 0)
        groups.append(KVGroup("sliding", rng.randint(2, 4 * bs + 3)) if sliding else KVGroup())
    rng.shuffle(groups)
    gpu_per_group = {"pressure": (6, 12), "small-cpu": (16, 40), "window-hits": (12, 24)}.get(family, (6, 40))
    cpu = {"small-cpu": (2, 5), "window-hits": (20, 40)}.get(family, (2, 30))
    return OffloadConfig(block_size=bs, num_gpu_blocks=rng.randint(*gpu_per_group) * len(groups),
                         num_cpu_blocks=rng.randint(*cpu), groups=tuple(groups), world_size=rng.choice([1, 2, 3]),
                         lazy_offload=rng.random() < 0.25, max_num_batched_tokens=rng.choice([bs, 4 * bs, 64]),
                         policy="baseline", num_speculative_tokens=rng.choice([0, 0, 1, 2, 3]))


FAMILIES = ("mixed", "pressure", "small-cpu", "window-hits")
MODES = ("engine", "async", "engine-async")


def traces(family: str, seed: int, count: int, n_ops: int) -> Iterator[tuple[OffloadConfig, list[dict[str, Any]]]]:
    """``count`` random (configuration, trace) pairs of ``family``, deterministic in ``seed``."""
    for i in range(count):
        rng = random.Random(f"{family}:{seed}:{i}")
        config = random_config(rng, family)
        yield config, random_ops(config, rng, n_ops, num_families=rng.choice([1, 2, 3]), invalid_rate=0.03)


@dataclass
class Example:
    """The first trace that showed a class: its configuration, operations up to the divergence, and
    the divergence."""

    config: OffloadConfig
    ops: list[dict[str, Any]]
    divergence: Divergence


@dataclass
class Tally:
    """Traces and operations compared, and first-divergence classes, for one family and mode."""

    traces: int = 0
    ops: int = 0
    agreeing: int = 0
    classes: Counter[str] = field(default_factory=Counter)
    examples: dict[str, Example] = field(default_factory=dict)

    def add(self, config: OffloadConfig, ops: list[dict[str, Any]], d: Divergence | None, compared: int) -> None:
        self.traces += 1
        self.ops += compared
        if d is None:
            self.agreeing += 1
            return
        self.classes[d.klass] += 1
        self.examples.setdefault(d.klass, Example(config, ops[: d.op_index + 1], d))


def first_divergence(mode: str, config: OffloadConfig, ops: list[dict[str, Any]]) -> tuple[Divergence | None, int]:
    """The classified first divergence of ``ops`` in ``mode`` (``MODES``): the engine against vLLM's
    sync scheduler; vLLM sync against async; or the engine against vLLM async (classified as the engine-against-sync
    class when sync vLLM already differs from the engine by then, else as the async class)."""
    if mode == "async":
        lock = sync_vs_async(config)
        d = lock.run(ops)
        if d is not None:
            d.klass = classify_async(config, ops, d)
        return d, lock.ops_compared
    config = replace(config, async_scheduling=mode == "engine-async")
    options = SchedulerOptions(async_scheduling=config.async_scheduling)
    d, compared = run_lockstep(config, ops, options)
    if d is not None:
        d.klass = classify(config, ops, d, options)
    return d, compared


def measure(mode: str, family: str, seed: int, count: int, n_ops: int) -> Tally:
    """``count`` random traces of ``family`` compared in ``mode``; classes of the first divergences."""
    tally = Tally()
    for config, ops in traces(family, seed, count, n_ops):
        d, compared = first_divergence(mode, config, ops)
        tally.add(config, ops, d, compared)
    return tally


# -- shrinking --------------------------------------------------------------------------------------


def shrink(mode: str, config: OffloadConfig, ops: list[dict[str, Any]], klass: str,
           deadline: float) -> list[dict[str, Any]]:
    """Delta debugging: drop chunks of operations while the first divergence in ``mode`` keeps class
    ``klass``; the trace is cut after its divergence. Stops at ``deadline``. O(rounds x trace)."""
    best = list(ops)
    chunk = max(1, len(best) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, progress = 0, False
        while i < len(best) and time.monotonic() < deadline:
            candidate = best[:i] + best[i + chunk:]
            d, _ = first_divergence(mode, config, candidate)
            if d is not None and d.klass == klass:
                best, progress = candidate[: d.op_index + 1], True
            else:
                i += chunk
        if not progress:
            chunk //= 2
    return best


# -- saved traces ------------------------------------------------------------------------------------

TRACE_TARGET = "vllm-scheduler"


def slug(klass: str) -> str:
    """A file name for a class: its words, lower case, joined by dashes (at most 60 characters)."""
    return re.sub(r"[^a-z0-9]+", "-", klass.lower()).strip("-")[:60].rstrip("-")


def example_trace(mode: str, example: Example) -> Trace:
    """``example`` as a trace file: the header's note starts with one JSON line naming the mode and
    the class (what ``recorded_divergence`` reads back), then the divergence in words."""
    d = example.divergence
    head = json.dumps({"mode": mode, "class": d.klass}, sort_keys=True)
    return Trace(example.config, example.ops, target=TRACE_TARGET, note=f"{head}\n{d.describe()}",
                 finding={"kind": "divergence", "op_index": d.op_index, "invariant": None, "exception": None})


def recorded_divergence(trace: Trace) -> tuple[str, str]:
    """(mode, class) of a trace written by ``example_trace``."""
    head = json.loads(trace.note.splitlines()[0])
    return str(head["mode"]), str(head["class"])


def save_examples(mode: str, examples: dict[str, Example], out: str, shrink_seconds: float) -> list[str]:
    """Shrink the example of each class and write it under ``out`` (one file per mode and class,
    replaced if there); the paths written."""
    written = []
    for klass, example in sorted(examples.items()):
        if klass.endswith(UNCLASSIFIED):
            continue
        ops = shrink(mode, example.config, example.ops, klass, time.monotonic() + shrink_seconds)
        d, _ = first_divergence(mode, example.config, ops)
        assert d is not None and d.klass == klass, "shrink keeps the class"
        path = f"{out}/{mode}--{slug(klass)}.jsonl"
        example_trace(mode, Example(example.config, ops, d)).write(path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """Print the measurement of each family in each mode (``--help`` for the options)."""
    parser = argparse.ArgumentParser(prog="python -m kvspec.drivers.divergence")
    parser.add_argument("--traces", type=int, default=20, help="traces per family")
    parser.add_argument("--ops", type=int, default=150, help="operations per trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=FAMILIES, action="append")
    parser.add_argument("--mode", choices=MODES, action="append")
    parser.add_argument("--verbose", action="store_true", help="show the first divergence of each class")
    parser.add_argument("--save", metavar="DIR", help="write a shrunk trace of each class found under DIR")
    parser.add_argument("--shrink-seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    saved: set[tuple[bool, str]] = set()  # (vLLM against vLLM?, class) written by an earlier mode
    for mode in args.mode or MODES:
        examples: dict[str, Example] = {}
        for family in args.family or FAMILIES:
            start = time.monotonic()
            tally = measure(mode, family, args.seed, args.traces, args.ops)
            print(f"{mode} / {family}: {tally.traces} traces, {tally.ops} operations compared, "
                  f"{tally.agreeing} agree throughout ({time.monotonic() - start:.0f} s)")
            for klass, n in tally.classes.most_common():
                print(f"  {n:4d}  {klass}")
                if args.verbose:
                    print(f"        e.g. {tally.examples[klass].divergence.describe()}")
            examples = {**tally.examples, **examples}
            sys.stdout.flush()
        fresh = {k: e for k, e in examples.items() if (mode == "async", k) not in saved}
        saved |= {(mode == "async", k) for k in fresh}
        for path in save_examples(mode, fresh, args.save, args.shrink_seconds) if args.save else ():
            print(f"  wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
