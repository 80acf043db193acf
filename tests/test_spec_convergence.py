"""Convergence (C4) as a ranking proof: the obligations hold, and each fails on the mutation it
is there to catch (specs/convergence.py, PROOFS.md "Convergence")."""

from __future__ import annotations

from typing import Any

import pytest
import z3

import kvspec.specs.convergence as cv
import kvspec.specs.transitions as tr
from kvspec.specs.encoding import Encoding, State
from kvspec.specs.obligations import convergence_obligations


def _run(name: str) -> str:
    (ob,) = [ob for ob in convergence_obligations() if ob.name == name]
    res = ob.run()
    return res.result


def test_every_convergence_obligation_is_as_expected() -> None:
    results = [ob.run() for ob in convergence_obligations()]
    assert [r.name for r in results if not r.ok] == []
    assert {r.kind for r in results} == {"proof", "bounded", "counterexample", "witness"}


def _never_restores(enc: Encoding, policy: str, s: State) -> tr.Step:
    """The repair phase re-stores nothing, whatever the room (records dropped or kept)."""
    st = tr.repair_phase(enc, policy, s)
    post = s
    for g in range(enc.G):
        post = post.with_group(g, lost=st.post.groups[g].arr["lost"])
    return tr.Step(post, [], restored=[lambda p: z3.BoolVal(False)] * enc.G, inputs=st.inputs)


def _room_never_there(enc: Encoding, policy: str, s: State) -> tr.Step:
    """A repair phase whose constraints contradict room with a pending record: the round is then
    only possible without records, and the proof would hold on no state that needs it."""
    st = tr.repair_phase(enc, policy, s)
    none = [enc.forall(lambda p, g=g: z3.Not(st.restored[g](p))) for g in range(enc.G)]
    return tr.Step(st.post, [*st.constraints, *none], restored=st.restored, inputs=st.inputs)


def test_a_repair_phase_that_restores_nothing_does_not_converge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cv, "repair_phase", _never_restores)
    assert _run("convergence:round-decreases") in ("fails", "unknown")  # not proved (every N: no model either)
    assert _run("bounded:convergence:round-decreases[N<=8]") == "fails"


def test_a_round_that_never_has_room_is_vacuous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cv, "repair_phase", _room_never_there)
    assert _run("convergence:round-decreases") == "vacuous"
    assert _run("bounded:convergence:round-decreases[N<=8]") == "vacuous"


def _keeping(transition: Any, field: str, doc: str) -> Any:
    """``transition`` mutated to leave array ``field`` of every group as it was before the step."""
    def mutated(enc: Encoding, policy: str, s: State) -> tr.Step:
        st = transition(enc, policy, s)
        post = st.post
        for g in range(enc.G):
            post = post.with_group(g, **{field: s.groups[g].arr[field]})
        return tr.Step(post, st.constraints, scan=st.scan, inputs=st.inputs)
    mutated.__doc__ = doc
    return mutated


ALL_POLICIES = ("baseline", "signal-rescan", "repair")


def test_a_scan_that_leaves_holes_breaks_the_ranking(monkeypatch: pytest.MonkeyPatch) -> None:
    forgets = _keeping(tr.plan_scan, "infl", "The scan advances the cursor but its selections are never put in flight.")
    monkeypatch.setitem(tr.TRANSITIONS, "plan", (forgets, ALL_POLICIES))
    assert _run("convergence:non-increasing") == "fails"
    assert _run("bounded:convergence:non-increasing[N<=8]") == "fails"


def test_an_eviction_without_records_breaks_the_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    no_records = _keeping(tr.evict, "lost", "An eviction that gives no owner a lost record.")
    monkeypatch.setitem(tr.TRANSITIONS, "evict", (no_records, ALL_POLICIES))
    assert _run("convergence:invariant") == "fails"


def test_dropping_room_is_a_counterexample_only_without_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """drop-E2 must find a counterexample because room is False there: forced True it finds none."""
    real = cv._round

    def always_room(enc: Encoding, s: State, room: bool | None) -> Any:
        return real(enc, s, room=True)

    monkeypatch.setattr(cv, "_round", always_room)
    assert _run("convergence:drop-E2") == "not found"
