"""One harness for every target: the run loop, the fuzzer, ``replay`` and the Hypothesis machine.

Every operation has exactly one of three outcomes, never confused:

* **accepted**, and then the oracle judges the new snapshot: a broken invariant is a
  *violation* (a finding, named by the invariant's id);
* **rejected**: the target (or the engine) raised a ``KVSpecError`` and the snapshot is
  exactly what it was. Not a finding: bad input refused cleanly. A rejection that changed
  the state is a *crash* (the refusal came half-way through the operation);
* **crashed**: any other exception inside the engine or the target. A finding of its own
  kind, shrunk and saved like a violation, reported with the exception type.

With a reference target the two runs must also agree on every operation (accepted by both
with equal results, or rejected by both with the same ``KVSpecError`` subclass) and on the
snapshot after it, key order included (a *divergence*); a trace whose operation carries
``"expect": "error"`` must be rejected cleanly (else an *expectation* finding).

``Run`` is the one place where an operation meets a target: ``run_ops`` and ``replay`` feed it
recorded operations; ``generate`` feeds it operations drawn by ``kvspec.drivers.opgen``, for
the fuzzer (``fuzz``, which shrinks a finding by delta debugging and hands the unshrunk and
the shrunk trace to ``on_finding`` as they exist, so an interrupt loses nothing), for the
trace generator (``kvspec.drivers.tracegen``) and for ``fuzz_with_invariants`` (real vLLM,
the invariant catalogue as the only oracle); ``make_state_machine`` is the Hypothesis
``RuleBasedStateMachine`` whose rules draw from the same generator and apply through ``Run``.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from kvspec.adapters import claims as claimed
from kvspec.adapters.targets import TargetFactory
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import KVSpecError
from kvspec.drivers.engine import OBSERVATIONS, Engine
from kvspec.drivers.opgen import (
    FUZZ_MIX,
    NO_PINS,
    ConfigPins,
    HypothesisChoices,
    OpGenerator,
    OpMix,
    RandomChoices,
    kind_weights,
    random_config,
    swarm_mix,
)
from kvspec.drivers.trace import Trace
from kvspec.oracle import oracles
from kvspec.oracle.catalogue import Violation, check, covered_keys, owned_below_cursor
from kvspec.oracle.incremental import IncrementalOracle, engine_parts_read

VIOLATION, CRASH, DIVERGENCE, EXPECTATION = "violation", "crash", "divergence", "expectation"
MESSAGE_LIMIT = 500  # characters of a crash or divergence text


def default_oracle(config: OffloadConfig) -> tuple[str, ...]:
    """The invariants the configured model policy claims (``kvspec.adapters.claims``)."""
    return claimed.claims(config).ids


# -- outcomes -------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What running a list of operations found: nothing (``kind`` None) or one finding."""

    ops_run: int
    violation: Violation | None = None
    op_index: int | None = None
    divergence: str | None = None
    crash: str | None = None  # "step: KeyError: 3"
    exception: str | None = None  # the crash's exception type
    expectation: str | None = None
    op_name: str | None = None
    rejected: int = 0  # operations rejected cleanly on the way
    input_error: bool = False  # the expectation failed because the engine refused the trace's own input
    accepted: bool = False  # the expectation failed because an operation expected to fail was accepted
    replayed: str | None = None  # why ``generate`` judged this trace by a fresh, full replay (``REPLAYS``)

    @property
    def kind(self) -> str | None:
        if self.violation is not None:
            return VIOLATION
        if self.crash is not None:
            return CRASH
        if self.divergence is not None:
            return DIVERGENCE
        if self.expectation is not None:
            return EXPECTATION
        return None

    @property
    def failed(self) -> bool:
        return self.kind is not None

    def signature(self) -> tuple[str | None, str | None]:
        """What makes two findings the same one (for shrinking and deduplication)."""
        if self.violation is not None:
            return VIOLATION, self.violation.id
        if self.crash is not None:
            return CRASH, f"{self.op_name} {self.exception}"
        if self.expectation is not None:  # the target refused, the engine refused the input, or it was accepted
            how = "bad input" if self.input_error else "accepted" if self.accepted else "refused"
            return EXPECTATION, f"{self.op_name} {how}"
        return self.kind, None

    def describe(self) -> str:
        if self.violation is not None:
            return f"operation {self.op_index}: {self.violation}"
        if self.crash is not None:
            return f"operation {self.op_index}: crash: {self.crash}"
        if self.divergence is not None:
            return f"operation {self.op_index}: divergence: {self.divergence}"
        if self.expectation is not None:
            return f"operation {self.op_index}: {self.expectation}"
        rejected = f" ({self.rejected} rejected cleanly)" if self.rejected else ""
        return f"{self.ops_run} operations{rejected}, no finding"

    def finding(self) -> dict[str, Any] | None:
        """The trace header's ``finding`` object."""
        if self.kind is None:
            return None
        return {"kind": self.kind, "op_index": self.op_index,
                "invariant": self.violation.id if self.violation else None, "exception": self.exception}

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "op_index": self.op_index, "ops_run": self.ops_run,
                "violation": self.violation.to_json() if self.violation else None,
                "crash": self.crash, "exception": self.exception, "divergence": self.divergence,
                "expectation": self.expectation, "rejected": self.rejected, "description": self.describe()}


