"""One harness for every target: the run loop, the fuzzer, ``replay`` and the Hypothesis machine.

Every operation has exactly one of three outcomes, never confused:

* **accepted**, and then the oracle judges the new snapshot: a broken invariant is a
  *violation* (a finding, named by the invariant's id);
* **rejected**: the target (or the engine) raised a ``KVSpecError`` and the snapshot is
  exactly what it was. Not a finding: bad input refused cleanly. A rejection that changed
  the state is a *crash* (the refusal came half-way through the operation);
* **crashed**: any other exception inside the engine or the target. A finding of its own
  kind, shrunk and saved like a violation, reported with the exception type.

With a reference target the two runs must also agree (a *divergence*); a trace whose
operation carries ``"expect": "error"`` must be rejected cleanly (else an *expectation*
finding). ``run_ops`` is the loop; ``fuzz`` draws state-aware operations
(``kvspec.drivers.opgen``), shrinks a finding by delta debugging and hands the unshrunk and the
shrunk trace to ``on_finding`` as they exist, so an interrupt loses nothing;
``make_state_machine`` is the Hypothesis ``RuleBasedStateMachine`` over the same engine.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvspec.adapters.targets import TargetFactory
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import KVSpecError
from kvspec.drivers.engine import Engine
from kvspec.drivers.opgen import next_op, random_config_kwargs
from kvspec.drivers.trace import Trace
from kvspec.oracle import claims as oracles
from kvspec.oracle.catalogue import Violation, check, covered_keys, owned_below_cursor

VIOLATION, CRASH, DIVERGENCE, EXPECTATION = "violation", "crash", "divergence", "expectation"


def default_oracle(config: OffloadConfig) -> tuple[str, ...]:
    """The invariants the configured model policy claims (``kvspec.oracle.claims``)."""
    return oracles.claims(config).ids


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


# -- the run loop ---------------------------------------------------------------------------


class Run:
    """One engine on ``factory(config)`` (and one on the reference, if any), fed one operation at a
    time; ``apply`` returns the finding an operation produced, or None."""

    def __init__(self, config: OffloadConfig, factory: TargetFactory, oracle: Iterable[str],
                 reference: TargetFactory | None = None, rare: RarePaths | None = None) -> None:
        self.ids = tuple(oracle)
        self.engine = Engine(factory(config))
        self.ref = Engine(reference(config)) if reference is not None else None
        self.rare = rare
        self.index = 0
        self.rejected = 0
        self._snapshot: dict[str, Any] | None = None  # the engine's snapshot after the last operation

    def apply(self, op: dict[str, Any], recorded: bool = True) -> Outcome | None:
        """Run ``op``. ``recorded``: the operation comes from a trace, so its ``expect`` must hold
        (accepted unless ``"expect": "error"``); a generated operation may be rejected freely.
        Returns the finding, or None (accepted and judged clean, or rejected cleanly)."""
        i, self.index = self.index, self.index + 1
        name = str(op.get("op"))
        expect_error = op.get("expect") == "error"
        clean = {k: v for k, v in op.items() if k != "expect"}
        before = self._snapshot if self._snapshot is not None else self.engine.snapshot()
        self._snapshot = None
        try:
            self.engine.apply(clean)
            rejected: KVSpecError | None = None
        except KVSpecError as exc:
            rejected = exc
        except Exception as exc:  # anything else inside the engine or the target is a crash
            return self._crash(i, name, exc)
        if rejected is not None:
            if self.engine.snapshot() != before:
                return self._crash(i, name, rejected, "its rejection changed the state")
            self.rejected += 1
            self._snapshot = before
        if recorded and expect_error and rejected is None:
            return Outcome(i + 1, op_index=i, op_name=name, rejected=self.rejected,
                           expectation=f"{name} was expected to be rejected, and was accepted")
        if recorded and not expect_error and rejected is not None:
            by_target = _raised_in(rejected, (self.engine.target, self.engine.gpu))
            why = "the target rejected it" if by_target else "the engine rejected it (bad input in the trace)"
            return Outcome(i + 1, op_index=i, op_name=name, rejected=self.rejected, input_error=not by_target,
                           expectation=f"{name} is recorded as accepted (no \"expect\": \"error\"), but {why}: "
                           f"{type(rejected).__name__}: {rejected}")
        if self.ref is not None:
            found = self._compare(i, name, clean, rejected)
            if found is not None:
                return found
        if rejected is not None:
            return None
        snap = self._snapshot = self.engine.snapshot()
        if self.rare is not None:
            self.rare.observe(before, snap, clean)
        violations = check(snap, self.ids)
        if violations:
            return Outcome(i + 1, violation=violations[0], op_index=i, op_name=name, rejected=self.rejected)
        return None

    def _crash(self, i: int, name: str, exc: BaseException, why: str = "") -> Outcome:
        text = f"{name}: {type(exc).__name__}: {exc}" + (f" ({why})" if why else "")
        return Outcome(i + 1, op_index=i, op_name=name, crash=text[:500], exception=type(exc).__name__,
                       rejected=self.rejected)

    def _compare(self, i: int, name: str, op: dict[str, Any], rejected: KVSpecError | None) -> Outcome | None:
        assert self.ref is not None
        try:
            self.ref.apply(op)
            ref_rejected = False
        except KVSpecError:
            ref_rejected = True
        except Exception as exc:
            return Outcome(i + 1, op_index=i, op_name=name, rejected=self.rejected,
                           divergence=f"{name}: the reference crashed: {type(exc).__name__}: {exc}"[:500])
        if ref_rejected != (rejected is not None):
            return Outcome(i + 1, op_index=i, op_name=name, rejected=self.rejected,
                           divergence=f"{name}: target {'rejected' if rejected else 'accepted'} it, reference "
                           f"{'rejected' if ref_rejected else 'accepted'} it")
        diff = first_difference(self.ref.snapshot(), self.engine.snapshot())
        if diff is not None:
            return Outcome(i + 1, op_index=i, op_name=name, divergence=diff, rejected=self.rejected)
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
              reference: TargetFactory | None = None, rare: RarePaths | None = None) -> Run | Outcome:
    """A ``Run``, or the crash of building the target (a finding at no operation)."""
    try:
        return Run(config, factory, oracle, reference, rare)
    except KVSpecError:
        raise
    except Exception as exc:
        return Outcome(0, crash=f"building the target: {type(exc).__name__}: {exc}"[:500],
                       exception=type(exc).__name__, op_name="(setup)")


def run_ops(config: OffloadConfig, ops: Iterable[dict[str, Any]], factory: TargetFactory,
            oracle: Iterable[str] | None = None, reference: TargetFactory | None = None,
            rare: RarePaths | None = None) -> Outcome:
    """Apply recorded ``ops`` to a fresh engine on ``factory(config)``; stop at the first finding.
    ``oracle`` defaults to the claims of ``config.policy``. ``ops`` may be a stream."""
    run = start_run(config, factory, oracle if oracle is not None else default_oracle(config), reference, rare)
    if isinstance(run, Outcome):
        return run
    for op in ops:
        found = run.apply(op)
        if found is not None:
            return found
    return Outcome(run.index, rejected=run.rejected)


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
             oracle: Iterable[str], rare: RarePaths | None = None) -> tuple[list[dict[str, Any]], Outcome]:
    """Draw up to ``n_ops`` state-aware operations on a fresh target; stop at the first finding.
    Operations the target rejects cleanly change nothing, so they are counted and left out of the
    returned list (the list replays to the same states)."""
    run = start_run(config, factory, oracle, None, rare)
    if isinstance(run, Outcome):
        return [], run
    ops: list[dict[str, Any]] = []
    for _ in range(n_ops):
        op = next_op(run.engine, rng)
        seen = run.rejected
        found = run.apply(op, recorded=False)
        if found is not None:
            ops.append(op)
            found.op_index = len(ops) - 1
            return ops, found
        if run.rejected == seen:
            ops.append(op)
    return ops, Outcome(len(ops), rejected=run.rejected)


def shrink(config: OffloadConfig, ops: list[dict[str, Any]], factory: TargetFactory, oracle: Iterable[str],
           finding: Outcome, deadline: float) -> tuple[list[dict[str, Any]], Outcome]:
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
                out = run_ops(config, cand, factory, ids)
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
         bug: str | None = None, on_finding: FindingSink | None = None) -> FuzzResult:
    """Random traces until a finding or ``budget`` seconds. ``oracle`` is an oracle spec
    (``kvspec.oracle.resolve``: None/``claims``, ``all`` or ids), resolved for each random
    configuration; ``bug`` names the known-bug variant under test. A finding is handed to
    ``on_finding`` unshrunk, then shrunk; Ctrl-C returns what was found so far."""
    rng = random.Random(seed)
    start = time.monotonic()
    rare = RarePaths()
    res = FuzzResult(False, 0.0, 0, 0, rare=rare.counts)
    try:
        while time.monotonic() - start < budget:
            cfg = config_for(rng) if config_for else random_config(rng, policy, lazy)
            orc = oracles.resolve(oracle, cfg, bug)
            res.oracle = orc.name
            trace_ops, out = generate(cfg, factory, rng, ops_per_trace, orc.ids, rare)
            res.traces += 1
            res.ops += len(trace_ops)
            res.rejected += out.rejected
            if progress is not None:
                progress(res.traces, res.ops, time.monotonic() - start)
            if not out.failed:
                continue
            res.found, res.outcome = True, out
            res.search_seconds = time.monotonic() - start
            res.unshrunk = _finding_trace(cfg, trace_ops, target_name, seed, orc, out)
            if on_finding is not None:
                on_finding(res.unshrunk, "unshrunk")
            try:
                small, small_out = shrink(cfg, trace_ops, factory, orc.ids, out, time.monotonic() + max(5.0, budget))
            except ShrinkInterrupted as stop:
                res.interrupted = True
                small, small_out = stop.ops, stop.outcome
            res.outcome = small_out
            res.trace = _finding_trace(cfg, small, target_name, seed, orc, small_out)
            if on_finding is not None:
                on_finding(res.trace, "shrunk")
            break
    except KeyboardInterrupt:
        res.interrupted = True
    res.seconds = time.monotonic() - start
    if not res.found:
        res.search_seconds = res.seconds
    return res


def _finding_trace(cfg: OffloadConfig, ops: list[dict[str, Any]], target: str, seed: int,
                   orc: oracles.Oracle, out: Outcome) -> Trace:
    return Trace(replace(cfg), list(ops), target, seed, note=f"finding: {out.describe()}"[:2000],
                 oracle=orc.ids, finding=out.finding())


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
            except Exception as exc:  # a crash: saved as a trace like any finding, then re-raised
                self._fail_if(True, f"{op['op']} crashed: {type(exc).__name__}: {exc}")
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
                    trace = Trace(self.config, self.ops, "harness", None, note=message[:2000])
                    save_trace(trace, trace_dir, finding_name("harness", policy, "claims", trace))
                raise AssertionError(message)

        def _live(self) -> Engine:
            """The engine: ``setup`` (the @initialize rule) runs before every other rule."""
            assert self.engine is not None
            return self.engine

        def _waiting(self) -> list[str]:
            return [r for r, q in self._live().requests.items() if q.status in ("waiting", "preempted")]

        def _running(self) -> list[str]:
            return [r for r, q in self._live().requests.items() if q.status in ("running", "loaded")]

        # -- rules ----------------------------------------------------------------------
        @rule(target=requests, family=st.integers(0, 2), blocks=st.integers(1, 6), extra=st.sampled_from([0, 1, 8]),
              max_tokens=st.sampled_from([1, 2, 16, 32]))
        def add(self, family: int, blocks: int, extra: int, max_tokens: int) -> str:
            rid = f"r{self._live().num_added}"
            self._apply({"op": "add", "rid": rid, "family": family, "prompt_len": blocks * 16 + extra,
                         "max_tokens": max_tokens})
            return rid

        @rule(data=st.data(), chunk=st.sampled_from([16, 32, 64]), resume=st.sampled_from(["mrv1", "mrv2"]))
        def step(self, data: Any, chunk: int, resume: str) -> None:
            waiting, running = self._waiting(), self._running()
            admit = data.draw(st.lists(st.sampled_from(waiting), unique=True)) if waiting else []
            preempt = data.draw(st.lists(st.sampled_from(running), unique=True, max_size=1)) if running else []
            self._apply({"op": "step", "admit": admit, "chunk": chunk, "preempt": preempt, "resume": resume})
            lost = len(self._live().snapshot()["scheduler"]["policy_state"].get("lost", []))
            self.max_lost = max(self.max_lost, lost)

        @precondition(lambda self: self.engine is not None and bool(self.engine.reports_left))
        @rule(data=st.data())
        def report(self, data: Any) -> None:
            reports_left = self._live().reports_left
            e = data.draw(st.sampled_from(sorted(reports_left)))
            count = data.draw(st.integers(1, reports_left[e]))
            self._apply({"op": "report", "event": e, "count": count})

        @precondition(lambda self: self.engine is not None and bool(self.engine.loads_shipped))
        @rule(data=st.data())
        def load_done(self, data: Any) -> None:
            self._apply({"op": "load_done", "rid": data.draw(st.sampled_from(sorted(self._live().loads_shipped)))})

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
            if self.engine is None or self.config is None:  # (both are set by setup)
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
