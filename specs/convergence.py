"""Convergence (C4) of the repair policy as a ranking-function proof.

The measure is the *pending set* of the focal request,

    pending(p)  =  active and (lost(p) or hole(p)),
    hole(p)     =  0 <= p < cur and owned(p) and hashed(p) and not (cached(p) or infl(p)),

the loss records plus the holes (each position counted once per kind: ``rank`` below counts
``lost`` and ``hole`` separately). Every position of it lies below the cursor (``inv_conv``),
so it is a finite set and the strict-subset order on it is well founded.

Environment assumptions (each dropped in turn by a counterexample obligation):

* **E1 (quiescent: no eviction of the working set).** No CPU allocation evicts a key of the
  request: the ``evict`` transition is not taken. CPU capacity at least the live working set
  gives this: a free CPU block without a live key exists for every allocation.
* **E2 (capacity for the repair).** The repair phase has room for every pending record
  (``room``): also a consequence of capacity >= working set.
* **E3 (fairness).** A planning step of the engine runs while the request is active: the
  *round* ``plan ; repair-phase`` (``build_connector_meta``: the scan, then R8) happens.

Obligations (repair; ``Quant`` for every N, ``Unrolled`` with integer ranks for N <= 8):

* ``convergence:invariant`` — ``inv_conv`` (C2, the owner index, and "a record is only held by
  an active request, below its cursor") is inductive for every transition, evictions included;
* ``convergence:non-increasing`` — under E1, every transition maps the pending set into a
  subset of itself (pointwise, every N);
* ``convergence:round-decreases`` — under E1-E3 a round empties it; with it non-empty the
  pending set strictly shrinks; on the unrolled encoding ``rank' < rank`` or ``rank = 0``;
* ``convergence:drop-E1|E2|E3`` — counterexamples: an eviction makes the rank grow; a round
  without room leaves a non-zero rank unchanged; without the round a non-zero rank can stay
  forever (a stuttering environment step). Each is asked for among the states an engine trace
  reaches (``kvspec.specs.realizable``, ``DROP_STATUSES``), and ``kvspec.drivers.synthesis``
  turns it into one.
* ``witness:convergence`` — a run from registration reaches a non-zero rank (a lost record)
  and a round brings it to zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import z3

from kvspec.specs.encoding import Encoding, State, Unrolled
from kvspec.specs.realizable import realizable
from kvspec.specs.transitions import TRANSITIONS, Step, init, inv_for, plan_scan, repair_phase, transitions_for

QUIESCENT_EXCLUDED = ("evict",)  # E1
DROP_STATUSES = {"E1": ("I", "C"), "E2": ("I", "L"), "E3": ("I", "L")}
"""Per dropped assumption, what a position below the cursor may be in its counterexample's
pre-state (``realizable``): E1 evicts cached copies (no record yet); E2 and E3 start from lost
records with every other position in flight (E2: so no CPU block is free and the repair phase
has no room)."""


def hole(enc: Encoding, s: State, g: int, p: Any) -> z3.BoolRef:
    return z3.And(enc.below(s, g, p), enc.ownh(s, g, p), z3.Not(enc.covered(s, g, p)))


def pending(enc: Encoding, s: State, g: int, p: Any) -> z3.BoolRef:
    return z3.And(s.active, z3.Or(enc.v(s, g, "lost", p), hole(enc, s, g, p)))


def inv_conv(enc: Encoding, s: State) -> z3.BoolRef:
    """C2 + owner index + records only of an active request, below its cursor."""
    recs = [enc.forall(lambda p, g=g: z3.Implies(enc.v(s, g, "lost", p), z3.And(s.active, enc.below(s, g, p))))
            for g in range(enc.G)]
    return z3.And(inv_for("c2", enc, s), *recs)


def rank(enc: Unrolled, s: State) -> z3.ArithRef:
    """Loss records plus holes (unrolled: an integer)."""
    terms = [z3.If(z3.And(s.active, enc.v(s, g, "lost", i)), 1, 0) + z3.If(z3.And(s.active, hole(enc, s, g, i)), 1, 0)
             for g in range(enc.G) for i in range(enc.M)]
    return z3.Sum(terms) if terms else z3.IntVal(0)


def subset(enc: Encoding, post: State, pre: State) -> z3.BoolRef:
    return z3.And([enc.forall(lambda p, g=g: z3.Implies(pending(enc, post, g, p), pending(enc, pre, g, p)))
                   for g in range(enc.G)])


def empty(enc: Encoding, s: State) -> z3.BoolRef:
    return z3.And([enc.forall(lambda p, g=g: z3.Not(pending(enc, s, g, p))) for g in range(enc.G)])


Valid = Callable[[list[z3.BoolRef], z3.BoolRef, list[z3.BoolRef] | None], tuple[str, str]]


def _round(enc: Encoding, s: State, room: bool | None) -> tuple[State, list[z3.BoolRef], tuple[Step, Step]]:
    """``plan ; repair-phase``: the post-state, the constraints, the two steps; ``room`` fixes
    the repair phase's room (None: free)."""
    sc = plan_scan(enc, "repair", s)
    rp = repair_phase(enc, "repair", sc.post)
    cons = [*sc.constraints, *rp.constraints]
    if room is not None:
        cons.append(rp.inputs["room"] == z3.BoolVal(room))
    return rp.post, cons, (sc, rp)