class RarePaths:
    """Counts the rare paths a run reached (the statistics the ci profile must show); ``on_hit``,
    when given, is told each one as it is reached (the state machine's Hypothesis ``event``)."""

    NAMES = ("eviction under a live cursor", "re-store", "CPU out of space", "abandoned transfer",
             "duplicate key across requests")

    def __init__(self, on_hit: Callable[[str], object] | None = None) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.on_hit = on_hit
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
            if self.on_hit is not None:
                self.on_hit(name)
        return hit


# -- the run loop ---------------------------------------------------------------------------


@dataclass
class _Applied:
    """What one engine did with one operation: its result, or the ``KVSpecError`` it raised."""

    result: Any = None
    rejected: KVSpecError | None = None


class Run:
    """One engine on ``factory(config)`` (and one on the reference, if any), fed one operation at a
    time; ``apply`` returns the finding an operation produced, or None. ``index`` counts the
    operations applied, ``rejected`` those rejected cleanly. ``incremental``: the oracle runs only
    the invariants an operation touched (``kvspec.oracle.incremental``; same verdicts, a violation
    is the full check's); ``final_check`` then judges the last snapshot in full. ``lean``: the
    engines measure only the facts of ``OBSERVATIONS`` that the oracle reads (the fuzzer's runs;
    same verdicts, ``tests/test_incremental.py``), not those a report of the run would show.
    ``keep``: the engine keeps the target's snapshot between the calls that may change it
    (``Engine.keep_snapshots``; the fuzzer's runs, which confirm every violation with fresh
    snapshots and compare the kept snapshot with a fresh one at the end of every trace:
    ``generate``)."""

    def __init__(self, config: OffloadConfig, factory: TargetFactory, oracle: Iterable[str],
                 reference: TargetFactory | None = None, rare: RarePaths | None = None,
                 refine: bool = False, incremental: bool = False, lean: bool = False,
                 keep: bool = False) -> None:
        self.config = config
        self.ids = tuple(oracle)
        self.incremental = IncrementalOracle(self.ids) if incremental else None
        self.refine = refine and not config.lazy_offload  # lazy offload keeps no store state to refine
        read = engine_parts_read(self.ids) if lean else None
        observe = OBSERVATIONS if read is None else tuple(f for f in OBSERVATIONS if f in read)
        self.engine = Engine(factory(config), observe, keep_snapshots=keep)
        self.ref = Engine(reference(config), observe) if reference is not None else None
        self.rare = rare
        self.index = 0
        self.rejected = 0
        self._snapshot: dict[str, Any] | None = None  # the engine's snapshot after the last operation
        self._generation = -1  # the engine's target-snapshot generation that ``_snapshot`` shows
        self._judged = -2  # the generation of the last snapshot the incremental oracle judged

    @property
    def snapshot(self) -> dict[str, Any]:
        """The engine's snapshot now (taken once per operation, then kept)."""
        if self._snapshot is None:
            self._snapshot = self.engine.snapshot()
            self._generation = self.engine.served_generation
        return self._snapshot

    def apply(self, op: dict[str, Any], recorded: bool = True) -> Outcome | None:
        """Run ``op``. ``recorded``: the operation comes from a trace (or must behave as one), so its
        ``expect`` must hold (accepted unless ``"expect": "error"``); a generated operation may be
        rejected freely. Returns the finding, or None (accepted and judged clean, or rejected
        cleanly). O(snapshot) per operation, twice that with a reference."""
        i, self.index = self.index, self.index + 1
        name = str(op.get("op"))
        clean = {k: v for k, v in op.items() if k != "expect"}
        before, before_generation = self.snapshot, self._generation
        self._snapshot = None
        try:
            done = _apply(self.engine, clean)
        except Exception as exc:  # anything but a KVSpecError inside the engine or the target is a crash
            return self._crash(i, name, exc)
        if done.rejected is not None:
            if self.engine.snapshot() != before:
                return self._crash(i, name, done.rejected, "its rejection changed the state")
            self.rejected += 1
            self._snapshot, self._generation = before, before_generation
        found = self._expectation(i, name, op, done.rejected) if recorded else None
        if found is None and self.ref is not None:
            found = self._compare(i, name, clean, done)
        if found is not None or done.rejected is not None:
            return found
        return self._judge(i, name, before, clean)

    def _found(self, i: int, name: str, **what: Any) -> Outcome:
        return Outcome(i + 1, op_index=i, op_name=name, rejected=self.rejected, **what)

    def _crash(self, i: int, name: str, exc: BaseException, why: str = "") -> Outcome:
        text = f"{name}: {type(exc).__name__}: {exc}" + (f" ({why})" if why else "")
        return self._found(i, name, crash=text[:MESSAGE_LIMIT], exception=type(exc).__name__)

    def _expectation(self, i: int, name: str, op: dict[str, Any], rejected: KVSpecError | None) -> Outcome | None:
        """A recorded operation did what its ``expect`` says (rejected for "error", else accepted)."""
        expect_error = op.get("expect") == "error"
        if expect_error and rejected is None:
            return self._found(i, name, accepted=True,
                               expectation=f"{name} was expected to be rejected, and was accepted")
        if expect_error or rejected is None:
            return None
        by_target = _raised_in(rejected, (self.engine.target, self.engine.gpu))
        why = "the target rejected it" if by_target else "the engine rejected it (bad input in the trace)"
        return self._found(i, name, input_error=not by_target,
                           expectation=f"{name} is recorded as accepted (no \"expect\": \"error\"), but {why}: "
                           f"{type(rejected).__name__}: {rejected}")

    def _compare(self, i: int, name: str, op: dict[str, Any], done: _Applied) -> Outcome | None:
        """The reference runs ``op`` too: same outcome (result, or rejection class), same snapshot."""
        assert self.ref is not None
        try:
            ref = _apply(self.ref, op)
        except Exception as exc:
            return self._found(i, name, divergence=f"{name}: the reference crashed: "
                               f"{type(exc).__name__}: {exc}"[:MESSAGE_LIMIT])
        diff = _outcome_difference(name, ref, done)
        if diff is None:
            diff = first_difference(self.ref.snapshot(), self.snapshot)
        return None if diff is None else self._found(i, name, divergence=diff[:MESSAGE_LIMIT])

    def _judge(self, i: int, name: str, before: dict[str, Any], op: dict[str, Any]) -> Outcome | None:
        """The oracle on the snapshot after an accepted operation (and the rare paths it reached)."""
        snap = self.snapshot
        if self.rare is not None:
            self.rare.observe(before, snap, op)
        # an engine that kept its target snapshot since the last judged one vouches its sections unchanged
        same_target, self._judged = self._generation == self._judged, self._generation
        if self.incremental is None or self.incremental.check(snap, same_target):
            violations = check(snap, self.ids)  # a violation is always the full check's
        else:
            violations = []
        if not violations and self.refine:
            violations = _refinement(before, snap, op, self.config, i)
        return self._found(i, name, violation=violations[0]) if violations else None


    def final_check(self) -> list[Violation]:
        """The full oracle on the snapshot now (the end of a trace checked incrementally)."""
        return check(self.snapshot, self.ids)


