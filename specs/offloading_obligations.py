"""Proof obligations of the second manager (``offloading_encoding.py``): vLLM 0.33.0's
``CPUOffloadingManager``, LRU and ARC alike (the eviction choice is abstracted), with the
driver's observations. Every obligation's policy is ``offloading``; names start with
``offloading:``. Kinds as in ``obligations.py``, plus ``mutation``:

* ``proof`` — ``Init => Inv`` and ``Inv and Step => P'`` for every transition, every N
  (``Quant``), where ``Inv`` is the property ``P`` with its strengthening (``inv``): (a)
  ``refcounts``, (b) ``in-flight-resident``, (c) ``slots``; ``evict-safe`` (an evicted key has
  no load and no store in flight) and ``no-refusal`` (the manager never refuses or ignores a
  completion the driver makes) are statements about one step from an invariant state;
* ``bounded`` — the same on ``Unrolled(K, M)``: ``K`` keys, every ``N <= M``;
* ``existence`` — every transition has a successor from every invariant state meeting its
  precondition, for every input: ``Inv and pre and ForAll(choices, Not(cons))`` is unsat
  (every N, and unrolled);
* ``witness`` — a run from ``init`` (unrolled, two slots) reaches an eviction followed by an
  allocation from the free list, a failed store, a load completion;
* ``vacuity`` — a deliberately broken invariant is refuted (some init or step breaks it);
* ``mutation`` — for each of the proofs, a broken transition (``MUTATIONS``) under which its
  property FAILS: Z3 finds an invariant state and a mutated step breaking it (``caught``).
  Every proof can fail.

Solvers as in ``obligations.py`` (``solving._check``: fixed seed, rlimit, two fixed retries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import z3

from kvspec.specs import offloading_encoding as E
from kvspec.specs.solving import Obligation, _all_steps, _check, _sat, _valid

POLICY = "offloading"
BOUND_K, BOUND_M = 5, 4  # bounded cross-checks: 5 keys, every N <= 4
WITNESS_K, WITNESS_M = 3, 2

Checked = tuple[str, str, dict[str, Any]]


def _goal(prop: str, B: E.Backend, s: E.OState, st: E.Step) -> Any:
    """What ``prop`` claims of a step from ``s``: its property of the successor; for
    ``evict-safe`` the victim has nothing in flight; for ``no-refusal`` the manager acts."""
    if prop == "evict-safe":
        v = st.choices.get("v")
        if v is None:
            return B.true()
        return B.And(B.sel(s.loads, v) == 0, B.Not(B.sel(s.stores, v)))
    if prop == "no-refusal":
        return st.act
    return E.PROPERTIES[prop](B, st.post)


def hints(B: E.Backend, s: E.OState) -> list[list[Any]]:
    """Concrete pre-states for the satisfiability half of a check on ``Quant`` (model-based
    quantifier instantiation alone may give up on satisfiable formulas), each a conjunction: key 0
    ready and unloaded, key 1 ready with one load in flight, key 2 being stored, in slots 0-2, and

    * ``room``: ``N = 4``, slot 3 never used;
    * ``full``: ``N = 4``, slot 3 on the free list (only a free-list allocation is possible).

    Every transition's precondition can be met from ``room``. The unrolled encoding needs none."""
    if not isinstance(B, E.Quant):
        return []

    def arr(default: Any, entries: dict[int, Any]) -> Any:
        a = B.const("key", default)
        for i, v in entries.items():
            a = z3.Store(a, i, v)
        return a

    common = [s.n == 4, s.res == arr(False, {0: True, 1: True, 2: True}), s.slot == arr(0, {1: 1, 2: 2}),
              s.ref == arr(0, {1: 1, 2: E.STORING}), s.loads == arr(0, {1: 1}), s.stores == arr(False, {2: True}),
              s.used == arr(False, {0: True, 1: True, 2: True}), s.owner == arr(0, {1: 1, 2: 2})]
    return [[*common, s.nalloc == 3, s.free == arr(False, {})],
            [*common, s.nalloc == 4, s.free == arr(False, {3: True})]]


def hint(B: E.Backend, s: E.OState) -> list[Any]:
    """The first of ``hints`` (``room``), or none."""
    return (hints(B, s) or [[]])[0]


def _decide(assumptions: list[Any], goal: Any, wits: list[list[Any]]) -> tuple[str, str]:
    """``_valid`` (satisfiable assumptions, with the first hint, and then the goal entailed), but
    first a counterexample on each hint's concrete state: a model of the stronger formula is a
    model, and the quantified search for one may give up where the concrete one is immediate."""
    for wit in wits:
        r, _ = _check([*assumptions, *wit, z3.Not(goal)])
        if r == z3.sat:
            return "fails", "counterexample on a concrete hint state"
    return _valid(assumptions, goal, wits[0] if wits else None)


