"""Z3's completeness counterexamples become engine traces that reach the solver's state.

For the baseline (T2) and signal-rescan (H1, H3) Z3 must FIND a step that breaks the policy's
completeness claim; ``kvspec.drivers.synthesis`` turns each model into a trace (synchronous
scheduling). Here every trace is written, read back and run on the model: the refinement map
of the state it reaches equals the model's pre-state, the failing step leaves exactly the
model's holes (C1, with the signal-rescan flag clear), they stay, ``kvspec replay`` reproduces
the recorded finding, and every operation of the trace is a run of the transitions (R1).
Besides the obligations' own models, the solver is asked for several distinct ones per
obligation (each blocked in turn), built at block sizes 2, 4 and 16.

The convergence counterexamples of the repair policy (``convergence:drop-E1/E2/E3``: C4's ranking
without one environment assumption) become traces the same way: each reaches the model's
pre-state, its failing step leaves exactly the model's pending set (lost records and holes), grown
by the eviction (E1), kept by a round without room and the steps after it (E2), or kept by a
completion (E3); the repair policy's claims (C2, C4, ...) still hold on every operation, since
each trace breaks an assumption C4 makes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import z3

from kvspec.cli import main
from kvspec.drivers import synthesis
from kvspec.drivers.engine import Engine
from kvspec.drivers.harness import run_ops
from kvspec.drivers.synthesis import Synthesis, base_name, expected_state, goal_of, synthesize, verify
from kvspec.drivers.trace import loads
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import check
from kvspec.specs import convergence as cv
from kvspec.specs import obligations as O
from kvspec.specs.encoding import Encoding, Quant, State, Unrolled, reset_names
from kvspec.specs.obligations import BOUND, COUNTEREXAMPLES, catalogue
from kvspec.specs.realizable import POSITIONS, realizable, status_bits
from kvspec.specs.refinement import abstract_snapshot

NAMES = sorted(ob.name for ob in catalogue() if ob.kind == "counterexample" and base_name(ob.name) in COUNTEREXAMPLES)
VARIANTS = 4  # distinct models asked for per obligation and encoding
BLOCK = 4


@pytest.fixture(scope="module")
def found() -> dict[str, dict[str, Any]]:
    out = {}
    for ob in catalogue():
        if ob.name in NAMES:
            res = ob.run()
            assert res.result == "found", f"{ob.name}: {res.result} {res.detail}"
            out[ob.name] = res.model
    return out


@pytest.fixture(scope="module")
def varied() -> list[tuple[str, dict[str, Any]]]:
    """VARIANTS distinct models per obligation and encoding (the encodings may share one), one
    group and two."""
    out = []
    for name, cx in COUNTEREXAMPLES.items():
        for enc in (Quant(1), Unrolled(1, BOUND), Quant(2), Unrolled(2, BOUND)):
            reset_names()
            r, d, models = cx.find(enc, VARIANTS)
            assert r == "found" and len(models) == VARIANTS, (name, enc.kind, r, d)
            out += [(name, m) for m in models]
    return out


def _synth(name: str, cex: dict[str, Any], block: int = BLOCK) -> Synthesis:
    syn = synthesize(name, cex, block)
    assert syn is not None, f"{name}: no trace reaches {expected_state(cex)}"
    return syn


def test_every_completeness_counterexample_is_covered() -> None:
    assert NAMES == ["bounded:completeness-c1:T2[N<=8]", "bounded:completeness-flag:H1[N<=8]",
                     "bounded:completeness-flag:H3[N<=8]", "completeness-c1:T2", "completeness-c1:T2[G=2]",
                     "completeness-flag:H1", "completeness-flag:H1[G=2]", "completeness-flag:H3",
                     "completeness-flag:H3[G=2]"]


@pytest.mark.parametrize("name", NAMES)
def test_obligation_model_becomes_a_trace_that_reaches_it(found: dict[str, dict[str, Any]], name: str) -> None:
    """Checked here without ``verify``: the trace file, run on a fresh engine up to its failing
    step, leaves the focal request in a state whose refinement map is the model's pre-state,
    every array position by position; the failing step then leaves C1 exactly at the model's
    post-state holes."""
    cex = found[name]
    syn = _synth(name, cex)
    trace = loads(syn.trace(name).dumps())
    assert trace.config.async_scheduling is False and trace.config.block_size == BLOCK
    e = Engine(make_scheduler(trace.config))
    for op in trace.ops[: syn.failing]:
        e.apply(op)
    state = abstract_snapshot(e.snapshot())["R"]
    assert state.active and state.conf == cex["pre.conf"] and state.flag == cex["pre.flag"]
    for g, grp in enumerate(state.groups):
        assert (grp.n, grp.cur) == (cex[f"pre.N{g}"], cex[f"pre.cur{g}"])
        for a in ("hashed", "owned", "cached", "cfree", "infl", "lost"):
            assert list(grp.bits[a]) == cex[f"pre.{a}{g}"][: grp.n], (g, a)
    e.apply(trace.ops[syn.failing])
    holes = {(g, p) for g in range(len(state.groups)) for p in range(cex[f"pre.cur{g}"])
             if cex[f"post.owned{g}"][p] and cex[f"post.hashed{g}"][p]
             and not cex[f"post.cached{g}"][p] and not cex[f"post.infl{g}"][p]}
    reported = {(int(v.message.split()[1]), int(v.message.split()[3].rstrip(":")))
                for v in check(e.snapshot(), ["C1"])}
    assert reported == holes != set()


@pytest.mark.parametrize("name", NAMES)
def test_trace_replays_to_the_recorded_finding(found: dict[str, dict[str, Any]], name: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``kvspec replay`` finds C1 where the trace says; for the baseline that is the failing step
    itself (its pre-state has no hole), for signal-rescan the eviction before it (a hole with the
    flag set, which the flag's claim allows)."""
    syn = _synth(name, found[name])
    trace = syn.trace(name)
    assert trace.finding is not None
    expected_at = syn.failing if base_name(name).endswith("T2") else syn.failing - 1
    assert trace.finding["op_index"] == expected_at
    path = tmp_path / "cex.jsonl"
    trace.write(path)
    assert main(["replay", str(path)]) == 1
    assert f"recorded finding: violation C1 at operation {expected_at}: reproduced" in capsys.readouterr().out
    out = run_ops(trace.config, trace.ops, make_scheduler, ["C1"])
    assert out.violation is not None and out.violation.id == "C1" and out.op_index == expected_at


