"""Existence and cover obligations fail on the mutations they are meant to catch.

``kvspec prove`` runs them (``tests/test_specs.py`` checks each gives its expected result):
``existence`` (every transition has a successor from every invariant state: for every N on the
quantified encoding, for N <= 8 on the unrolled one) and ``witness:*`` (a run from
registration reaches each branch the proofs rely on). Here each is broken on purpose by
mutating the encoding, and must then fail, while the obligations not about that rule still
hold where that is the point (a mutation only above N = 8 is invisible to the bounded check).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import z3

from kvspec.specs import transitions as T
from kvspec.specs.encoding import Encoding, Quant, Scan, State, Unrolled
from kvspec.specs.obligations import (
    BOUND,
    PASS,
    WITNESSES,
    existence_and_cover,
    existence_every_n,
    reach,
    successor_exists,
)


def _mutated(monkeypatch: pytest.MonkeyPatch, name: str, wrap: Callable[[Encoding, str, State, T.Step], None]) -> None:
    """Replace transition ``name`` by itself followed by ``wrap`` (which edits the step)."""
    fn, pols = T.TRANSITIONS[name]

    def mutated(enc: Encoding, policy: str, s: State) -> T.Step:
        step = fn(enc, policy, s)
        wrap(enc, policy, s, step)
        return step

    monkeypatch.setitem(T.TRANSITIONS, name, (mutated, pols))


def _witness(name: str, policy: str) -> str:
    (_, _, names, cond, _), = [w for w in WITNESSES if w[0] == name and w[1] == policy]
    return reach(policy, names, cond)[0]


def test_every_new_obligation_holds() -> None:
    for ob in existence_and_cover((1,)):
        res = ob.run()
        assert res.result == PASS[ob.kind], f"{ob.name} ({ob.policy}): {res.result} {res.detail}"


def test_quantified_scan_without_successor_above_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan lemma (every N) fails when the quantified scan has no successor for N > 8; the
    bounded check cannot see it."""
    original = Quant.scan

    def scan(self: Quant, policy: str, s: State, free: z3.ArithRef, scheduled: z3.BoolRef,
             rescan: z3.BoolRef) -> Scan:
        sc = original(self, policy, s, free, scheduled, rescan)
        sc.constraints.append(z3.Implies(s.groups[0].n > BOUND, z3.BoolVal(False)))
        return sc

    monkeypatch.setattr(Quant, "scan", scan)
    for pol in ("baseline", "signal-rescan", "repair"):
        assert existence_every_n(pol)[0] == "fails"
        assert successor_exists(Unrolled(1, BOUND), pol)[0] == "holds"


def test_environment_step_without_successor_above_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pointwise lemma (every N) fails for an eviction impossible above N = 8."""
    _mutated(monkeypatch, "evict", lambda e, pol, s, st: st.constraints.append(
        z3.Implies(s.groups[0].n > BOUND, z3.BoolVal(False))))
    assert existence_every_n("repair")[0] == "fails"
    assert successor_exists(Unrolled(1, BOUND), "repair")[0] == "holds"


def test_bounded_existence_needs_a_successor_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eviction that must evict something has no successor when nothing is cached."""
    def must_evict(e: Encoding, pol: str, s: State, st: T.Step) -> None:
        assert isinstance(e, Unrolled)
        st.constraints.append(z3.Or([z3.And(e.v(s, 0, "cached", i), z3.Not(e.v(st.post, 0, "cached", i)))
                                     for i in range(e.M)]))

    _mutated(monkeypatch, "evict", must_evict)
    assert successor_exists(Unrolled(1, BOUND), "baseline")[0] == "fails"


def test_repair_that_never_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repair phase that re-stores nothing (whatever the room) leaves no re-store and no
    consumed record reachable."""
    def restores_nothing(e: Encoding, pol: str, s: State, st: T.Step) -> None:
        st.constraints.append(z3.Not(st.inputs["room"]))
        st.constraints.append(e.forall(lambda p: z3.Not(st.restored[0](p))))

    assert _witness("re-store", "repair") == "reached"
    _mutated(monkeypatch, "repair-phase", restores_nothing)
    assert _witness("re-store", "repair") == "unreached"
    assert _witness("record-consumed", "repair") == "unreached"


def test_completion_that_never_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    def keeps_cache(e: Encoding, pol: str, s: State, st: T.Step) -> None:
        st.post = st.post.with_group(0, cached=s.groups[0].arr["cached"])

    _mutated(monkeypatch, "complete", keeps_cache)
    for pol in ("baseline", "signal-rescan", "repair"):
        assert _witness("completion-registers", pol) == "unreached"


def test_eviction_that_never_sets_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    _mutated(monkeypatch, "evict", lambda e, pol, s, st: setattr(st, "post", T.replace_flag(st.post, s.flag)))
    assert _witness("flag-set-and-consumed", "signal-rescan") == "unreached"


def test_pins_that_never_stop_the_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Encoding, "pins", lambda self, policy, s, g, p: z3.BoolVal(False))
    assert _witness("pin-stops-scan", "repair") == "unreached"


def test_a_scan_that_ignores_retained_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repair's READY class without R3's retained copies: a position it does not own is never stored."""
    original = Encoding.ready_to_store

    def owned_only(self: Encoding, policy: str, s: State, g: int, p: object) -> z3.BoolRef:
        return z3.And(original(self, policy, s, g, p), self.v(s, g, "owned", p))

    monkeypatch.setattr(Encoding, "ready_to_store", owned_only)
    assert _witness("retained-copy", "repair") == "unreached"
