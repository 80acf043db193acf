"""Spec-model agreement: the Z3 planning step and the model's Python code take the same step.

Both sides start from one abstract state (``kvspec.specs.concrete.Small``). The model side
is the real policy class, built with a tiny configuration and the state set up in its
pools and store state, then driven through ``build_connector_meta``; the Z3 side is the
encoding the proofs use, evaluated on concrete values. Compared: new cursors, selected
positions, and for ``repair`` the owner index and the lost records.

Which states:

* exhaustive, every policy: N <= 2 positions of all six kinds (null, unhashed, stale id,
  owned, owned and cached, owned and in flight), every cursor, confirmed count and
  spare CPU block count 0..2 (and both flag values for signal-rescan); N = 3 with all six
  kinds, every cursor, spare 0..1, all confirmed;
* exhaustive, N <= 5 over the three kinds that steer the scan (skip, store, already
  cached), every cursor and spare count 0..1, all confirmed;
* exhaustive, N <= 3 with repair's retained copies (a freed id still carrying the request's
  key, cached on CPU or not) beside null, stale, owned and owned-and-cached positions, every
  cursor and spare count 0..1, all confirmed;
* Hypothesis beyond: N <= 6, one or two groups, any kinds, plus the quantified (symbolic
  N) encoding's unique successor on the same states;
* the repair phase: exhaustive over N <= 3 positions with lost records;
* eviction (every policy): exhaustive over N <= 3 positions and every allocation size;
* preemption, full table, finish, reset: exhaustive over N <= 2 (repair's full table: 3).

The unrolled and quantified scans are proved equal for every N <= 8 by Z3 itself
(``bounded:scans-agree`` in ``kvspec prove``), so the chain model = unrolled = quantified
covers the encoding the symbolic-N proofs are about.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvspec.specs.concrete import (
    FOREIGN,
    KEPT,
    KEPT_CACHED,
    KINDS,
    NULL,
    OWNED,
    OWNED_CACHED,
    OWNED_INFL,
    UNHASHED,
    Outcome,
    Pos,
    Small,
    bookkeeping_agrees,
    evict_agrees,
    model_bookkeeping,
    model_evict,
    model_plan,
    repair_phase_admits,
    repair_phase_z3,
    scan_quantified,
    scan_unrolled,
)

POLICIES = ("baseline", "signal-rescan", "repair")
DEEP = pytest.mark.deep  # the larger bounds: .ci/run's deep step


def _same(policy: str, a: Outcome, b: Outcome) -> bool:
    if policy != "repair":  # only repair keeps records and an owner index
        return (a.cursors, a.selected) == (b.cursors, b.selected)
    return (a.cursors, a.selected, a.lost, a.reg) == (b.cursors, b.selected, b.lost, b.reg)


def _states(n_max: int, kinds: tuple[Pos, ...], spares: range, all_conf: bool, policy: str):
    for n in range(n_max + 1):
        for ks in itertools.product(kinds, repeat=n):
            for cur in range(n + 1):
                for conf in (range(n + 1) if all_conf else (n,)):
                    for spare in spares:
                        for flag in ((False, True) if policy == "signal-rescan" else (False,)):
                            yield Small([list(ks)], [cur], conf, spare, flag)


def _mismatches(policy: str, states) -> tuple[int, list[str]]:
    n, bad = 0, []
    for s in states:
        n += 1
        z, m = scan_unrolled(policy, s), model_plan(policy, s)
        if not _same(policy, z, m):
            bad.append(f"{s}: z3 {z} model {m}")
    return n, bad


@pytest.mark.parametrize("policy", POLICIES)
def test_every_small_state_all_kinds(policy: str) -> None:
    n, bad = _mismatches(policy, _states(2, KINDS, range(3), True, policy))
    assert n >= 1000
    assert bad == [], "\n".join(bad[:5])


@DEEP  # the states of up to two positions are all in test_every_small_state_all_kinds
@pytest.mark.parametrize("policy", POLICIES)
def test_every_state_of_three_positions(policy: str) -> None:
    states = (s for s in _states(3, KINDS, range(2), False, policy) if len(s.groups[0]) == 3)
    n, bad = _mismatches(policy, states)
    assert n >= 1700
    assert bad == [], "\n".join(bad[:5])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n_max, least", [(4, 1000), pytest.param(5, 3800, marks=DEEP)], ids=["n4", "n5"])
def test_every_scan_shape_up_to_five(policy: str, n_max: int, least: int) -> None:
    """Every scan shape of up to five positions (the default run: up to four; five is ``deep``)."""
    n, bad = _mismatches(policy, _states(n_max, (UNHASHED, OWNED, OWNED_CACHED), range(2), False, policy))
    assert n >= least
    assert bad == [], "\n".join(bad[:5])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n_max, least", [(2, 200), pytest.param(3, 1000, marks=DEEP)], ids=["n2", "n3"])
def test_every_state_with_retained_copies(policy: str, n_max: int, least: int) -> None:
    """Retained copies among the kinds, up to two positions (three in the ``deep`` run)."""
    kinds = (NULL, FOREIGN, OWNED, OWNED_CACHED, KEPT, KEPT_CACHED)
    n, bad = _mismatches(policy, _states(n_max, kinds, range(2), False, policy))
    assert n >= least
    assert bad == [], "\n".join(bad[:5])


_pos = st.builds(Pos, hashed=st.booleans(), owned=st.booleans(), cached=st.booleans(), cfree=st.booleans(),
                 infl=st.booleans())


@st.composite
def _small(draw: st.DrawFn) -> Small:
    G = draw(st.integers(1, 2))
    n = draw(st.integers(0, 6))
    groups = [[draw(_pos) for _ in range(n)] for _ in range(G)]
    # a key in flight is not cached at the same time in any state the model reaches (dedup by key)
    groups = [[Pos(p.hashed, p.owned, p.cached and not p.infl, p.cfree and p.cached and not p.infl, p.infl)
               for p in ps] for ps in groups]
    return Small(groups, [draw(st.integers(0, n)) for _ in range(G)], draw(st.integers(0, n + 1)),
                 draw(st.integers(0, 3)), draw(st.booleans()), draw(st.booleans()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), s=_small())
def test_random_states_unrolled(policy: str, s: Small) -> None:
    z, m = scan_unrolled(policy, s), model_plan(policy, s)
    assert _same(policy, z, m), f"z3 {z} model {m}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), s=_small())
def test_random_states_quantified(policy: str, s: Small) -> None:
    """The symbolic-N encoding pins down exactly one successor, and it is the model's."""
    z, unique = scan_quantified(policy, s)
    m = model_plan(policy, s)
    assert unique
    assert (z.cursors, z.selected) == (m.cursors, m.selected), f"z3 {z} model {m}"