@pytest.mark.parametrize("name", NAMES)
def test_trace_refines_the_transitions(found: dict[str, dict[str, Any]], name: str) -> None:
    """Every operation of the trace is admitted by the transitions (the refinement check, R1)."""
    syn = _synth(name, found[name])
    out = run_ops(syn.config, syn.ops, make_scheduler, [], refine=True)
    assert not out.failed, out.describe()


@pytest.mark.parametrize("block", [BLOCK, pytest.param(16, marks=pytest.mark.deep)])
def test_varied_models_all_become_traces(varied: list[tuple[str, dict[str, Any]]], block: int) -> None:
    """Every varied model becomes a verified trace (at block size ``BLOCK``; at 16 in the deep run)."""
    lengths: dict[str, list[int]] = {}
    for name, cex in varied:
        syn = _synth(name, cex, block)
        assert verify(name, cex, syn) is None
        lengths.setdefault(name, []).append(len(syn.ops))
    assert set(lengths) == set(COUNTEREXAMPLES)


def test_varied_models_differ_in_shape(varied: list[tuple[str, dict[str, Any]]]) -> None:
    """The blocked queries give distinct pre-states, and among them shapes the old fixed traces
    (every position below the cursor cached, or all of them holes) could not express."""
    goals = [goal_of(name, cex) for name, cex in varied]
    for i in range(0, len(goals), VARIANTS):  # one obligation on one encoding: all distinct
        assert len({(g.cur, g.conf, g.n, g.status, g.evicted) for g in goals[i: i + VARIANTS]}) == VARIANTS
    assert any("I" in g.status for g in goals)  # a store still in flight below the cursor
    assert any(g.cur < g.conf for g in goals)  # confirmed positions the scan has not reached
    assert any(g.n == g.conf for g in goals) and any(g.n == g.conf + 1 for g in goals)
    assert any(len(g.holes_after) >= 2 for g in goals)
    assert {g.groups for g in goals} == {1, 2}