def invariant(enc: Encoding, valid: Valid, hint: Callable[[Encoding, State], list[z3.BoolRef]]
              ) -> list[tuple[str, str, str]]:
    s = enc.state("s")
    out = [("init", *valid([init(enc, "repair", s)], inv_conv(enc, s), None))]
    for name, fn in transitions_for("repair"):
        s = enc.state("s")
        st = fn(enc, "repair", s)
        out.append((name, *valid([inv_conv(enc, s), *st.constraints], inv_conv(enc, st.post), hint(enc, s))))
    return out


def non_increasing(enc: Encoding, valid: Valid, hint: Callable[[Encoding, State], list[z3.BoolRef]]
                   ) -> list[tuple[str, str, str]]:
    """E1: every transition but an eviction keeps the pending set a subset (Unrolled: rank' <= rank)."""
    out = []
    for name, fn in transitions_for("repair"):
        if name in QUIESCENT_EXCLUDED:
            continue
        s = enc.state("s")
        st = fn(enc, "repair", s)
        goal = subset(enc, st.post, s)
        if isinstance(enc, Unrolled):
            goal = z3.And(goal, rank(enc, st.post) <= rank(enc, s))
        out.append((name, *valid([inv_conv(enc, s), *st.constraints], goal, hint(enc, s))))
    return out


def round_decreases(enc: Encoding, valid: Valid, hint: Callable[[Encoding, State], list[z3.BoolRef]]
                    ) -> list[tuple[str, str, str]]:
    """E1-E3: a round empties the pending set; non-empty before: a strict subset after."""
    s = enc.state("s")
    post, cons, _ = _round(enc, s, room=True)
    goal = z3.And(empty(enc, post), subset(enc, post, s))
    if isinstance(enc, Unrolled):
        goal = z3.And(goal, z3.Or(rank(enc, post) < rank(enc, s), rank(enc, s) == 0), rank(enc, post) == 0)
    # non-vacuity where it matters: the round's assumptions admit a state with a pending record
    return [("round", *valid([inv_conv(enc, s), *cons], goal, busy(enc, s)))]