def _transitions(prop: str) -> list[str]:
    if prop == "evict-safe":
        return ["evict"]
    if prop == "no-refusal":
        return list(E.WITH_ACT)
    return list(E.TRANSITIONS)


def inductive(B: E.Backend, prop: str, mutate: E.Mutation | None = None) -> Checked:
    """``Init => Inv`` (for the three properties) and, per transition, ``Inv and pre and cons
    => goal`` (``_goal``). ``mutate`` replaces one transition."""
    out = []
    E.reset_names()
    if prop in E.PROPERTIES:
        s = E.state(B, "s")
        out.append(("init", *_valid([E.wf(B, s), E.init(B, s)], E.inv(B, s, prop))))
    for name in _transitions(prop):
        fn = mutate.fn if mutate is not None and mutate.transition == name else None
        s = E.state(B, "s")
        st = E.symbolic_step(B, name, s, fn)
        goal = _goal(prop, B, s, st)
        if prop in E.PROPERTIES:
            goal = B.And(goal, E.inv(B, st.post, prop))
        out.append((name, *_decide([E.inv(B, s, prop), *st.pre, *st.cons], goal, hints(B, s))))
    return _all_steps(out)


def caught(mutation: E.Mutation) -> Checked:
    """The mutated transition breaks its obligation: Z3 finds an invariant state and a mutated
    step whose successor violates the property (``caught``); ``missed`` when the obligation still
    holds under the mutation."""
    r, d, _ = inductive(E.Quant(), mutation.breaks, mutation)
    if r == "fails":
        return "caught", f"{mutation.breaks} fails: {d}", {}
    return ("missed" if r == "holds" else r), d, {}


def existence(B: E.Backend) -> Checked:
    """Every transition has a successor from every invariant state meeting its precondition,
    for every input: ``Inv and pre and ForAll(choices, Not(And(cons)))`` is unsat (and ``Inv and
    pre`` is satisfiable: else the check says nothing)."""
    out = []
    for name in E.TRANSITIONS:
        E.reset_names()
        s = E.state(B, "s")
        st = E.symbolic_step(B, name, s)
        base = [E.inv(B, s), *st.pre]
        r, _ = _check([*base, *hint(B, s)])
        if r != z3.sat:
            out.append((name, "vacuous" if r == z3.unsat else "unknown", "precondition unsatisfiable"))
            continue
        none = z3.Not(z3.And(st.cons)) if st.cons else z3.BoolVal(False)
        chosen = list(st.choices.values())
        stuck = z3.ForAll(chosen, none) if chosen else none
        if any(_check([*base, *wit, stuck])[0] == z3.sat for wit in hints(B, s)):
            out.append((name, "fails", "a state without a successor"))
            continue
        r, sv = _check([*base, stuck])
        if r == z3.unsat:
            out.append((name, "holds", ""))
        else:
            out.append((name, *(("fails", "a state without a successor") if r == z3.sat
                                else ("unknown", sv.reason_unknown()))))
    return _all_steps(out)


Condition = Callable[[E.Unrolled, list[E.OState], list[E.Step]], list[Any]]


def reach(names: tuple[str, ...], cond: Condition) -> Checked:
    """A run from ``init`` through ``names`` (unrolled: ``WITNESS_K`` keys, ``WITNESS_M`` slots)
    meeting ``cond`` exists: ``reached``; else ``unreached``."""
    E.reset_names()
    B = E.Unrolled(WITNESS_K, WITNESS_M)
    states = [E.state(B, "w0")]
    steps: list[E.Step] = []
    cons = [E.wf(B, states[0]), E.init(B, states[0])]
    for name in names:
        steps.append(E.symbolic_step(B, name, states[-1]))
        cons += [*steps[-1].pre, *steps[-1].cons]
        states.append(steps[-1].post)
    r, _ = _sat([*cons, *cond(B, states, steps)])
    return {"sat": "reached", "unsat": "unreached"}.get(r, "unknown"), " ; ".join(names), {}


def _evicted_then_reused(B: E.Unrolled, states: list[E.OState], steps: list[E.Step]) -> list[Any]:
    """The pool is full (``N = 2``), the eviction (step 5) frees the victim's slot and the next
    store (step 6) takes it from the free list."""
    pre, v, j = states[4], steps[4].choices["v"], steps[5].choices["j"]
    return [pre.n == 2, pre.nalloc == pre.n, B.sel(states[5].free, B.sel(pre.slot, v)),
            j == B.sel(pre.slot, v), B.sel(states[6].res, steps[5].inputs["k"])]


def _failed_store(B: E.Unrolled, states: list[E.OState], steps: list[E.Step]) -> list[Any]:
    k = steps[1].inputs["k"]
    return [steps[1].act, B.Not(B.sel(states[2].res, k)), B.sel(states[2].free, steps[0].choices["j"])]