def _refinement(before: dict[str, Any], after: dict[str, Any], op: dict[str, Any], config: OffloadConfig,
                i: int) -> list[Violation]:
    """Refinement (``kvspec.specs.refinement``, id R1): every request's (before, after) pair is
    admitted by the proved transitions of ``specs/transitions.py``. The first rejection, as a
    violation, or none."""
    from kvspec.specs.refinement import REFINEMENT_ID, refinement_check

    verdict = refinement_check(before, after, op, config, i)
    if verdict.ok:
        return []
    first = verdict.rejections[0]
    return [Violation(REFINEMENT_ID, str(first)[:MESSAGE_LIMIT], requests=(first.rid,))]


def _apply(engine: Engine, op: dict[str, Any]) -> _Applied:
    """``engine.apply(op)``: its result, or the ``KVSpecError`` it raised (anything else propagates)."""
    try:
        return _Applied(result=engine.apply(op))
    except KVSpecError as exc:
        return _Applied(rejected=exc)


def _outcome_difference(name: str, ref: _Applied, got: _Applied) -> str | None:
    """How the target's outcome of one operation differs from the reference's, or None."""
    if (ref.rejected is None) != (got.rejected is None):
        return (f"{name}: target {'rejected' if got.rejected else 'accepted'} it, reference "
                f"{'rejected' if ref.rejected else 'accepted'} it")
    if ref.rejected is not None and got.rejected is not None:
        if type(ref.rejected) is not type(got.rejected):
            return (f"{name}: target raised {type(got.rejected).__name__}, reference raised "
                    f"{type(ref.rejected).__name__}")
        return None
    if ref.result != got.result:
        return f"{name}: results differ: reference {ref.result!r} != target {got.result!r}"
    return None


def _raised_in(exc: BaseException, objects: tuple[object, ...]) -> bool:
    """Whether ``exc`` was raised inside a method of one of ``objects`` (the target or its GPU pool),
    as opposed to by the engine's own argument checks. Reads the traceback's frames."""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if any(owner is o for o in objects):
            return True
        tb = tb.tb_next
    return False


def start_run(config: OffloadConfig, factory: TargetFactory, oracle: Iterable[str],
              reference: TargetFactory | None = None, rare: RarePaths | None = None,
              refine: bool = False, incremental: bool = False, lean: bool = False,
              keep: bool = False) -> Run | Outcome:
    """A ``Run``, or the crash of building the target (a finding at no operation)."""
    try:
        return Run(config, factory, oracle, reference, rare, refine, incremental, lean, keep)
    except KVSpecError:
        raise
    except Exception as exc:
        return Outcome(0, crash=f"building the target: {type(exc).__name__}: {exc}"[:MESSAGE_LIMIT],
                       exception=type(exc).__name__, op_name="(setup)")