def _count(enc: Encoding, s: State, status: str) -> z3.ArithRef:
    return z3.Sum([z3.If(z3.And(p < s.groups[0].cur, status_bits(enc, s, p)[status]), 1, 0)
                   for p in range(POSITIONS)])


SHAPED: dict[str, tuple[str, Any, Any]] = {
    # name: (policy, step, extra constraints on (enc, s, step)), on top of the obligation's own
    "completeness-c1:T2": ("baseline", O.evict, lambda enc, s, st: [
        _count(enc, s, "I") >= 1, s.groups[0].cur < s.conf,
        z3.Sum([z3.If(z3.And(enc.v(s, 0, "cached", p), z3.Not(enc.v(st.post, 0, "cached", p))), 1, 0)
                for p in range(POSITIONS)]) >= 2]),
    "completeness-flag:H1": ("signal-rescan", O.plan_scan, lambda enc, s, st: [
        z3.Not(st.inputs["scheduled"]), _count(enc, s, "I") >= 1, _count(enc, s, "C") >= 1,
        _count(enc, s, "H") >= 2]),
    "completeness-flag:H3": ("signal-rescan", O.plan_scan, lambda enc, s, st: [
        st.inputs["scheduled"], s.flag, st.inputs["free"] == 0, _count(enc, s, "I") >= 2,
        _count(enc, s, "H") >= 2]),
}


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_shaped_models_become_traces(name: str) -> None:
    """Asked for shapes no fixed story had (stores in flight below the cursor between holes and
    cached copies, two or more holes, confirmed positions past the cursor), Z3 finds models in
    the fragment and each becomes a trace that reaches it."""
    policy, step, shape = SHAPED[name]
    prop = "c1" if policy == "baseline" else "flag"
    for enc in (Quant(1), Unrolled(1, BOUND)):
        reset_names()
        r, d, models = O.counterexamples(enc, policy, prop, step, lambda s, st, enc=enc: [
            *shape(enc, s, st), *realizable(enc, policy, s, st)], 2)
        assert r == "found" and len(models) == 2, (enc.kind, r, d)
        for cex in models:
            goal = goal_of(name, cex)
            assert goal.status.count("I") >= 1 and len(goal.holes_after) >= (2 if "H" in name else 1)
            assert verify(name, cex, _synth(name, cex)) is None


def test_small_blocks_for_t2_and_h1(varied: list[tuple[str, dict[str, Any]]]) -> None:
    """Block size 2 builds every T2 and H1 model; H3's decoding request confirms a block every
    two steps there, too fast to stop at the model's confirmed count (block size 4 and 16 do)."""
    for name, cex in varied:
        if not name.endswith("H3"):
            assert verify(name, cex, _synth(name, cex, 2)) is None


def test_verify_rejects_a_trace_for_another_state(found: dict[str, dict[str, Any]]) -> None:
    """A trace checked against a model whose pre-state differs in one bit is refused (the check
    compares the whole abstract state, position by position)."""
    name = "completeness-c1:T2"
    cex = found[name]
    syn = _synth(name, cex)
    k = cex["pre.cur0"]
    flipped = dict(cex)
    flipped["pre.infl0"] = [not b if p == k else b for p, b in enumerate(cex["pre.infl0"])]
    problem = verify(name, flipped, syn)
    assert problem is not None and problem.startswith("pre-state")
    shorter = replace(syn, ops=syn.ops[:-1])  # the last tail step dropped: still correct
    assert verify(name, cex, shorter) is None
    early = replace(syn, failing=syn.failing - 1)  # the pre-state one operation early
    assert verify(name, cex, early) is not None


