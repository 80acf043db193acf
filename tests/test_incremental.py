"""Incremental checking (kvspec.oracle.incremental) gives the full check's verdicts.

Four checks: (1) on random traces of correct targets and of known-bug variants, after every
operation the incremental oracle returns exactly what ``catalogue.check`` returns; (2) each
invariant's declared parts (``READS``) are all it reads: perturbing any other part of a real
snapshot leaves its verdict unchanged; (3) a planted mutation (one part dropped from one
invariant's ``READS``) is caught by (2), and a grosser one by (1); (4) a lean run (the engine
measures only the facts of ``OBSERVATIONS`` its oracle reads, as the fuzzer's runs do) gives the
same verdicts and the same read facts as a fully observing one, and a lean engine that measures
nothing is caught.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest

from kvspec.adapters import claims as claimed
from kvspec.adapters.targets import get_factory
from kvspec.contract.errors import KVSpecError
from kvspec.drivers import harness
from kvspec.drivers import trace as trace_io
from kvspec.drivers.engine import OBSERVATIONS, Engine
from kvspec.drivers.harness import Run
from kvspec.drivers.opgen import OpGenerator, RandomChoices, random_config
from kvspec.oracle.catalogue import CATALOGUE, check
from kvspec.oracle.incremental import READS, IncrementalOracle, Part

ALL = tuple(CATALOGUE)


def _snapshots(target: str, policy: str, seed: int, n_ops: int = 60) -> list[dict[str, Any]]:
    """The snapshots after each accepted operation of one random trace on ``target``."""
    rng = random.Random(seed)
    cfg = random_config(RandomChoices(rng), policy, False)
    engine = Engine(get_factory(target)(cfg))
    gen = OpGenerator(cfg, RandomChoices(rng))
    out = []
    for _ in range(n_ops):
        try:
            engine.apply(gen.next_op(engine))
        except Exception:  # a rejection or a bug variant's crash: the trace ends here
            break
        out.append(engine.snapshot())
    return out


def _disagreements(snaps: list[dict[str, Any]], reads: dict[str, tuple[Part, ...]] | None = None) -> list[str]:
    inc = IncrementalOracle(ALL, reads)
    bad = []
    for n, snap in enumerate(snaps):
        full, got = check(snap, ALL), inc.check(snap)
        if [str(v) for v in full] != [str(v) for v in got]:
            bad.append(f"operation {n}: full {[v.id for v in full]} != incremental {[v.id for v in got]}")
    return bad


TRACES = [("model", "repair"), ("model", "baseline"), ("model", "signal-rescan"), ("impl", "repair"),
          ("bug:stale-cursor", "repair"), ("bug:self-eviction", "repair"), ("bug:thrash", "repair"),
          ("bug:final-step-lost", "repair"), ("bug:pin-leak", "baseline"),
          ("bug:world-size-ignored", "baseline"), ("bug:reset-releases-inflight", "baseline"),
          ("bug:dedup-by-gpu-id", "repair")]


@pytest.mark.parametrize(("target", "policy"), TRACES)
def test_incremental_agrees_with_full(target: str, policy: str) -> None:
    found = []
    for seed in range(6 if target == "impl" else 12):
        snaps = _snapshots(target, policy, seed)
        assert _disagreements(snaps) == []
        found += [v.id for s in snaps for v in check(s, ALL)]
    if target.startswith("bug:"):
        assert found, f"{target}: no trace broke an invariant, so the agreement above judged only clean states"


@pytest.mark.parametrize("id_", ALL)
def test_a_single_invariant_oracle_agrees_with_its_full_check(id_: str) -> None:
    """``--oracle C1`` (issue 32): the incremental oracle of one invariant gives that invariant's
    full verdict after every operation. C1 lists the GPU hashes twice in its reads; their bit,
    added twice, once carried into another part's and C1 stopped seeing its own."""
    bad = []
    for target, policy in (("model", "baseline"), ("model", "repair"), ("bug:vllm-fixme", "baseline")):
        for seed in range(4):
            inc = IncrementalOracle((id_,))
            for n, snap in enumerate(_snapshots(target, policy, seed)):
                full, got = check(snap, (id_,)), inc.check(snap)
                if [str(v) for v in full] != [str(v) for v in got]:
                    bad.append(f"{target}/{policy} seed {seed} operation {n}: full {len(full)} != "
                               f"incremental {len(got)}")
    assert bad == []


