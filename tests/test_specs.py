"""The Z3 proof obligations: every one gives its expected result, and each can fail.

``test_obligation`` runs the whole catalogue of ``kvspec prove`` (proofs for every N,
bounded cross-checks with N <= 8, expected counterexamples, vacuity checks); the obligations
bounded at N <= 8 (about 35 s of the catalogue's 47 on two cores) are marked ``deep``, and the
default run keeps the rest (every proof for all N, the N <= 2 cross-checks, counterexamples,
vacuity and witnesses). The
mutation tests break one rule of a policy's encoding at a time and check that the proof
that depends on it no longer holds, so a passing proof is not a vacuous one.
"""

from __future__ import annotations

import json

import pytest
import z3

from kvspec.cli import main
from kvspec.specs import transitions as T
from kvspec.specs.encoding import Quant, Unrolled, reset_names
from kvspec.specs.obligations import PASS, catalogue, inductive, monotone, soundness

OBLIGATIONS = catalogue()


@pytest.mark.parametrize("ob", [pytest.param(o, marks=pytest.mark.deep if "N<=8" in o.name else ())
                                for o in OBLIGATIONS], ids=[f"{o.name}-{o.policy}" for o in OBLIGATIONS])
def test_obligation(ob) -> None:
    res = ob.run()
    assert res.result == PASS[ob.kind], f"{ob.name} ({ob.policy}): {res.result} {res.detail}"


def test_catalogue_covers_the_brief() -> None:
    names = {(o.name, o.policy, o.kind) for o in OBLIGATIONS}
    for pol in ("baseline", "signal-rescan", "repair"):
        assert ("cursor-bounds", pol, "proof") in names
        assert ("cursor-monotone", pol, "proof") in names
        assert ("cursor-bounds[G=2]", pol, "proof") in names
    assert ("completeness-c2", "repair", "proof") in names
    assert ("soundness", "repair", "proof") in names
    assert ("no-amplification", "repair", "proof") in names
    assert {(n, p) for n, p, k in names if k == "counterexample" and not n.startswith("bounded:")} == {
        ("completeness-c1:T2", "baseline"), ("completeness-flag:H1", "signal-rescan"),
        ("completeness-flag:H3", "signal-rescan"), ("completeness-c1:T2[G=2]", "baseline"),
        ("completeness-flag:H1[G=2]", "signal-rescan"), ("completeness-flag:H3[G=2]", "signal-rescan"),
        *((f"convergence:drop-{a}", "repair") for a in ("E1", "E2", "E3"))}
    assert any(k == "bounded" for _, _, k in names) and any(k == "vacuity" for _, _, k in names)


# -- mutations: each proof depends on the rule it is about ---------------------------------------


def _mutated(monkeypatch: pytest.MonkeyPatch, name: str, fn) -> None:
    _, pols = T.TRANSITIONS[name]
    monkeypatch.setitem(T.TRANSITIONS, name, (fn, pols))


@pytest.mark.parametrize("enc", [Quant(1), Unrolled(1, 4)], ids=["quantified", "unrolled"])
def test_c2_needs_lost_records(monkeypatch: pytest.MonkeyPatch, enc) -> None:
    reset_names()
    assert inductive(enc, "repair", "c2")[0] == "holds"
    _mutated(monkeypatch, "evict", lambda e, pol, s: T.evict(e, "baseline", s))  # evictions leave no record
    assert inductive(enc, "repair", "c2")[0] == "fails"


def test_c2_needs_the_owner_index(monkeypatch: pytest.MonkeyPatch) -> None:
    def scan_without_index(e, pol, s):
        step = T.plan_scan(e, pol, s)
        for g in range(e.G):
            step.post = step.post.with_group(g, reg=s.groups[g].arr["reg"])
        return step

    _mutated(monkeypatch, "plan", scan_without_index)
    assert inductive(Quant(1), "repair", "c2")[0] == "fails"


def test_c2_needs_dropping_records_only_when_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    def forgetful_repair(e, pol, s):
        step = T.repair_phase(e, pol, s)
        for g in range(e.G):
            step.post = step.post.with_group(g, lost=e.table(lambda p: z3.BoolVal(False)))
        return step

    _mutated(monkeypatch, "repair-phase", forgetful_repair)
    assert inductive(Quant(1), "repair", "c2")[0] == "fails"


def test_bounds_need_resume_after_preemption(monkeypatch: pytest.MonkeyPatch) -> None:
    def resume_anywhere(e, pol, s):
        step = T.resume(e, pol, s)
        step.constraints = [c for c in step.constraints if not z3.eq(c, s.groups[0].cur == 0)]
        return step

    _mutated(monkeypatch, "resume", resume_anywhere)
    assert inductive(Quant(1), "baseline", "bounds")[0] == "fails"


def test_monotone_is_about_the_cursor(monkeypatch: pytest.MonkeyPatch) -> None:
    _mutated(monkeypatch, "finish", lambda e, pol, s: T.preempt(e, pol, s))  # a finish that rewinds
    assert monotone(Quant(1), "repair")[0] == "fails"


def test_soundness_fails_for_baseline_rules() -> None:
    """The baseline scan does not check ownership (H4): the repair soundness goal fails for it."""
    from kvspec.specs import obligations as O

    enc = Quant(1)
    s, st = O._step(enc, "baseline", T.plan_scan)
    goal = enc.forall(lambda p: z3.Implies(st.scan.sel[0](p), enc.ownh(s, 0, p)))
    assert O._valid([T.inv_for("c2", enc, s), *st.constraints], goal)[0] == "fails"
    assert soundness(enc, "repair")[0] == "holds"


# -- the command ---------------------------------------------------------------------------------


def test_prove_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prove", "--json", "-k", "completeness"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"name", "policy", "kind", "result", "seconds"} <= set(out[0])
    kinds = {(r["name"], r["kind"], r["result"]) for r in out}
    assert ("completeness-c2", "proof", "holds") in kinds
    assert ("completeness-flag:H1", "counterexample", "found") in kinds


def test_prove_table_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prove", "-k", "no-lookback"]) == 0
    cap = capsys.readouterr()
    assert "no-lookback" in cap.out and "holds" in cap.out
    assert "[1/2] no-lookback (baseline) ..." in cap.err and "kvspec prove: 2/2 as expected" in cap.err


def test_prove_exit_code_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    _mutated(monkeypatch, "evict", lambda e, pol, s: T.evict(e, "baseline", s))
    assert main(["prove", "--quick", "-k", "completeness-c2"]) == 1