def test_prove_writes_the_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvspec prove --traces DIR`` synthesises each completeness counterexample's trace (its
    length in the table) and writes it; each file replays to its recorded finding."""
    assert main(["prove", "-k", "completeness-flag:H3", "--traces", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.count("reach the pre-state, operation") == 3
    files = sorted((tmp_path / "t").glob("*.jsonl"))
    assert [f.name for f in files] == ["bounded_completeness-flag_H3_N_8_-signal-rescan.jsonl",
                                       "completeness-flag_H3-signal-rescan.jsonl",
                                       "completeness-flag_H3_G_2_-signal-rescan.jsonl"]
    for f in files:
        assert main(["replay", str(f)]) == 1
        assert ": reproduced" in capsys.readouterr().out


def test_prove_fails_without_a_trace(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A counterexample no trace reaches is a failure of ``kvspec prove`` (``no trace``)."""
    monkeypatch.setattr(synthesis, "synthesize", lambda name, cex, block: None)
    assert main(["prove", "-k", "completeness-c1:T2"]) == 1
    assert "no trace" in capsys.readouterr().out


# -- convergence counterexamples (repair) -------------------------------------------------------

DROPS = sorted(synthesis.DROPS)


@pytest.fixture(scope="module")
def dropped() -> dict[str, list[dict[str, Any]]]:
    """Per convergence counterexample, the obligation's own model first, then VARIANTS - 1 more,
    each asked for with the earlier ones blocked (pre-state and post-state as shown)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for ob in catalogue():
        if ob.name in DROPS:
            res = ob.run()
            assert res.result == "found", f"{ob.name}: {res.result} {res.detail}"
            out[ob.name] = [res.model]
    for name in DROPS:
        reset_names()
        enc = Unrolled(1, BOUND)
        pre, post, inputs, cons = cv.drop(name.removeprefix("convergence:drop-"), enc)
        shown = [*O._shown_terms(enc, pre, POSITIONS).values(), *O._shown_terms(enc, post, POSITIONS).values()]
        blocked: list[z3.BoolRef] = []
        while len(out[name]) < VARIANTS:
            r, sv = O._check([*cons, *blocked])
            assert r == z3.sat, (name, len(out[name]))
            m = sv.model()
            vals = O._read_step(m, enc, pre, post, inputs)
            if vals not in out[name]:
                out[name].append(vals)
            blocked.append(z3.Not(z3.And([x == m.eval(x, model_completion=True) for x in shown])))
    return out


def _lost(e: Engine) -> set[tuple[int, int]]:
    return {(g, p) for r, g, p in e.snapshot()["scheduler"]["policy_state"]["lost"] if r == "R"}


def _model_lost(cex: dict[str, Any], tag: str) -> set[tuple[int, int]]:
    return {(0, p) for p, b in enumerate(cex[f"{tag}.lost0"]) if b}


@pytest.mark.parametrize("name", DROPS)
def test_convergence_counterexample_becomes_a_trace(dropped: dict[str, list[dict[str, Any]]], name: str) -> None:
    """Checked here without ``verify``: the trace file reaches a state whose refinement map is the
    model's pre-state, array by array; the failing step then leaves the engine's lost records
    exactly at the model's post-state records: more of them after the eviction (E1), the same
    after the round without room and every later step (E2) and after the completion (E3)."""
    cex = dropped[name][0]
    syn = _synth(name, cex)
    trace = loads(syn.trace(name).dumps())
    e = Engine(make_scheduler(trace.config))
    for op in trace.ops[: syn.failing]:
        e.apply(op)
    state = abstract_snapshot(e.snapshot())["R"]
    grp = state.groups[0]
    assert state.active and state.conf == cex["pre.conf"] and (grp.n, grp.cur) == (cex["pre.N0"], cex["pre.cur0"])
    for a in ("hashed", "owned", "cached", "cfree", "infl", "lost"):
        assert list(grp.bits[a]) == cex[f"pre.{a}0"][: grp.n], a
    before = _lost(e)
    assert before == _model_lost(cex, "pre")
    for op in trace.ops[syn.failing:]:
        e.apply(op)
        assert _lost(e) == _model_lost(cex, "post")
    if name.endswith("E1"):
        assert _lost(e) > before
    else:
        assert _lost(e) == before != set()
    assert len(trace.ops) - syn.failing == (1 + synthesis.TAIL if name.endswith("E2") else 1)


@pytest.mark.parametrize("sizes", [(BLOCK,), pytest.param((2, 16), marks=pytest.mark.deep)], ids=["4", "2+16"])
def test_varied_convergence_models_all_become_traces(dropped: dict[str, list[dict[str, Any]]],
                                                     sizes: tuple[int, ...]) -> None:
    """VARIANTS distinct models per convergence counterexample, each built at block sizes 2 and 4
    (and the obligation's own at 16), each verified; as for H3, a decoding request (an E2 round
    in which the request is scheduled) is not built at block size 2. Block size 4 in the default
    run, 2 and 16 in the deep one."""
    for name in DROPS:
        assert len({str(sorted(m.items())) for m in dropped[name]}) == VARIANTS
        for i, cex in enumerate(dropped[name]):
            small = () if cex.get("scheduled") else (2,)
            for block in [b for b in (*small, BLOCK, *((16,) if i == 0 else ())) if b in sizes]:
                assert verify(name, cex, _synth(name, cex, block)) is None, (name, i, block)


@pytest.mark.parametrize("name", DROPS)
def test_convergence_trace_keeps_the_repair_claims(dropped: dict[str, list[dict[str, Any]]], name: str,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The repair policy's claims (its default oracle, C4 included) hold on every operation and the
    refinement check admits each (R1); ``kvspec replay`` reports nothing. C4 promises convergence
    only after a quiescent step with capacity for the working set; the E2 trace's steps are not
    such steps (stores stay in flight), so C4 says nothing there while the records stay."""
    cex = dropped[name][0]
    syn = _synth(name, cex)
    out = run_ops(syn.config, syn.ops, make_scheduler, refine=True)
    assert not out.failed, out.describe()
    path = tmp_path / "conv.jsonl"
    syn.trace(name).write(path)
    assert main(["replay", str(path)]) == 0
    assert "no finding" in capsys.readouterr().out
    if name.endswith("E2"):
        e = Engine(make_scheduler(syn.config))
        for op in syn.ops:
            e.apply(op)
        assert e.snapshot()["engine"]["converging_step"] is False and _lost(e)


def test_verify_rejects_a_convergence_trace_for_another_model(dropped: dict[str, list[dict[str, Any]]]) -> None:
    """A model whose post-state keeps the evicted copy (no new record) is refused, and so is a
    trace read one operation early (the pre-state is after the eviction)."""
    name = "convergence:drop-E1"
    cex = dropped[name][0]
    syn = _synth(name, cex)
    unchanged = dict(cex, **{"post.lost0": cex["pre.lost0"], "post.cached0": cex["pre.cached0"],
                             "post.cfree0": cex["pre.cfree0"]})
    assert verify(name, unchanged, syn) is not None
    assert verify(name, cex, replace(syn, failing=syn.failing - 1)) is not None
    assert verify(name, cex, replace(syn, failing=syn.failing + 1)) is not None


def test_prove_writes_the_convergence_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvspec prove --traces DIR`` writes a trace per convergence counterexample."""
    assert main(["prove", "-k", "convergence:drop", "--traces", str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.count("reach the pre-state, operation") == 3
    assert sorted(f.name for f in (tmp_path / "t").glob("*.jsonl")) == [
        "convergence_drop-E1-repair.jsonl", "convergence_drop-E2-repair.jsonl", "convergence_drop-E3-repair.jsonl"]