def _perturbed(value: Any) -> list[Any]:
    """Other values of a snapshot part, of the same shape where possible."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, 0]
    if isinstance(value, str):
        return [value + "x", None]
    if value is None:
        return ["reset", 1]
    if isinstance(value, list):
        out: list[Any] = [[]]
        if value:
            out += [value[:-1], value[::-1], [_bump(v) for v in value]]
        return out
    if isinstance(value, dict):
        out = [{}]
        if value:
            out += [dict(list(value.items())[1:]), {k: _bump(v) for k, v in value.items()}]
        return out
    return [None]


def _bump(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, list, dict)):
        return v
    if isinstance(v, int):
        return v + 1
    return _perturbed(v)[-1] if v else v


def _set(snap: dict[str, Any], part: Part, value: Any) -> dict[str, Any] | None:
    out = copy.deepcopy(snap)
    node = out
    for key in part[:-1]:
        if key not in node:
            return None
        node = node[key]
    if part[-1] not in node:
        return None
    node[part[-1]] = value
    return out


def _parts(snap: dict[str, Any]) -> list[Part]:
    """Every second-level part of a snapshot (section, field)."""
    return [(sec, f) for sec, body in snap.items() if isinstance(body, dict) for f in body]


def _verdict(id_: str, snap: dict[str, Any]) -> Any:
    try:
        return [str(v) for v in CATALOGUE[id_].fn(snap)]
    except Exception as exc:
        return f"raised {type(exc).__name__}"


def _undeclared_reads(reads: dict[str, tuple[Part, ...]], snaps: list[dict[str, Any]],
                      only: Part | None = None) -> set[tuple[str, Part]]:
    """(invariant, part) pairs where perturbing a part not in the invariant's READS changed its verdict
    (every part, or ``only`` that one)."""
    found: set[tuple[str, Part]] = set()
    for snap in snaps:
        for part in _parts(snap) if only is None else [p for p in _parts(snap) if p == only]:
            base = {i: _verdict(i, snap) for i in ALL if part not in reads[i]}
            node: Any = snap
            for key in part:
                node = node[key]
            for value in _perturbed(node):
                other = _set(snap, part, value)
                if other is None:
                    continue
                found.update((i, part) for i, want in base.items()
                             if (i, part) not in found and _verdict(i, other) != want)
    return found


def _read_set_corpus() -> list[dict[str, Any]]:
    snaps = []
    for target, policy in TRACES:
        for seed in range(3):
            s = _snapshots(target, policy, seed, 40)
            snaps += s[:: max(1, len(s) // 6)]
    return snaps


@pytest.fixture(scope="module")
def corpus() -> list[dict[str, Any]]:
    return _read_set_corpus()


def test_reads_cover_what_each_invariant_reads(corpus: list[dict[str, Any]]) -> None:
    assert set(READS) == set(CATALOGUE)
    assert _undeclared_reads(READS, corpus) == set()


def test_a_dropped_part_is_caught(corpus: list[dict[str, Any]]) -> None:
    """The planted mutation: I1 no longer declares the GPU free queue; the read-set check names it."""
    mutated = {**READS, "I1": tuple(p for p in READS["I1"] if p != ("gpu_pool", "free_queue"))}
    assert ("I1", ("gpu_pool", "free_queue")) in _undeclared_reads(mutated, corpus, ("gpu_pool", "free_queue"))


def test_a_blind_invariant_is_caught_on_traces() -> None:
    """A grosser mutation the agreement check alone catches: C2 reads only a part that never changes,
    so it runs on the first snapshot only and misses the stale-cursor variant's C2 violation."""
    mutated = {**READS, "C2": (("scheduler", "policy"),)}
    assert any(_disagreements(_snapshots("bug:stale-cursor", "repair", seed), mutated) for seed in range(12))


def test_identical_containers_count_as_touched() -> None:
    """A target that hands out the same (possibly mutated) object twice is re-checked."""
    snap = _snapshots("model", "repair", 0, 5)[-1]
    inc = IncrementalOracle(("I1",))
    assert inc.check(snap) == []
    before = inc.ran
    inc.check(snap)
    assert inc.ran == before + 1
    inc.check(copy.deepcopy(snap))
    assert inc.ran == before + 1  # an equal copy is untouched: skipped


# -- lean runs: the engine measures only the facts the oracle reads -------------------------------

LEAN = [("model", "repair", None), ("model", "baseline", None), ("model", "signal-rescan", None),
        ("bug:vllm-fixme", "baseline", ("C4",)), ("bug:self-eviction", "repair", ("C5",)),
        ("bug:thrash", "repair", ("C6",)), ("bug:dedup-by-gpu-id", "repair", ("C3",)),
        ("bug:final-step-lost", "repair", ("C7",)), ("bug:final-step-lost", "repair", ("I5", "C3"))]


