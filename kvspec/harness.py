"""One harness for every target: the Hypothesis state machine, the fuzzer and ``replay``.

* ``make_state_machine(factory, reference=None, oracle=None)`` returns a
  ``RuleBasedStateMachine`` class that drives ``Engine(factory(config))`` through
  everything the engine model can do (bundles for requests, preconditions for what
  needs state), checks the invariant catalogue after every step (``@invariant``),
  compares snapshots with a reference target when given, records ``event()`` for
  the rare paths and ``target()``s them, and writes every failure as a trace.
* ``fuzz(...)`` is the budgeted random search used by ``kvspec fuzz``/``bugs``:
  state-aware random operations (``kvspec.opgen``), the oracle after every
  operation, and delta-debugging shrinking of the failing trace.
* ``replay(trace, factory)`` reports the first violation or divergence.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvspec.errors import KVSpecError
from kvspec.interfaces import KVGroup, OffloadConfig
from kvspec.model.engine import Engine
from kvspec.model.invariants import CATALOGUE, Violation, check, covered_keys, owned_below_cursor
from kvspec.opgen import next_op, random_config_kwargs
from kvspec.targets import TargetFactory
from kvspec.trace import Trace


def default_oracle(config: OffloadConfig) -> tuple[str, ...]:
    """The invariants the configured model policy claims."""
    from kvspec.model import POLICY_CLASSES

    return POLICY_CLASSES[config.policy].claims(config)


# -- running operations ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What replaying a list of operations found."""

    ops_run: int
    violation: Violation | None = None
    op_index: int | None = None
    divergence: str | None = None
    error: str | None = None
    error_kind: str | None = None

    @property
    def failed(self) -> bool:
        return self.violation is not None or self.divergence is not None or self.error is not None

    def describe(self) -> str:
        if self.violation is not None:
            return f"operation {self.op_index}: {self.violation}"
        if self.divergence is not None:
            return f"operation {self.op_index}: divergence: {self.divergence}"
        if self.error is not None:
            return f"operation {self.op_index}: {self.error}"
        return f"{self.ops_run} operations, no violation"


class RarePaths:
    """Counts the rare paths a run reached (the statistics the ci profile must show)."""

    NAMES = ("eviction under a live cursor", "re-store", "CPU out of space", "abandoned transfer",
             "duplicate key across requests")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self._ever_cached: set[str] = set()

    def observe(self, before: dict[str, Any], after: dict[str, Any], op: dict[str, Any]) -> list[str]:
        hit: list[str] = []
        covered_before = covered_keys(before)
        live_before = {(r, g, p): k for r, g, p, _, k in owned_below_cursor(before) if k in covered_before}
        if live_before:
            cached_after = set(after["cpu_pool"]["cached"])
            if any(k not in cached_after and k in before["cpu_pool"]["cached"] for k in live_before.values()):
                hit.append("eviction under a live cursor")
        self._ever_cached.update(before["cpu_pool"]["cached"])
        if op["op"] == "step":
            gpu_hash = after["gpu_pool"]["block_hash"]
            new_events = set(after["scheduler"]["store_events"]) - set(before["scheduler"]["store_events"])
            for e in new_events:
                keys = {gpu_hash[g] for g in after["scheduler"]["store_events"][e]["gpu"]}
                if any(k in self._ever_cached and k not in before["cpu_pool"]["cached"] for k in keys):
                    hit.append("re-store")
            if not after["cpu_pool"]["free_queue"] and new_events:
                hit.append("CPU out of space")
        if op["op"] == "reset" and (after["scheduler"]["abandoned_store_events"]
                                    or after["scheduler"]["abandoned_reqs_to_load"]):
            hit.append("abandoned transfer")
        if any(len(ids) > 1 for ids in after["gpu_pool"]["cached"].values()):
            hit.append("duplicate key across requests")
        for name in hit:
            self.counts[name] += 1
        return hit