def busy(enc: Encoding, s: State) -> list[z3.BoolRef]:
    """A concrete pre-state with a pending record: two confirmed, owned, hashed positions, cursor
    1, position 0 evicted (not cached, not in flight) with its record and index entry."""
    out = [s.conf == 2, s.active, z3.Not(s.flag)]
    for g, grp in enumerate(s.groups):
        out += [grp.n == 2, grp.cur == 1]
        for name in grp.arr:
            def val(i: Any, name: str = name) -> z3.BoolRef:
                if name in ("hashed", "owned"):
                    return z3.And(i >= 0, i < 2)
                return i == 0 if name in ("lost", "reg") else z3.BoolVal(False)
            if isinstance(grp.arr[name], z3.ArrayRef):
                q = z3.Int("busy_q")
                out.append(grp.arr[name] == z3.Lambda([q], val(q)))
            else:
                out += [enc.v(s, g, name, i) == val(z3.IntVal(i)) for i in range(len(grp.arr[name]))]
    return out


def one_lands(enc: Unrolled, s: State, post: State) -> list[z3.BoolRef]:
    """Exactly one position of each group goes from in flight to cached (one store event of the
    focal request lands: the construction stores one position per event); the others keep their
    ``cached`` and ``infl``."""
    out: list[z3.BoolRef] = []
    for g in range(enc.G):
        landed = [z3.And(enc.v(post, g, "cached", i), z3.Not(enc.v(s, g, "cached", i))) for i in range(enc.M)]
        out.append(z3.Sum([z3.If(x, 1, 0) for x in landed]) == 1)
        out += [z3.And(z3.Implies(x, enc.v(s, g, "infl", i)),
                       enc.v(post, g, "infl", i) == z3.And(enc.v(s, g, "infl", i), z3.Not(x)))
                for i, x in enumerate(landed)]
    return out


def drop(assumption: str, enc: Unrolled) -> tuple[State, State, dict[str, z3.ExprRef], list[z3.BoolRef]]:
    """The query whose model is a counterexample to convergence once ``assumption`` is dropped:
    (pre-state, post-state, the step's inputs, the constraints), the pre-state inside the
    realizable fragment with ``DROP_STATUSES[assumption]`` (the E3 step lands one of the focal
    request's stores: ``one_lands``)."""
    s = enc.state("s")
    statuses = DROP_STATUSES[assumption]
    if assumption == "E1":  # an eviction raises the rank
        st = TRANSITIONS["evict"][0](enc, "repair", s)
        post, inputs = st.post, st.inputs
        cons = [*st.constraints, rank(enc, st.post) > rank(enc, s), *realizable(enc, "repair", s, st, statuses)]
    elif assumption == "E2":  # a round without room leaves a non-zero rank where it was
        post, rcons, (sc, rp) = _round(enc, s, room=False)
        inputs = {**sc.inputs, **rp.inputs}
        cons = [*rcons, rank(enc, s) > 0, rank(enc, post) >= rank(enc, s),
                *realizable(enc, "repair", s, sc, statuses)]
    elif assumption == "E3":  # no round: an environment step that keeps a non-zero pending set as it is
        st = TRANSITIONS["complete"][0](enc, "repair", s)
        post, inputs = st.post, st.inputs
        same = z3.And([pending(enc, st.post, g, i) == pending(enc, s, g, i)
                       for g in range(enc.G) for i in range(enc.M)])
        cons = [*st.constraints, rank(enc, s) > 0, same, *one_lands(enc, s, st.post),
                *realizable(enc, "repair", s, st, statuses)]
    else:
        raise ValueError(assumption)
    return s, post, inputs, [inv_conv(enc, s), *cons]


def witness_run(enc: Unrolled, states: list[State], steps: list[Step]) -> list[z3.BoolRef]:
    """Run ``schedule ; plan ; complete ; evict ; plan ; repair-phase``: the eviction (step 4)
    makes the rank non-zero, the round (steps 5-6, with room) brings it to zero."""
    return [rank(enc, states[4]) > 0, steps[5].inputs["room"], rank(enc, states[6]) == 0]


WITNESS_RUN = ("schedule", "plan", "complete", "evict", "plan", "repair-phase")