def test_agreement_can_fail() -> None:
    """A state where the policies differ: the comparison is not a tautology."""
    s = Small([[OWNED, FOREIGN, OWNED]], [0], 3, 3)
    assert scan_unrolled("repair", s).selected == {(0, 0), (0, 2)}
    assert model_plan("baseline", s).selected == {(0, 0), (0, 1), (0, 2)}
    assert not _same("repair", scan_unrolled("repair", s), model_plan("baseline", s))


# -- the repair phase --------------------------------------------------------------------------

_LOST_KINDS = (NULL, FOREIGN, OWNED, OWNED_CACHED, OWNED_INFL)


def _with_lost(p: Pos) -> Pos:
    return Pos(p.hashed, p.owned, p.cached, p.cfree, p.infl, lost=True, reg=p.owned and p.hashed)


@pytest.mark.parametrize("sizes, least", [(range(3), 100), pytest.param(range(3, 4), 400, marks=DEEP)],
                         ids=["n0-2", "n3"])
def test_repair_phase_every_small_state(sizes: range, least: int) -> None:
    """Not scheduled (H1): the records alone drive the re-stores. With spare room every
    pending, owned, uncovered record is re-stored and the rest dropped (the unique Z3
    successor); with no room the model's outcome is one the Z3 relation admits. Up to two
    positions in the default run, three in the ``deep`` one."""
    n = 0
    for size in sizes:
        for ks in itertools.product((*[_with_lost(k) for k in _LOST_KINDS], OWNED), repeat=size):
            ps = list(ks)
            for cur in range(size + 1):
                for room in (True, False):
                    s = Small([ps], [cur], size, size if room else 0, scheduled=False)
                    m = model_plan("repair", s)
                    assert m.cursors == [cur]
                    if room:
                        z, unique = repair_phase_z3(s, True)
                        assert unique
                        assert (m.selected, m.lost) == (z.selected, z.lost), f"{s}: z3 {z} model {m}"
                    else:
                        assert repair_phase_admits(s, False, m), f"{s}: model {m}"
                    n += 1
    assert n > least


# -- eviction ------------------------------------------------------------------------------------

_EVICT_KINDS = (
    OWNED_CACHED,
    Pos(hashed=True, owned=True, cached=True, cfree=True, reg=True),  # indexed owner (repair R1)
    Pos(hashed=True, cached=True, cfree=True),  # someone else's key
    OWNED,
)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("sizes, least", [(range(3), 60), pytest.param(range(3, 4), 250, marks=DEEP)],
                         ids=["n0-2", "n3"])
def test_eviction_every_small_state(policy: str, sizes: range, least: int) -> None:
    """Every allocation size on every state of N <= 3 positions (N = 3 is ``deep``): the keys that
    leave the CPU determine, in Z3 and in the model alike, the new lost records (repair: exactly
    the indexed owners below the cursor) and the flag (signal-rescan: set iff something left)."""
    n = 0
    for size in sizes:
        for ks in itertools.product(_EVICT_KINDS, repeat=size):
            for cur in range(size + 1):
                s = Small([list(ks)], [cur], size, 1)
                for k in range(s.free + 1):
                    got = model_evict(policy, s, k)
                    admitted, forced = evict_agrees(policy, s, got)
                    assert admitted and forced, f"{policy} {s} alloc {k}: model {got}"
                    n += 1
    assert n > least


# -- bookkeeping: preemption, full table, finish, reset ------------------------------------------

_BOOK_KINDS = (NULL, OWNED, OWNED_INFL, _with_lost(OWNED), _with_lost(OWNED_CACHED))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("what", ["preempt", "full-table", "finish", "reset"])
def test_bookkeeping_every_small_state(policy: str, what: str) -> None:
    """The model's preemption (ids and cursors to 0, repair drops the records), full table
    (ids replaced, cursors kept), finish and reset land where the Z3 transition allows, on every
    state of up to two positions (repair's full table on three: ``deep``, below)."""
    _bookkeeping(policy, what, range(3), 80)


@DEEP
def test_repair_full_table_every_state_of_three_positions() -> None:
    _bookkeeping("repair", "full-table", range(3, 4), 80)


def _bookkeeping(policy: str, what: str, sizes: range, least: int) -> None:
    n = 0
    for size in sizes:
        for ks in itertools.product(_BOOK_KINDS, repeat=size):
            ps = [k if policy == "repair" else Pos(k.hashed, k.owned, k.cached, k.cfree, k.infl) for k in ks]
            for cur in range(size + 1):
                s = Small([ps], [cur], size, 1)
                got = model_bookkeeping(policy, s, what, extra=1)
                assert bookkeeping_agrees(policy, s, what, got), f"{policy} {what} {s}: model {got}"
                n += 1
    assert n > least