def run_ops(config: OffloadConfig, ops: Iterable[dict[str, Any]], factory: TargetFactory,
            oracle: Iterable[str] | None = None, reference: TargetFactory | None = None,
            rare: RarePaths | None = None) -> Outcome:
    """Apply ``ops`` to a fresh engine on ``factory(config)``; stop at the first problem."""
    ids = tuple(oracle) if oracle is not None else tuple(CATALOGUE)
    engine = Engine(factory(config))
    ref = Engine(reference(config)) if reference is not None else None
    n = 0
    for i, op in enumerate(ops):
        n = i + 1
        expect_error = op.get("expect") == "error"
        clean = {k: v for k, v in op.items() if k != "expect"}
        before = engine.snapshot() if (rare is not None or expect_error) else None
        try:
            engine.apply(clean)
            rejected = None
        except KVSpecError as exc:
            rejected = exc
        except Exception as exc:  # a crash inside the target is a finding, not a harness error
            return Outcome(n, op_index=i, error=f"{op['op']} crashed: {type(exc).__name__}: {exc}",
                           error_kind=f"{op['op']} {type(exc).__name__}")
        if expect_error:
            if rejected is None:
                return Outcome(n, op_index=i, error=f"{op['op']} was expected to be rejected")
            if engine.snapshot() != before:
                return Outcome(n, op_index=i, error=f"rejected {op['op']} changed the state")
        elif rejected is not None:
            return Outcome(n, op_index=i, error=f"{op['op']} rejected: {rejected}",
                           error_kind=f"{op['op']} {type(rejected).__name__}")
        snap = engine.snapshot()
        if ref is not None:
            try:
                ref.apply(clean)
                ref_err = None
            except KVSpecError as exc:
                ref_err = exc
            if (ref_err is None) != (rejected is None):
                return Outcome(n, op_index=i, divergence=f"{op['op']}: target "
                               f"{'rejected' if rejected else 'accepted'} it, reference "
                               f"{'rejected' if ref_err else 'accepted'} it")
            diff = first_difference(ref.snapshot(), snap)
            if diff is not None:
                return Outcome(n, op_index=i, divergence=diff)
        if rare is not None and before is not None:
            rare.observe(before, snap, clean)
        found = check(snap, ids)
        if found:
            return Outcome(n, violation=found[0], op_index=i)
    return Outcome(n)


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """Where two snapshots first differ, as ``path: want != got``."""
    if isinstance(want, dict) and isinstance(got, dict):
        for k in list(want) + [k for k in got if k not in want]:
            if k not in want or k not in got:
                return f"{path}.{k}: present in only one snapshot"
            d = first_difference(want[k], got[k], f"{path}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    return None if want == got else f"{path}: reference {want!r} != target {got!r}"


def replay(trace: Trace, factory: TargetFactory, oracle: Iterable[str] | None = None,
           reference: TargetFactory | None = None) -> Outcome:
    return run_ops(trace.config, trace.ops, factory, oracle, reference)


# -- the fuzzer -----------------------------------------------------------------------------


def random_config(rng: random.Random, policy: str, lazy: bool = False) -> OffloadConfig:
    groups: tuple[KVGroup, ...] = (KVGroup(),)
    if rng.random() < 0.3:
        groups = (KVGroup(), KVGroup("sliding", sliding_window=rng.choice([16, 32, 48])))
    return OffloadConfig(block_size=16, groups=groups, policy=policy, lazy_offload=lazy,
                         **random_config_kwargs(rng))


def generate(config: OffloadConfig, factory: TargetFactory, rng: random.Random, n_ops: int,
             oracle: tuple[str, ...], rare: RarePaths | None = None) -> tuple[list[dict[str, Any]], Outcome]:
    """Draw up to ``n_ops`` state-aware operations on a fresh target; stop at the first finding."""
    engine = Engine(factory(config))
    ops: list[dict[str, Any]] = []
    for _ in range(n_ops):
        op = next_op(engine, rng)
        ops.append(op)
        before = engine.snapshot() if rare is not None else None
        try:
            engine.apply(op)
        except Exception as exc:
            verb = "rejected" if isinstance(exc, KVSpecError) else "crashed"
            return ops, Outcome(len(ops), op_index=len(ops) - 1, error=f"{op['op']} {verb}: {exc}",
                                error_kind=f"{op['op']} {type(exc).__name__}")
        snap = engine.snapshot()
        if rare is not None and before is not None:
            rare.observe(before, snap, op)
        found = check(snap, oracle)
        if found:
            return ops, Outcome(len(ops), violation=found[0], op_index=len(ops) - 1)
    return ops, Outcome(len(ops))


def _same_finding(a: Outcome, b: Outcome) -> bool:
    if a.violation is not None:
        return b.violation is not None and b.violation.id == a.violation.id
    return a.error_kind is not None and a.error_kind == b.error_kind


def shrink(config: OffloadConfig, ops: list[dict[str, Any]], factory: TargetFactory, oracle: tuple[str, ...],
           finding: Outcome, deadline: float) -> tuple[list[dict[str, Any]], Outcome]:
    """Delta debugging: drop chunks of operations while the same finding remains."""
    best, best_out = list(ops[: (finding.op_index or len(ops)) + 1]), finding
    chunk = max(1, len(best) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, progress = 0, False
        while i < len(best) and time.monotonic() < deadline:
            cand = best[:i] + best[i + chunk:]
            out = run_ops(config, cand, factory, oracle)
            if out.failed and _same_finding(finding, out):
                best, best_out, progress = cand[: (out.op_index or 0) + 1], out, True
            else:
                i += chunk
        if not progress:
            chunk //= 2
    return best, best_out


@dataclass
class FuzzResult:
    found: bool
    seconds: float
    traces: int
    ops: int
    outcome: Outcome | None = None
    trace: Trace | None = None
    rare: dict[str, int] = field(default_factory=dict)


def fuzz(factory: TargetFactory, policy: str, budget: float, seed: int, oracle: tuple[str, ...] | None = None,
         target_name: str = "model", ops_per_trace: int = 60, lazy: bool = False,
         progress: Callable[[int, int, float], None] | None = None,
         config_for: Callable[[random.Random], OffloadConfig] | None = None) -> FuzzResult:
    """Random traces until a finding or ``budget`` seconds; the finding is shrunk."""
    rng = random.Random(seed)
    start = time.monotonic()
    rare = RarePaths()
    traces = ops = 0
    while time.monotonic() - start < budget:
        cfg = config_for(rng) if config_for else random_config(rng, policy, lazy)
        orc = oracle if oracle is not None else default_oracle(cfg)
        trace_ops, out = generate(cfg, factory, rng, ops_per_trace, orc, rare)
        traces += 1
        ops += len(trace_ops)
        if progress is not None:
            progress(traces, ops, time.monotonic() - start)
        if out.failed:
            small, small_out = shrink(cfg, trace_ops, factory, orc, out, time.monotonic() + max(5.0, budget))
            trace = Trace(replace(cfg), small, target_name, seed,
                          note=f"finding: {small_out.describe()}")
            return FuzzResult(True, time.monotonic() - start, traces, ops, small_out, trace, rare.counts)
    return FuzzResult(False, time.monotonic() - start, traces, ops, rare=rare.counts)


def write_trace(trace: Trace, out_dir: str | Path, name: str) -> Path:
    path = Path(out_dir) / f"{name}.jsonl"
    trace.write(path)
    return path


# -- the Hypothesis state machine -----------------------------------------------------------


def make_state_machine(factory: TargetFactory, reference: TargetFactory | None = None,
                       policy: str = "repair", oracle: tuple[str, ...] | None = None,
                       trace_dir: str | Path | None = None, lazy: bool = False) -> type:
    """A ``RuleBasedStateMachine`` driving ``Engine(factory(config))`` for ``policy``.

    Requests live in a bundle (``finish`` consumes them); rules whose arguments depend on
    the state (admissions, preemptions, reports, load completions) draw from it under
    preconditions. After every step the oracle (the policy's claims by default) is checked
    and, with a reference, the snapshots must be equal. A failure is written as a trace.
    """
    from hypothesis import event, target
    from hypothesis import strategies as st
    from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

    class KVSpecMachine(RuleBasedStateMachine):
        requests = Bundle("requests")

        def __init__(self) -> None:
            super().__init__()
            self.engine: Engine | None = None
            self.ref: Engine | None = None
            self.ops: list[dict[str, Any]] = []
            self.rare = RarePaths()
            self.config: OffloadConfig | None = None
            self.max_lost = 0

        def teardown(self) -> None:
            target(float(self.rare.counts["eviction under a live cursor"]), label="evictions under a live cursor")
            target(float(self.max_lost), label="pending lost records")

        @initialize(gpu=st.sampled_from([12, 16, 24]), cpu=st.sampled_from([4, 5, 6, 8]),
                    world=st.sampled_from([1, 2]), swa=st.sampled_from([0, 0, 32]))
        def setup(self, gpu: int, cpu: int, world: int, swa: int) -> None:
            groups = (KVGroup(), KVGroup("sliding", sliding_window=swa)) if swa else (KVGroup(),)
            self.config = OffloadConfig(block_size=16, num_gpu_blocks=gpu, num_cpu_blocks=cpu, world_size=world,
                                        groups=groups, policy=policy, lazy_offload=lazy)
            self.engine = Engine(factory(self.config))
            self.ref = Engine(reference(self.config)) if reference is not None else None

        # -- applying -------------------------------------------------------------------
        def _apply(self, op: dict[str, Any], expect_error: bool = False) -> None:
            assert self.engine is not None
            self.ops.append({**op, "expect": "error"} if expect_error else op)
            before = self.engine.snapshot()
            try:
                self.engine.apply(op)
                err = None
            except KVSpecError as exc:
                err = exc
            if self.ref is not None:
                try:
                    self.ref.apply(op)
                    ref_err = None
                except KVSpecError as exc:
                    ref_err = exc
                self._fail_if((err is None) != (ref_err is None), f"target error {err!r}, reference {ref_err!r}")
            if expect_error:
                self._fail_if(err is None, f"{op} was not rejected")
                self._fail_if(self.engine.snapshot() != before, f"rejected {op} changed the state")
                event("invalid operation rejected")
            else:
                self._fail_if(err is not None, f"{op} rejected: {err}")
                for name in self.rare.observe(before, self.engine.snapshot(), op):
                    event(name)

        def _fail_if(self, cond: bool, message: str) -> None:
            if cond:
                if trace_dir is not None and self.config is not None:
                    write_trace(Trace(self.config, self.ops, "harness", None, note=message), trace_dir,
                                f"failure-{policy}")
                raise AssertionError(message)

        def _waiting(self) -> list[str]:
            return [r for r, q in self.engine.requests.items() if q.status in ("waiting", "preempted")]

        def _running(self) -> list[str]:
            return [r for r, q in self.engine.requests.items() if q.status in ("running", "loaded")]

        # -- rules ----------------------------------------------------------------------
        @rule(target=requests, family=st.integers(0, 2), blocks=st.integers(1, 6), extra=st.sampled_from([0, 1, 8]),
              max_tokens=st.sampled_from([1, 2, 16, 32]))
        def add(self, family: int, blocks: int, extra: int, max_tokens: int) -> str:
            rid = f"r{len(self.engine.requests)}"
            self._apply({"op": "add", "rid": rid, "family": family, "prompt_len": blocks * 16 + extra,
                         "max_tokens": max_tokens})
            return rid

        @rule(data=st.data(), chunk=st.sampled_from([16, 32, 64]), resume=st.sampled_from(["mrv1", "mrv2"]))
        def step(self, data: Any, chunk: int, resume: str) -> None:
            waiting, running = self._waiting(), self._running()
            admit = data.draw(st.lists(st.sampled_from(waiting), unique=True)) if waiting else []
            preempt = data.draw(st.lists(st.sampled_from(running), unique=True, max_size=1)) if running else []
            self._apply({"op": "step", "admit": admit, "chunk": chunk, "preempt": preempt, "resume": resume})
            lost = len(self.engine.snapshot()["scheduler"]["policy_state"].get("lost", []))
            self.max_lost = max(self.max_lost, lost)

        @precondition(lambda self: self.engine is not None and bool(self.engine.reports_left))
        @rule(data=st.data())
        def report(self, data: Any) -> None:
            e = data.draw(st.sampled_from(sorted(self.engine.reports_left)))
            count = data.draw(st.integers(1, self.engine.reports_left[e]))
            self._apply({"op": "report", "event": e, "count": count})

        @precondition(lambda self: self.engine is not None and bool(self.engine.loads_shipped))
        @rule(data=st.data())
        def load_done(self, data: Any) -> None:
            self._apply({"op": "load_done", "rid": data.draw(st.sampled_from(sorted(self.engine.loads_shipped)))})

        @rule(rid=consumes(requests))
        def finish(self, rid: str) -> None:
            self._apply({"op": "finish", "rid": rid})

        @precondition(lambda self: self.engine is not None and self.engine.step_index % 4 == 3)
        @rule()
        def reset(self) -> None:
            self._apply({"op": "reset"})

        @rule(bad=st.sampled_from([
            {"op": "report", "event": 10_000, "count": 1},
            {"op": "load_done", "rid": "nobody"},
            {"op": "finish", "rid": "nobody"},
            {"op": "step", "admit": ["nobody"]},
            {"op": "step", "chunk": 0},
            {"op": "add", "rid": "", "family": 0, "prompt_len": 16},
            {"op": "add", "rid": "x", "family": -1, "prompt_len": 16},
            {"op": "frobnicate"},
        ]))
        def invalid(self, bad: dict[str, Any]) -> None:
            self._apply(dict(bad), expect_error=True)

        @invariant()
        def catalogue(self) -> None:
            if self.engine is None:
                return
            own_check = getattr(self.engine.target, "_check", None)
            if own_check is not None:  # the model's structures check themselves (free queues, pools, scheduler)
                own_check()
            ids = oracle if oracle is not None else default_oracle(self.config)
            found = check(self.engine.snapshot(), ids)
            self._fail_if(bool(found), "; ".join(str(v) for v in found[:3]))
            if self.ref is not None:
                diff = first_difference(self.ref.snapshot(), self.engine.snapshot())
                self._fail_if(diff is not None, f"divergence: {diff}")

    return KVSpecMachine