def _lean_disagreements(target: str, policy: str, oracle: tuple[str, ...] | None, seed: int) -> tuple[list[str], int]:
    """One random trace through a full run and a lean run (``Run(lean=True)``) of ``target``: where
    their verdicts, or the engine facts the oracle reads, differ after an operation; and how many
    operations ended in a violation or showed a measured fact (so that agreement was not vacuous)."""
    rng = random.Random(seed)
    cfg = random_config(RandomChoices(rng), policy, False)
    ids = oracle if oracle is not None else claimed.resolve(None, cfg, None).ids
    full, lean = Run(cfg, get_factory(target), ids), Run(cfg, get_factory(target), ids, lean=True)
    read = [f for f in OBSERVATIONS if any(("engine", f) in READS[i] for i in ids)]
    gen = OpGenerator(cfg, RandomChoices(rng))
    bad, seen = [], 0
    for n in range(60):
        op = gen.next_op(full.engine)
        want, got = full.apply(op, recorded=False), lean.apply(op, recorded=False)
        facts = [(f, full.snapshot["engine"][f], lean.snapshot["engine"][f]) for f in read]
        if (want and want.describe()) != (got and got.describe()) or any(a != b for _, a, b in facts):
            bad.append(f"operation {n} ({op['op']}): full {want and want.describe()} {facts}, "
                       f"lean {got and got.describe()}")
        seen += bool(want) or any(a for _, a, _ in facts)
        if want is not None:
            break
    return bad, seen


@pytest.mark.parametrize(("target", "policy", "oracle"), LEAN)
def test_lean_runs_agree_with_full_observation(target: str, policy: str, oracle: tuple[str, ...] | None) -> None:
    seen = 0
    for seed in range(10):
        bad, n = _lean_disagreements(target, policy, oracle, seed)
        assert bad == []
        seen += n
    if oracle is not None:
        assert seen, f"{target} {oracle}: nothing measured or found, so the agreement judged nothing"


def test_a_blind_lean_engine_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted mutation: lean runs measure none of the engine's facts; the agreement check names it."""
    monkeypatch.setattr(harness, "engine_parts_read", lambda ids: frozenset())
    assert any(_lean_disagreements("bug:self-eviction", "repair", ("C5",), seed)[0] for seed in range(10))
    assert any(_lean_disagreements("model", "repair", None, seed)[0] for seed in range(10))


# -- recorded traces: the fuzzer's incremental path against the full check ----------------------

TRACE_DIR = Path(__file__).parent / "traces"
# the first manager's traces on kvspec's own targets (the others' need real vLLM or another driver)
RECORDED = [p for d in ("", "impl", "oracle") for p in sorted((TRACE_DIR / d).glob("*.jsonl"))
            if trace_io.read(p).target in ("model", "impl") or trace_io.read(p).target.startswith("bug:")]


def _recorded_disagreements(path: Path, oracle: IncrementalOracle) -> tuple[list[str], list[str]]:
    """Replay a recorded trace as the fuzzer runs it (an engine that keeps the target's snapshot, the
    incremental oracle told when the target's sections are the kept ones) and judge every snapshot
    both ways: where the incremental verdict differs from ``catalogue.check``'s, and the ids the
    full check found (so that agreement on a bug's trace was not only agreement on clean states)."""
    tr = trace_io.read(path)
    engine = Engine(get_factory(tr.target)(tr.config), keep_snapshots=True)
    bad, found, judged = [], [], -1
    for n, op in enumerate(tr.ops):
        try:
            engine.apply({k: v for k, v in op.items() if k != "expect"})
        except KVSpecError:
            continue  # rejected cleanly: the state is unchanged
        except Exception:  # a bug variant's crash ends its trace
            break
        snap = engine.snapshot()
        same, judged = engine.served_generation == judged, engine.served_generation
        full, got = check(snap, oracle.ids), oracle.check(snap, same)
        if [str(v) for v in full] != [str(v) for v in got]:
            bad.append(f"operation {n}: full {[str(v) for v in full]} != incremental {[str(v) for v in got]}")
        found += [v.id for v in full]
    return bad, found


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: str(p.relative_to(TRACE_DIR)))
def test_recorded_traces_incremental_agrees_with_full(path: Path) -> None:
    tr = trace_io.read(path)
    bad, found = _recorded_disagreements(path, IncrementalOracle(ALL))
    assert bad == []
    if tr.finding is not None and tr.finding.get("invariant") in CATALOGUE:  # R1 is the refinement check's
        assert tr.finding["invariant"] in found, f"{path.name}: its recorded finding was not found again"


def test_recorded_traces_catch_a_blind_incremental_oracle() -> None:
    """The planted mutation: the incremental oracle never sees the scheduler's store events change
    (their part compares equal to anything); the recorded traces' agreement check names it."""
    class Blind(IncrementalOracle):
        def _values(self, snap: dict[str, Any]) -> list[Any]:
            return [None if p == ("scheduler", "store_events") else v
                    for p, v in zip(self._parts, super()._values(snap), strict=True)]

    assert any(_recorded_disagreements(p, Blind(ALL))[0] for p in RECORDED)