def _load_completed(B: E.Unrolled, states: list[E.OState], steps: list[E.Step]) -> list[Any]:
    k = steps[3].inputs["k"]
    return [steps[3].act, B.sel(states[3].ref, k) == 1, B.sel(states[4].ref, k) == 0,
            B.sel(states[4].loads, k) == 0]


STORED = ("prepare_store", "complete_store_ok")
WITNESSES: tuple[tuple[str, tuple[str, ...], Condition, str], ...] = (
    ("eviction", (*STORED, *STORED, "evict", "prepare_store"), _evicted_then_reused,
     "a full pool evicts a ready key and the next store takes its slot from the free list"),
    ("failed-store", ("prepare_store", "complete_store_fail"), _failed_store,
     "a failed store drops its key and frees its slot"),
    ("load-completion", (*STORED, "prepare_load", "complete_load"), _load_completed,
     "a load of a ready key completes and its ref count returns to 0"),
)


def refuted(broken: Callable[[E.Backend, E.OState], Any]) -> Checked:
    """A deliberately broken invariant (the proved one and ``broken``) is not inductive: some
    init or step breaks it. Searched on the unrolled encoding (``WITNESS_K`` keys,
    ``WITNESS_M`` slots), where the search is quantifier-free; a counterexample there is one
    for every-N encoding too (its state is a state of ``Quant`` with those keys)."""
    B = E.Unrolled(WITNESS_K, WITNESS_M)
    E.reset_names()

    def strong(s: E.OState) -> Any:
        return B.And(E.inv(B, s), broken(B, s))

    s = E.state(B, "s")
    if _sat([E.wf(B, s), E.init(B, s), z3.Not(strong(s))])[0] == "sat":
        return "ok", "refuted at init", {}
    for name in E.TRANSITIONS:
        s = E.state(B, "s")
        st = E.symbolic_step(B, name, s)
        if _sat([strong(s), *st.pre, *st.cons, z3.Not(strong(st.post))])[0] == "sat":
            return "ok", f"refuted by {name}", {}
    return "vacuous", "the broken invariant was not refuted", {}


def _never_loaded(B: E.Backend, s: E.OState) -> Any:
    return B.forall("key", lambda k: B.Implies(B.sel(s.res, k), B.sel(s.ref, k) <= 0))


def _free_list_empty(B: E.Backend, s: E.OState) -> Any:
    return B.forall("slot", lambda j: B.Not(B.sel(s.free, j)))


PROOFS = (
    ("refcounts", "(a) ref_cnt == -1 iff the driver has the key's store in flight, else ref_cnt == its "
                  "loads in flight"),
    ("in-flight-resident", "(b) keys with loads or stores in flight are resident"),
    ("slots", "(c) resident keys have distinct slots below num_allocated, no slot both used and free, "
              "none leaked, num_allocated <= N"),
    ("evict-safe", "an evicted key has no load and no store in flight"),
    ("no-refusal", "the manager never refuses or ignores a completion the driver makes"),
)


def offloading_obligations() -> list[Obligation]:
    """The second manager's obligations, in report order."""
    obs: list[Obligation] = []
    for prop, statement in PROOFS:
        obs.append(Obligation(f"offloading:{prop}", POLICY, "proof",
                              lambda prop=prop: inductive(E.Quant(), prop), statement + ", every N"))
    for prop, statement in PROOFS:
        obs.append(Obligation(f"bounded:offloading:{prop}[K={BOUND_K},N<={BOUND_M}]", POLICY, "bounded",
                              lambda prop=prop: inductive(E.Unrolled(BOUND_K, BOUND_M), prop), statement))
    obs.append(Obligation("offloading:existence", POLICY, "existence", lambda: existence(E.Quant()),
                          "every transition has a successor from every invariant state, every N"))
    obs.append(Obligation(f"offloading:existence[K={BOUND_K},N<={BOUND_M}]", POLICY, "existence",
                          lambda: existence(E.Unrolled(BOUND_K, BOUND_M)),
                          "every transition has a successor from every invariant state"))
    for name, run, cond, statement in WITNESSES:
        obs.append(Obligation(f"offloading:witness:{name}", POLICY, "witness",
                              lambda run=run, cond=cond: reach(run, cond), statement))
    obs.append(Obligation("offloading:vacuity:never-loaded", POLICY, "vacuity", lambda: refuted(_never_loaded),
                          "'no resident key has a load' is refuted"))
    obs.append(Obligation("offloading:vacuity:free-list-empty", POLICY, "vacuity",
                          lambda: refuted(_free_list_empty), "'the free list stays empty' is refuted"))
    for m in E.MUTATIONS:
        obs.append(Obligation(f"offloading:mutation:{m.name}", POLICY, "mutation", lambda m=m: caught(m),
                              f"{m.statement}: offloading:{m.breaks} fails"))
    return obs