def run_ops(config: OffloadConfig, ops: Iterable[dict[str, Any]], factory: TargetFactory,
            oracle: Iterable[str] | None = None, reference: TargetFactory | None = None,
            rare: RarePaths | None = None, refine: bool = False) -> Outcome:
    """Apply recorded ``ops`` to a fresh engine on ``factory(config)``; stop at the first finding.
    ``oracle`` defaults to the claims of ``config.policy``; ``refine`` adds the refinement check
    (R1) after every accepted operation. ``ops`` may be a stream."""
    run = start_run(config, factory, oracle if oracle is not None else default_oracle(config), reference, rare,
                    refine)
    if isinstance(run, Outcome):
        return run
    for op in ops:
        found = run.apply(op)
        if found is not None:
            return found
    return Outcome(run.index, rejected=run.rejected)


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """Where two snapshots first differ, as ``path: want != got``, or None when they are equal down
    to what their JSON text shows: the same keys in the same order, lists of the same length, and
    leaves of the same type and value. O(size of the snapshots)."""
    if isinstance(want, dict) and isinstance(got, dict):
        for k in list(want) + [k for k in got if k not in want]:
            if k not in want or k not in got:
                return f"{path}.{k}: present in only one snapshot"
            d = first_difference(want[k], got[k], f"{path}.{k}")
            if d is not None:
                return d
        if list(want) != list(got):
            return f"{path or '(root)'}: keys in a different order: reference {list(want)!r} != target {list(got)!r}"
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            d = first_difference(a, b, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    return None if type(want) is type(got) and want == got else f"{path}: reference {want!r} != target {got!r}"


def replay(trace: Trace, factory: TargetFactory, oracle: Iterable[str] | None = None,
           reference: TargetFactory | None = None, refine: bool = False) -> Outcome:
    return run_ops(trace.config, trace.ops, factory, oracle, reference, refine=refine)


# -- generated operations -------------------------------------------------------------------


def generate(config: OffloadConfig, factory: TargetFactory, rng: random.Random, n_ops: int,
             oracle: Iterable[str], rare: RarePaths | None = None, *, mix: OpMix = FUZZ_MIX,
             strict: bool = False, incremental: bool = True, refine: bool = False,
             prefix: Sequence[dict[str, Any]] = ()) -> tuple[list[dict[str, Any]], Outcome]:
    """Draw up to ``n_ops`` state-aware operations of ``mix`` (``OpGenerator`` on ``rng``) on a
    fresh target; stop at the first finding (the finding's operation is the list's last). The
    invalid ones (``mix.invalid_rate``) carry ``"expect": "error"``. ``prefix``: recorded
    operations applied first, as drawn ones are (they count towards ``n_ops``); the drawing starts
    from the state they leave (the generator keeps no state of its own, so it continues any trace).

    ``strict`` False (the fuzzer): operations the target rejects cleanly change nothing, so they
    are counted and left out of the returned list (the list replays to the same states).
    ``strict`` True: every operation is kept and must do what it says (accepted, or rejected for
    ``"expect": "error"``), as in a recorded trace; anything else is an expectation finding.

    ``incremental`` (the default): the oracle checks what each operation touched, the whole
    oracle at the end of the trace; should that final check ever find what the incremental one
    missed, the operations are replayed with the full oracle after each, and that replay's
    finding is the one returned (verdicts are always the full check's). The engine keeps the
    target's snapshot between calls that may change it (``Engine.keep_snapshots``): a violation
    is confirmed by replaying the operations the same way with fresh snapshots (should the
    replay judge otherwise, its verdict is the one returned), and at the end of a clean trace the
    kept snapshot is compared with a fresh one (a mismatch means such a replay too), so no
    verdict rests on a stale snapshot. ``refine`` adds the refinement check (R1) after
    every accepted operation."""
    ids = tuple(oracle)
    run = start_run(config, factory, ids, None, rare, refine, incremental, lean=True, keep=True)
    if isinstance(run, Outcome):
        return [], run
    gen = OpGenerator(config, RandomChoices(rng), mix)
    ops: list[dict[str, Any]] = []
    recorded = iter(prefix)
    while run.index < n_ops:
        op = next(recorded, None) or gen.next_op(run.engine)
        seen = run.rejected
        found = run.apply(op, recorded=strict)
        if found is not None or strict or run.rejected == seen:
            ops.append(op)
        if found is not None:
            found.op_index = len(ops) - 1
            if found.violation is None:  # a crash or an unmet expectation is read from no snapshot
                return ops, found
            # a violation is confirmed with fresh snapshots: a kept one (or a plan fact measured
            # from one) that a call the engine does not watch had made stale cannot raise an alarm
            fresh_ops, fresh = _replayed_in_full(config, factory, ids, ops, strict, refine, STALE_SNAPSHOT)
            if (fresh.op_index, fresh.violation) == (found.op_index, found.violation):
                return ops, found
            return fresh_ops, fresh
    if run.index and not run.engine.kept_snapshot_is_current():
        return _replayed_in_full(config, factory, ids, ops, strict, refine, STALE_SNAPSHOT)
    if incremental and run.index and run.final_check():
        return _replayed_in_full(config, factory, ids, ops, strict, refine, INCREMENTAL_MISS)
    return ops, Outcome(len(ops), rejected=run.rejected)


STALE_SNAPSHOT = "stale snapshot"
INCREMENTAL_MISS = "incremental miss"
REPLAYS = {
    STALE_SNAPSHOT: "a kept snapshot differed from a fresh one (at the end of the trace, or a violation "
                    "that fresh snapshots do not confirm): the target's snapshot changes without a call "
                    "the engine watches (a query that changes state, or state read from the engine's own "
                    "objects); such traces are judged by a replay with fresh snapshots",
    INCREMENTAL_MISS: "incremental checking missed a violation that the full check found at the end of the "
                      "trace: an invariant reads a part kvspec.oracle.incremental.READS does not list "
                      "(a kvspec bug; the replay's verdict stands)",
}
"""Why ``generate`` judged a trace by a fresh, full replay (``Outcome.replayed``); the fuzzer
counts each and says what it means."""


def _replayed_in_full(config: OffloadConfig, factory: TargetFactory, ids: tuple[str, ...],
                      ops: list[dict[str, Any]], strict: bool, refine: bool, why: str
                      ) -> tuple[list[dict[str, Any]], Outcome]:
    """``ops`` replayed with the full oracle after every operation and a fresh target snapshot
    wherever one is read: the finding, and the operations up to it, its ``replayed`` set to
    ``why`` (a key of ``REPLAYS``). (Generated operations that were rejected are not in ``ops``;
    strict ones are.)"""
    run = start_run(config, factory, ids, refine=refine, lean=True)
    if isinstance(run, Outcome):
        run.replayed = why
        return [], run
    for n, op in enumerate(ops):
        found = run.apply(op, recorded=strict)
        if found is not None:
            found.op_index, found.replayed = n, why
            return ops[: n + 1], found
    violations = run.final_check()
    return ops, Outcome(len(ops), violation=violations[0] if violations else None,
                        op_index=len(ops) - 1 if violations else None, rejected=run.rejected, replayed=why)


# -- the fuzzer -----------------------------------------------------------------------------


def shrink(config: OffloadConfig, ops: list[dict[str, Any]], factory: TargetFactory, oracle: Iterable[str],
           finding: Outcome, deadline: float, refine: bool = False) -> tuple[list[dict[str, Any]], Outcome]:
    """Delta debugging: drop chunks of operations while the same finding (same kind, same invariant
    or same crash) remains. Stops at ``deadline`` or on Ctrl-C with the smallest trace so far
    (every candidate kept was replayed to the finding)."""
    ids = tuple(oracle)
    best, best_out = list(ops[: (finding.op_index if finding.op_index is not None else len(ops)) + 1]), finding
    chunk = max(1, len(best) // 2)
    try:
        while chunk >= 1 and time.monotonic() < deadline:
            i, progress = 0, False
            while i < len(best) and time.monotonic() < deadline:
                cand = best[:i] + best[i + chunk:]
                out = run_ops(config, cand, factory, ids, refine=refine)
                if out.failed and out.signature() == finding.signature():
                    best, best_out, progress = cand[: (out.op_index or 0) + 1], out, True
                else:
                    i += chunk
            if not progress:
                chunk //= 2
    except KeyboardInterrupt:
        raise ShrinkInterrupted(best, best_out) from None
    return best, best_out


class ShrinkInterrupted(KeyboardInterrupt):
    """Ctrl-C during shrinking, carrying the smallest trace found so far."""

    def __init__(self, ops: list[dict[str, Any]], outcome: Outcome) -> None:
        super().__init__()
        self.ops, self.outcome = ops, outcome


@dataclass
class FuzzResult:
    found: bool
    seconds: float
    traces: int
    ops: int
    search_seconds: float = 0.0  # until the finding (or the whole run when none)
    oracle: str = ""
    outcome: Outcome | None = None
    trace: Trace | None = None
    unshrunk: Trace | None = None
    rare: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    interrupted: bool = False
    rng_state: list[Any] | None = None  # the generator's state at the end (JSON-able: a campaign resumes from it)
    replays: dict[str, int] = field(default_factory=dict)  # traces judged by a fresh, full replay, by ``REPLAYS`` key

    @property
    def kind(self) -> str | None:
        return self.outcome.kind if self.found and self.outcome is not None else None

    @property
    def ops_per_second(self) -> float:
        """Checked operations per second of searching (shrinking excluded)."""
        return self.ops / self.search_seconds if self.search_seconds > 0 else 0.0


FindingSink = Callable[[Trace, str], None]  # (trace, "unshrunk" | "shrunk")


def fuzz(factory: TargetFactory, policy: str, budget: float, seed: int, oracle: str | None = None,
         target_name: str = "model", ops_per_trace: int = 60, lazy: bool = False,
         progress: Callable[[int, int, float], None] | None = None,
         config_for: Callable[[random.Random], OffloadConfig] | None = None,
         bug: str | None = None, on_finding: FindingSink | None = None, refine: bool = False,
         resume: list[Any] | None = None, pins: ConfigPins = NO_PINS, shrink_finding: bool = True,
         swarm: bool = True) -> FuzzResult:
    """Random traces until a finding or ``budget`` seconds. ``oracle`` is an oracle spec
    (``kvspec.oracle.resolve``: None/``claims``, ``all`` or ids), resolved for each random
    configuration; ``bug`` names the known-bug variant under test. A finding is handed to
    ``on_finding`` unshrunk, then shrunk; Ctrl-C returns what was found so far. ``refine`` adds
    the refinement check (R1, ``kvspec.specs.refinement``) after every accepted operation.
    ``resume``: a ``rng_state`` of an earlier run with the same seed, to go on where it stopped.
    ``pins``: features every random configuration has (``random_config``; not with ``config_for``).
    ``shrink_finding`` False: the finding is reported unshrunk (``trace`` is the unshrunk trace), as
    a time-to-find measurement that needs no small trace wants. ``swarm`` (the default): swarm
    testing, each trace with its own mix (``opgen.swarm_mix``) and the configuration's features
    drawn half the time each (``random_config``); False: every trace with ``FUZZ_MIX``."""
    rng = random.Random(seed)
    if resume is not None:
        version, internal, gauss = resume
        rng.setstate((version, tuple(internal), gauss))
    start = time.monotonic()
    rare = RarePaths()
    res = FuzzResult(False, 0.0, 0, 0, rare=rare.counts)
    try:
        while time.monotonic() - start < budget:
            cfg = config_for(rng) if config_for else random_config(RandomChoices(rng), policy, lazy, pins=pins,
                                                                   swarm=swarm)
            orc = claimed.resolve(oracle, cfg, bug)
            res.oracle = orc.name
            mix = swarm_mix(RandomChoices(rng)) if swarm else FUZZ_MIX
            trace_ops, out = generate(cfg, factory, rng, ops_per_trace, orc.ids, rare, mix=mix, refine=refine)
            res.traces += 1
            res.ops += len(trace_ops)
            res.rejected += out.rejected
            if out.replayed is not None:
                res.replays[out.replayed] = res.replays.get(out.replayed, 0) + 1
            if progress is not None:
                progress(res.traces, res.ops, time.monotonic() - start)
            if not out.failed:
                continue
            res.found, res.outcome = True, out
            res.search_seconds = time.monotonic() - start
            res.unshrunk = _finding_trace(cfg, trace_ops, target_name, seed, orc, out)
            if on_finding is not None:
                on_finding(res.unshrunk, "unshrunk")
            res.trace = res.unshrunk
            if shrink_finding:
                _shrink_finding(res, (cfg, trace_ops, target_name, seed), factory, orc,
                                time.monotonic() + max(5.0, budget), refine, on_finding)
            break
    except KeyboardInterrupt:
        res.interrupted = True
    res.seconds = time.monotonic() - start
    if not res.found:
        res.search_seconds = res.seconds
    version, internal, gauss = rng.getstate()
    res.rng_state = [version, list(internal), gauss]
    return res


def _shrink_finding(res: FuzzResult, found: tuple[OffloadConfig, list[dict[str, Any]], str, int],
                    factory: TargetFactory, orc: oracles.Oracle, deadline: float, refine: bool,
                    on_finding: FindingSink | None) -> None:
    """``fuzz``'s finding in ``res`` (``found``: the configuration, operations, target name and seed
    of its trace), shrunk by ``deadline``; Ctrl-C keeps the smallest trace so far and marks ``res``
    interrupted."""
    cfg, ops, target_name, seed = found
    assert res.outcome is not None
    try:
        small, small_out = shrink(cfg, ops, factory, orc.ids, res.outcome, deadline, refine)
    except ShrinkInterrupted as stop:
        res.interrupted = True
        small, small_out = stop.ops, stop.outcome
    res.outcome = small_out
    res.trace = _finding_trace(cfg, small, target_name, seed, orc, small_out)
    if on_finding is not None:
        on_finding(res.trace, "shrunk")


def _finding_trace(cfg: OffloadConfig, ops: list[dict[str, Any]], target: str, seed: int,
                   orc: oracles.Oracle, out: Outcome) -> Trace:
    return Trace(replace(cfg), list(ops), target, seed, note=f"finding: {out.describe()}"[:2000],
                 oracle=orc.ids, finding=out.finding())


# -- real vLLM with the invariant catalogue as the only oracle -------------------------------


@dataclass
class InvariantFuzzResult:
    """What ``fuzz_with_invariants`` found: the first violation, where, and after how much;
    ``error`` names anything else that stopped the search (a rejected or crashing operation)."""

    found: bool
    seconds: float
    traces: int
    ops: int
    violation: Violation | None = None
    trace_ops: list[dict[str, Any]] = field(default_factory=list)
    shrunk_ops: list[dict[str, Any]] = field(default_factory=list)
    shrunk_violation: Violation | None = None
    error: str | None = None


def fuzz_with_invariants(config: OffloadConfig, *, seed: int = 0, max_traces: int = 50, ops_per_trace: int = 200,
                         oracle: Sequence[str] | None = None, shrink: bool = True,
                         factory: TargetFactory | None = None) -> InvariantFuzzResult:
    """Random engine traces on one target (default: real vLLM, ``kvspec.adapters.vllm``), the
    invariant catalogue after every operation, no model alongside.

    Operations are drawn from the target engine's own state (``generate``, strict: every generated
    operation must be accepted). The search stops at the first violation of ``oracle`` (default:
    ``kvspec.adapters.vllm.baseline_oracle(config)``) or at any other finding (reported as
    ``error``), and shrinks a violation's trace by delta debugging with the same oracle, on the
    same target. Deterministic in ``seed``."""
    from kvspec.adapters.targets import get_factory
    from kvspec.adapters.vllm import baseline_oracle

    make = factory or get_factory("vllm")
    ids = tuple(oracle) if oracle is not None else baseline_oracle(config)
    rng = random.Random(seed)
    start = time.monotonic()
    total = 0
    for n_trace in range(1, max_traces + 1):
        mix = OpMix(num_families=rng.choice([1, 2, 3]), readmit_preempted=True)
        ops, out = generate(config, make, rng, ops_per_trace, ids, mix=mix, strict=True)
        total += len(ops)
        if out.failed:
            result = InvariantFuzzResult(out.violation is not None, time.monotonic() - start, n_trace, total,
                                         out.violation, ops, error=None if out.violation else out.describe())
            return _shrunk(result, config, make, ids, out) if shrink and result.found else result
    return InvariantFuzzResult(False, time.monotonic() - start, max_traces, total)


def _shrunk(result: InvariantFuzzResult, config: OffloadConfig, make: TargetFactory, ids: tuple[str, ...],
            finding: Outcome) -> InvariantFuzzResult:
    """``result`` with its trace shrunk (at most a minute of delta debugging)."""
    small, out = shrink(config, result.trace_ops, make, ids, finding, time.monotonic() + 60.0)
    result.shrunk_ops, result.shrunk_violation = small, out.violation
    return result


# -- finding files --------------------------------------------------------------------------


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._+" else "-" for c in text).strip("-")[:60] or "x"


def finding_name(target: str, policy: str, oracle_name: str, trace: Trace, stage: str = "") -> str:
    """``<target>-<policy>-<oracle>[-unshrunk]-<content hash>.jsonl``: two findings never share a
    name unless their traces are the same."""
    digest = hashlib.sha256(trace.dumps().encode()).hexdigest()[:12]
    oracle_part = "claims" if oracle_name.startswith("claims") else oracle_name.split(" ")[0]
    parts = [_slug(target), _slug(policy), _slug(oracle_part.replace(",", "+"))]
    if stage == "unshrunk":
        parts.append("unshrunk")
    return "-".join([*parts, digest]) + ".jsonl"


def save_trace(trace: Trace, out_dir: str | Path, name: str) -> Path:
    """Write ``trace`` as ``out_dir/name`` without ever overwriting a different file: an existing
    file with the same text is kept as it is; another name gets a ``-2``, ``-3``... suffix.
    Raises ``OSError`` when the directory cannot be written."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    text = trace.dumps()
    stem, suffix = (name[:-6], ".jsonl") if name.endswith(".jsonl") else (name, ".jsonl")
    for n in range(1, 1000):
        path = directory / (f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}")
        try:
            with open(path, "x", encoding="utf-8") as fh:
                fh.write(text)
            return path
        except FileExistsError:
            if path.read_text(encoding="utf-8") == text:
                return path
    raise OSError(f"{directory}: too many findings named {stem}")


def check_writable(out_dir: str | Path) -> None:
    """Fail early (``ConfigError``) when findings could not be written to ``out_dir``."""
    from kvspec.contract.errors import ConfigError

    directory = Path(out_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".kvspec-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {str(out_dir)[:200]!r} is not a writable directory: "
                          f"{exc.strerror or exc}") from None


# -- the Hypothesis state machine -----------------------------------------------------------


@dataclass(frozen=True)
class MachineSpec:
    """What a state machine drives: ``factory``'s targets for ``policy`` (lazy or eager), judged by
    ``oracle`` (None: the policy's claims) and, with a ``reference``, compared with it; failures
    are written as traces under ``trace_dir`` when given."""

    factory: TargetFactory
    reference: TargetFactory | None = None
    policy: str = "repair"
    oracle: tuple[str, ...] | None = None
    trace_dir: str | Path | None = None
    lazy: bool = False
    refine: bool = False  # also the refinement check (R1) after every accepted operation


class EngineMachine:
    """The state machine's workings, apart from its Hypothesis rules (``make_state_machine``):
    the configuration comes from ``opgen.random_config`` and each rule draws its operation from
    ``OpGenerator``, both with ``HypothesisChoices``; the operation goes through one ``Run``, as
    a recorded operation (a generated one must be accepted, an invalid one rejected cleanly),
    which checks the oracle (the policy's claims by default) and, with a reference, that both
    agree. Any finding fails the example and, with a ``trace_dir``, is saved as a trace. After
    every rule the target's own self-check runs. Rare paths reached become Hypothesis
    ``event``s; ``teardown`` reports ``target``s."""

    spec: ClassVar[MachineSpec]

    def __init__(self) -> None:
        from hypothesis import event

        super().__init__()
        self.rare = RarePaths(on_hit=event)
        self.ops: list[dict[str, Any]] = []
        self.max_lost = 0
        self._run: Run | None = None

    @property
    def run(self) -> Run:
        """The run: ``begin`` (the @initialize rule) comes before every other rule."""
        assert self._run is not None
        return self._run

    def begin(self, data: Any) -> None:
        spec = self.spec
        config = random_config(HypothesisChoices(data), spec.policy, spec.lazy)
        oracle = spec.oracle if spec.oracle is not None else default_oracle(config)
        run = start_run(config, spec.factory, oracle, spec.reference, self.rare, spec.refine, lean=True)
        if isinstance(run, Outcome):
            raise AssertionError(run.describe())
        self._run = run

    def can(self, kind: str) -> bool:
        """Whether an operation of ``kind`` has something to act on now (a rule's precondition)."""
        return self._run is not None and kind in kind_weights(self._run.engine)

    def play(self, kind: str, data: Any) -> dict[str, Any]:
        """Draw a valid operation of ``kind`` and apply it; returns it."""
        op = OpGenerator(self.run.config, HypothesisChoices(data)).builders[kind](self.run.engine)
        self.apply(op)
        return op

    def play_invalid(self, data: Any) -> None:
        from hypothesis import event

        op = OpGenerator(self.run.config, HypothesisChoices(data)).invalid_op(self.run.engine)
        self.apply({**op, "expect": "error"})
        event("invalid operation rejected")

    def apply(self, op: dict[str, Any]) -> None:
        self.ops.append(op)
        found = self.run.apply(op)
        if found is not None:
            self._fail(found)
        lost = len(self.run.snapshot["scheduler"]["policy_state"].get("lost", ()))
        self.max_lost = max(self.max_lost, lost)

    def finish_request(self, rid: str) -> None:
        """Abort a request of the bundle, unless it already stopped at ``max_tokens`` by itself
        (async scheduling), which leaves nothing to abort."""
        from hypothesis import event

        if self.run.engine.status(rid) == "finished":
            event("finish: the request had already stopped at max_tokens")
            return
        self.apply({"op": "finish", "rid": rid})

    def check_structures(self) -> None:
        """The target's own structural self-check, where it has one (the model's free queues,
        pools and scheduler check themselves)."""
        own_check = getattr(self.run.engine.target, "_check", None) if self._run is not None else None
        if own_check is not None:
            own_check()

    def report_targets(self) -> None:
        from hypothesis import target

        target(float(self.rare.counts["eviction under a live cursor"]), label="evictions under a live cursor")
        target(float(self.max_lost), label="pending lost records")

    def _fail(self, found: Outcome) -> None:
        message = found.describe()
        if self.spec.trace_dir is not None:
            trace = Trace(self.run.config, self.ops, "harness", None, note=message[:2000])
            save_trace(trace, self.spec.trace_dir, finding_name("harness", self.spec.policy, "claims", trace))
        raise AssertionError(message)


def make_state_machine(factory: TargetFactory, reference: TargetFactory | None = None,
                       policy: str = "repair", oracle: tuple[str, ...] | None = None,
                       trace_dir: str | Path | None = None, lazy: bool = False, refine: bool = False) -> type:
    """A ``RuleBasedStateMachine`` driving ``Engine(factory(config))`` for ``policy`` (see
    ``EngineMachine``): the configuration is drawn first, then one rule per operation kind.
    Requests live in a bundle (``add`` fills it, ``finish`` consumes it); reports and load
    completions wait for something to act on (preconditions), resets for every fourth step."""
    from hypothesis import strategies as st
    from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

    class KVSpecMachine(EngineMachine, RuleBasedStateMachine):
        spec = MachineSpec(factory, reference, policy, oracle, trace_dir, lazy, refine)
        requests = Bundle("requests")

        @initialize(data=st.data())
        def setup(self, data: Any) -> None:
            self.begin(data)

        @rule(target=requests, data=st.data())
        def add(self, data: Any) -> str:
            return str(self.play("add", data)["rid"])

        @rule(data=st.data())
        def step(self, data: Any) -> None:
            self.play("step", data)

        @precondition(lambda self: self.can("report"))
        @rule(data=st.data())
        def report(self, data: Any) -> None:
            self.play("report", data)

        @precondition(lambda self: self.can("load_done"))
        @rule(data=st.data())
        def load_done(self, data: Any) -> None:
            self.play("load_done", data)

        @rule(rid=consumes(requests))
        def finish(self, rid: str) -> None:
            self.finish_request(rid)

        @precondition(lambda self: self.can("reset") and self.run.engine.step_index % 4 == 3)
        @rule()
        def reset(self) -> None:
            self.apply({"op": "reset"})

        @rule(data=st.data())
        def invalid(self, data: Any) -> None:
            self.play_invalid(data)

        @invariant()
        def self_check(self) -> None:
            self.check_structures()

        def teardown(self) -> None:
            self.report_targets()

    return KVSpecMachine
