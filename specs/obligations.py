"""Named proof obligations over the encodings, and the machinery that discharges them.

Kinds:

* ``proof`` — ``Init => Inv`` and ``Inv and Step => Inv'`` for every transition, with a
  symbolic length N (``Quant``): the property holds for every N. Each step check first
  makes sure its assumptions are satisfiable (else the result is ``vacuous``).
* ``bounded`` — the same obligation on the quantifier-free unrolled encoding with
  ``0 <= N <= 8`` (an independent second encoding of the scan), or a check that the two
  scan encodings agree for every state with N <= 8.
* ``counterexample`` — a property that must FAIL: Z3 must find a model (``found``); the
  model's values are kept for ``kvspec.drivers.synthesis`` to turn into an engine trace.
* ``vacuity`` — a deliberately broken invariant that must be refuted, or a behaviour the
  proofs rely on being possible (out of space, a skipped group, a lost record) that must
  be satisfiable.
* ``existence`` — every transition has a successor from every invariant state meeting its
  preconditions, for every input: for every N on ``Quant`` (a pointwise lemma for the
  environment steps, an induction-step lemma for the scan), for N <= 8 on ``Unrolled``.
* ``witness`` — a run from registration reaches a branch the proofs rely on (a re-store, a
  consumed record, the flag set and consumed, a pin that stops the scan, a completion that
  registers): ``reached``.
* ``mutation`` — the second manager's (``offloading_obligations.py``): a broken transition
  under which a proof's property fails, Z3 finding the counterexample: ``caught``.

Every solver gets a fixed ``random_seed`` and an ``rlimit``; a check that exhausts the
rlimit reports ``unknown`` (a failure), never a silent pass. That machinery (the records,
the expected result per kind, the solver calls) is ``solving.py``, re-exported here; the
catalogue ends with the second manager's obligations (``offloading_obligations.py``).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import z3

from kvspec.specs.encoding import Encoding, Quant, State, Unrolled, check_sat, reset_names
from kvspec.specs.realizable import POSITIONS, realizable
from kvspec.specs.solving import PASS as PASS
from kvspec.specs.solving import RLIMIT as RLIMIT
from kvspec.specs.solving import SEED as SEED
from kvspec.specs.solving import TIMEOUT_MS as TIMEOUT_MS
from kvspec.specs.solving import CheckFn as CheckFn
from kvspec.specs.solving import Obligation as Obligation
from kvspec.specs.solving import Result as Result
from kvspec.specs.solving import _all_steps as _all_steps
from kvspec.specs.solving import _check as _check
from kvspec.specs.solving import _sat as _sat
from kvspec.specs.solving import _valid as _valid
from kvspec.specs.solving import solver as solver
from kvspec.specs.transitions import (
    CURSOR_RESETS,
    TRANSITIONS,
    Step,
    bounds,
    c1,
    evict,
    init,
    inv_for,
    plan_scan,
    repair_phase,
    transitions_for,
)

BOUND = 8  # bounded cross-check: every N <= BOUND
BOUND_G2 = 2  # two groups: every pair of lengths <= BOUND_G2
NIGHTLY_BOUND = 12  # the nightly profile's bounded checks: every N <= NIGHTLY_BOUND
NIGHTLY_BOUND_G2 = 3  # and, two groups, every pair of lengths <= NIGHTLY_BOUND_G2
PROFILES = ("default", "nightly")


def hint(enc: Encoding, s: State) -> list[z3.BoolRef]:
    """A concrete pre-state for the satisfiability half of a check on the quantified encoding:
    two owned, hashed, confirmed, uncovered positions per group, cursor 0. Model-based
    instantiation alone may give up on satisfiable quantified formulas; pinning the state
    leaves only the step's own choices to find. The unrolled encoding needs no hint."""
    if not isinstance(enc, Quant):
        return []
    t, f = z3.K(z3.IntSort(), z3.BoolVal(True)), z3.K(z3.IntSort(), z3.BoolVal(False))
    out = [s.conf == 2, z3.Not(s.flag), s.active]
    for grp in s.groups:
        out += [grp.n == 2, grp.cur == 0]
        out += [grp.arr[a] == (t if a in ("hashed", "owned") else f) for a in grp.arr]
    return out


def _step(enc: Encoding, policy: str, fn: Callable[[Encoding, str, State], Step]) -> tuple[State, Step]:
    s = enc.state("s")
    return s, fn(enc, policy, s)


def inductive(enc: Encoding, policy: str, prop: str) -> tuple[str, str, dict[str, Any]]:
    """Init => Inv and, per transition, Inv and Step => Inv'."""
    out = []
    s = enc.state("s")
    out.append(("init", *_valid([init(enc, policy, s)], inv_for(prop, enc, s))))
    for name, fn in transitions_for(policy):
        s, st = _step(enc, policy, fn)
        out.append((name, *_valid([inv_for(prop, enc, s), *st.constraints], inv_for(prop, enc, st.post),
                                  hint(enc, s))))
    return _all_steps(out)


def monotone(enc: Encoding, policy: str) -> tuple[str, str, dict[str, Any]]:
    """Every transition but preemption and reset leaves every cursor where it was or ahead."""
    out = []
    for name, fn in transitions_for(policy):
        if name in CURSOR_RESETS:
            continue
        s, st = _step(enc, policy, fn)
        goal = z3.And([st.post.groups[g].cur >= s.groups[g].cur for g in range(enc.G)])
        out.append((name, *_valid([inv_for("bounds", enc, s), *st.constraints], goal, hint(enc, s))))
    for name in CURSOR_RESETS:  # and those two really do reset
        fn = dict(transitions_for(policy))[name]
        s, st = _step(enc, policy, fn)
        goal = z3.And([st.post.groups[g].cur == 0 for g in range(enc.G)])
        out.append((name, *_valid([inv_for("bounds", enc, s), *st.constraints], goal, hint(enc, s))))
    return _all_steps(out)


def soundness(enc: Encoding, policy: str) -> tuple[str, str, dict[str, Any]]:
    """Repair R3: every position the scan selects is confirmed, hashed, and owned or a retained
    copy; every one the repair phase re-stores is confirmed, owned, hashed."""
    out = []
    s, st = _step(enc, policy, plan_scan)
    assert st.scan is not None
    goal = z3.And([enc.forall(lambda p, g=g: z3.Implies(
        z3.Or(st.scan.sel[g](p), st.scan.rescan[g](p)),
        z3.And(enc.confirmed(s, g, p), enc.v(s, g, "hashed", p),
               z3.Or(enc.v(s, g, "owned", p), enc.v(s, g, "kept", p)))))
        for g in range(enc.G)])
    out.append(("plan", *_valid([inv_for("c2", enc, s), *st.constraints], goal, hint(enc, s))))
    s, st = _step(enc, policy, repair_phase)
    goal = z3.And([enc.forall(lambda p, g=g: z3.Implies(
        st.restored[g](p), z3.And(enc.confirmed(s, g, p), enc.ownh(s, g, p)))) for g in range(enc.G)])
    out.append(("repair-phase", *_valid([inv_for("c2", enc, s), *st.constraints], goal, hint(enc, s))))
    return _all_steps(out)


def no_amplification(enc: Encoding) -> tuple[str, str, dict[str, Any]]:
    """Repair C3: each re-store consumes a pending lost record whose key is neither cached nor in
    flight, and no position is both scan-selected and re-stored in one step: re-stores per
    step <= distinct lost keys (keys of distinct positions differ)."""
    s = enc.state("s")
    sc = plan_scan(enc, "repair", s)
    rp = repair_phase(enc, "repair", sc.post)
    assert sc.scan is not None
    goal = z3.And([enc.forall(lambda p, g=g: z3.Implies(
        rp.restored[g](p),
        z3.And(enc.v(s, g, "lost", p), z3.Not(enc.covered(sc.post, g, p)),
               z3.Not(sc.scan.sel[g](p)), z3.Not(enc.v(rp.post, g, "lost", p))))) for g in range(enc.G)])
    r, d = _valid([inv_for("c2", enc, s), *sc.constraints, *rp.constraints], goal, hint(enc, s))
    return r, d, {}


def scans_agree(policy: str, G: int, M: int = BOUND) -> tuple[str, str, dict[str, Any]]:
    """The relational (quantified) scan and the unrolled scan give the same cursors and the
    same selections on every state with N <= M (one check per length and cursor, which keeps
    each check small; the free count, confirmed count and all position bits stay symbolic)."""
    q, u = Quant(G), Unrolled(G, M)
    sq, su = q.state("q"), u.state("u")
    link = [sq.conf == su.conf, sq.flag == su.flag, q.wf(sq), u.wf(su)]
    for g in range(G):
        link += [sq.groups[g].n == su.groups[g].n, sq.groups[g].cur == su.groups[g].cur,
                 sq.groups[g].cur >= 0]
        for name, arr in su.groups[g].arr.items():
            link += [z3.Select(sq.groups[g].arr[name], i) == arr[i] for i in range(M)]
    free, scheduled = z3.Int("free"), z3.Bool("scheduled")
    scq = q.scan(policy, sq, free, scheduled, sq.flag)
    scu = u.scan(policy, su, free, scheduled, su.flag)
    same = []
    for g in range(G):
        same.append(scq.cur[g] == scu.cur[g])
        same += [scq.sel[g](i) == scu.sel[g](i) for i in range(M)]
        same += [scq.rescan[g](i) == scu.rescan[g](i) for i in range(M)]
    base = [*link, free >= 0, *scq.constraints, *scq.ground(range(-1, M + 1))]
    r, d = _valid(base, z3.BoolVal(True), hint(q, sq))
    if r != "holds":
        return r, d, {}
    per_group = [(n, c) for n in range(M + 1) for c in range(n + 1)]
    shapes = list(itertools.product(*[per_group] * G))
    sv = solver()
    sv.set("mbqi", False)  # the ground instances suffice for unsat; MBQI can only wander here
    sv.add(*base, z3.Not(z3.And(same)))
    for shape in shapes:
        sv.push()
        sv.add(*[z3.And(sq.groups[g].n == n, sq.groups[g].cur == c) for g, (n, c) in enumerate(shape)])
        r_ = check_sat(sv)
        sv.pop()
        if r_ != z3.unsat:
            return ("fails" if r_ == z3.sat else "unknown"), f"N, cursor per group = {shape}", {}
    return "holds", f"{len(shapes)} shapes", {}


def no_lookback(enc: Encoding, policy: str) -> tuple[str, str, dict[str, Any]]:
    """Baseline: the scan never selects a position below the cursor (so a hole there stays)."""
    s, st = _step(enc, policy, plan_scan)
    assert st.scan is not None
    goal = z3.And([enc.forall(lambda p, g=g: z3.Implies(z3.Or(st.scan.sel[g](p), st.scan.rescan[g](p)),
                                                         p >= s.groups[g].cur)) for g in range(enc.G)])
    r, d = _valid([inv_for("bounds", enc, s), *st.constraints], goal, hint(enc, s))
    return r, d, {}


# -- counterexamples ---------------------------------------------------------------------------


SHOWN = ("owned", "hashed", "cached", "cfree", "infl", "lost")  # the arrays a counterexample reports


def _shown_terms(enc: Encoding, s: State, upto: int) -> dict[str, z3.ExprRef]:
    """The terms of ``s`` a counterexample reports, by key: scalars, and each array of ``SHOWN`` at
    positions below ``upto``."""
    out: dict[str, z3.ExprRef] = {"conf": s.conf, "flag": s.flag}
    for g, grp in enumerate(s.groups):
        out[f"N{g}"], out[f"cur{g}"] = grp.n, grp.cur
        for name in SHOWN:
            out.update({f"{name}{g}[{i}]": enc.v(s, g, name, i) for i in range(upto)})
    return out


def _read_state(m: z3.ModelRef, enc: Encoding, s: State, tag: str, upto: int = POSITIONS) -> dict[str, Any]:
    vals = {k: m.eval(t, model_completion=True) for k, t in _shown_terms(enc, s, upto).items()}
    out: dict[str, Any] = {f"{tag}.conf": vals["conf"].as_long(), f"{tag}.flag": z3.is_true(vals["flag"])}
    for g in range(len(s.groups)):
        out[f"{tag}.N{g}"] = vals[f"N{g}"].as_long()
        out[f"{tag}.cur{g}"] = vals[f"cur{g}"].as_long()
        for name in SHOWN:
            out[f"{tag}.{name}{g}"] = [z3.is_true(vals[f"{name}{g}[{i}]"]) for i in range(upto)]
    return out


def _read_step(m: z3.ModelRef, enc: Encoding, pre: State, post: State, inputs: dict[str, z3.ExprRef]
               ) -> dict[str, Any]:
    """A counterexample model's values: the pre-state, the post-state and the step's inputs."""
    vals = _read_state(m, enc, pre, "pre") | _read_state(m, enc, post, "post")
    for k, v in inputs.items():
        vals[k] = z3.is_true(m.eval(v, model_completion=True)) if z3.is_bool(v) else \
            m.eval(v, model_completion=True).as_long()
    return vals


def counterexamples(enc: Encoding, policy: str, prop: str, fn: Callable[[Encoding, str, State], Step],
                    extra: Callable[[State, Step], list[z3.BoolRef]], count: int = 1
                    ) -> tuple[str, str, list[dict[str, Any]]]:
    """Find Inv and Step and extra with not Inv' (the property is not preserved): up to ``count``
    distinct models, each next one asked for with the previous ones blocked (they differ in the
    pre-state or in the post-state's cached positions), each query on a fresh solver (``_check``:
    fixed seeds, rlimit)."""
    s, st = _step(enc, policy, fn)
    want = [inv_for(prop, enc, s), *st.constraints, *extra(s, st), z3.Not(inv_for(prop, enc, st.post))]
    shown = [*_shown_terms(enc, s, POSITIONS).values(),
             *(enc.v(st.post, g, "cached", i) for g in range(enc.G) for i in range(POSITIONS))]

    def read(m: z3.ModelRef) -> dict[str, Any]:
        return _read_step(m, enc, s, st.post, st.inputs)

    models: list[dict[str, Any]] = []
    blocked: list[z3.BoolRef] = []
    r, sv = _check(want)
    while r == z3.sat:
        m = sv.model()
        models.append(read(m))
        if len(models) == count:
            break
        blocked.append(z3.Not(z3.And([t == m.eval(t, model_completion=True) for t in shown])))
        r, sv = _check([*want, *blocked])
    if models:
        return "found", "property not preserved", models
    return ("not found" if r == z3.unsat else "unknown"), ("" if r == z3.unsat else sv.reason_unknown()), []


def witness(enc: Encoding, policy: str, fn: Callable[[Encoding, str, State], Step],
            cond: Callable[[State, Step], list[z3.BoolRef]], prop: str = "bounds",
            use_hint: bool = False) -> tuple[str, str, dict[str, Any]]:
    """A behaviour the proofs must cover is reachable from an invariant state (non-vacuity);
    ``use_hint`` starts from ``hint``'s concrete state (two storable positions per group)."""
    s, st = _step(enc, policy, fn)
    base = [inv_for(prop, enc, s), *st.constraints, *cond(s, st)]
    r, _ = _sat([*base, *(hint(enc, s) if use_hint else [])])
    return ("ok" if r == "sat" else "vacuous"), ("satisfiable" if r == "sat" else r), {}


def refuted(enc: Encoding, policy: str,
            broken: Callable[[Encoding, State], z3.BoolRef]) -> tuple[str, str, dict[str, Any]]:
    """A deliberately broken invariant must NOT be provable: some init or step breaks it."""
    def inv(s: State) -> z3.BoolRef:
        return z3.And(enc.wf(s), bounds(enc, s), broken(enc, s))

    s = enc.state("s")
    r, _ = _sat([init(enc, policy, s), z3.Not(inv(s))])
    if r == "sat":
        return "ok", "refuted at init", {}
    for name, fn in transitions_for(policy):
        s, st = _step(enc, policy, fn)
        r, _ = _sat([inv(s), *st.constraints, z3.Not(inv(st.post))])
        if r == "sat":
            return "ok", f"refuted by {name}", {}
    return "vacuous", "the broken invariant was not refuted", {}


# -- existence: every transition has a successor --------------------------------------------


def _constants(exprs: Iterable[z3.ExprRef]) -> dict[int, z3.ExprRef]:
    """The uninterpreted constants occurring in ``exprs``, by AST id. O(size of the DAG)."""
    seen: set[int] = set()
    out: dict[int, z3.ExprRef] = {}
    stack = list(exprs)
    while stack:
        e = stack.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            out[e.get_id()] = e
        else:
            stack.extend(e.children())
    return out


def _state_terms(s: State) -> list[z3.ExprRef]:
    out: list[z3.ExprRef] = [s.conf, s.flag, s.active]
    for grp in s.groups:
        out += [grp.n, grp.cur]
        for a in grp.arr.values():
            out += list(a) if isinstance(a, list) else [a]
    return out


def preconditions(name: str, s: State, st: Step) -> list[z3.BoolRef]:
    """What a transition assumes of its pre-state and inputs, the only constraints an existence
    check may assume: the scan's free count is a count; ``resume`` follows a preemption (every
    cursor 0). Every other constraint must be met by the transition's own choices."""
    out = [st.inputs["free"] >= 0] if "free" in st.inputs else []
    if name == "resume":
        out += [grp.cur == 0 for grp in s.groups]
    return out


def choices(s: State, st: Step) -> list[z3.ExprRef]:
    """The constants a step introduces that are not inputs: what the transition chooses."""
    given = _constants(_state_terms(s)) | _constants(st.inputs.values())
    return [e for i, e in _constants([*st.constraints, *_state_terms(st.post)]).items() if i not in given]


def _check_qe(constraints: list[z3.BoolRef]) -> z3.CheckSatResult:
    """Satisfiability after quantifier elimination (Booleans and linear integers), fixed seed."""
    sv = z3.Then("qe", "smt").solver()
    sv.set("random_seed", SEED)
    sv.set("rlimit", RLIMIT)
    sv.add(*constraints)
    return check_sat(sv)


def successor_exists(enc: Unrolled, policy: str) -> tuple[str, str, dict[str, Any]]:
    """Every transition has a successor from every invariant state (wf, cursor bounds) meeting
    its preconditions, for every input: ``Inv(s) and pre and ForAll(choices, Not(constraints))``
    is unsat (quantifier elimination over the Boolean and integer choices)."""
    out = []
    for name, fn in transitions_for(policy):
        s, st = _step(enc, policy, fn)
        none = z3.Not(z3.And(st.constraints)) if st.constraints else z3.BoolVal(False)
        chosen = choices(s, st)
        r = _check_qe([inv_for("bounds", enc, s), *preconditions(name, s, st),
                       z3.ForAll(chosen, none) if chosen else none])
        out.append((name, *_holds_if_unsat(r, "a state without a successor")))
    return _all_steps(out)


def _holds_if_unsat(r: z3.CheckSatResult, what: str) -> tuple[str, str]:
    if r == z3.unsat:
        return "holds", ""
    return ("fails", what) if r == z3.sat else ("unknown", "rlimit")


def _is_bool_array(e: z3.ExprRef) -> bool:
    return bool(z3.is_array(e) and e.sort() == z3.ArraySort(z3.IntSort(), z3.BoolSort()))


def _instance(c: z3.BoolRef, q: z3.ArithRef) -> z3.BoolRef | None:
    """``c`` as a statement about position ``q``: ``ForAll p. phi`` -> ``phi[q]``, ``g => ForAll p.
    phi`` -> ``g => phi[q]`` (``g`` without p); None for any other shape."""
    if z3.is_quantifier(c) and c.is_forall() and c.num_vars() == 1:
        return z3.substitute_vars(c.body(), q)
    if z3.is_implies(c) and z3.is_quantifier(c.arg(1)):
        inner = _instance(c.arg(1), q)
        return None if inner is None else z3.Implies(c.arg(0), inner)
    return None


def pointwise_exists(policy: str, name: str) -> tuple[str, str]:
    """For every N (Quant, one group), when the transition's constraints read each chosen array
    ``A`` only as ``ForAll p. phi(p, A[p])``: arrays exist iff values exist at every position
    (``Exists A. ForAll p. phi(p, A[p])`` iff ``ForAll p. Exists b. phi(p, b)``). So the check is
    ``Inv and pre and ForAll(scalar choices, Exists q. every Boolean value at q violates phi)``
    unsat, the Boolean values expanded. ``unknown`` for a transition of another shape."""
    enc = Quant(1)
    s, st = _step(enc, policy, TRANSITIONS[name][0])
    chosen = choices(s, st)
    arrays = [e for e in chosen if _is_bool_array(e)]
    scalars = [e for e in chosen if not _is_bool_array(e)]
    q = z3.Int("exists_q")
    ids = {a.get_id() for a in arrays}
    parts = [c if not ids & set(_constants([c])) else _instance(c, q) for c in st.constraints]
    if any(p is None for p in parts):
        return "unknown", "a constraint on an array is not a ForAll over positions"
    bits = [z3.Bool(f"exists_b{i}") for i in range(len(arrays))]
    phi = z3.substitute(z3.And([p for p in parts if p is not None] or [z3.BoolVal(True)]),
                        *[(z3.Select(a, q), b) for a, b in zip(arrays, bits, strict=True)])
    if ids & set(_constants([phi])):
        return "unknown", "an array is read at another position"
    violated = z3.And([z3.Not(z3.substitute(phi, *zip(bits, map(z3.BoolVal, vals), strict=True)))
                       for vals in itertools.product((False, True), repeat=len(bits))])
    none = z3.ForAll(scalars, z3.Exists([q], violated)) if scalars else violated
    r, _ = _check([inv_for("bounds", enc, s), *preconditions(name, s, st), none])
    return _holds_if_unsat(r, "a position without a value")


@dataclass
class ScanInstance:
    """The quantified scan of one group on a state, its running counts replaced by arrays."""

    constraints: list[z3.BoolRef]
    counts: list[z3.ArrayRef]  # in the order Quant.scan makes them: Phase 1a (signal-rescan), Phase 1b
    cur: z3.ArithRef  # the new cursor (a fresh constant)


def scan_instance(policy: str, s: State, free: z3.ArithRef, scheduled: z3.BoolRef) -> ScanInstance:
    """``Quant(1).scan`` on ``s`` with each running count ``c`` (an uninterpreted function) replaced
    by a fresh array, so that a count can be given as a term. O(size of the scan)."""
    sc = Quant(1).scan(policy, s, free, scheduled, s.flag)
    funs: dict[str, z3.FuncDeclRef] = {}
    stack: list[z3.ExprRef] = list(sc.constraints)
    while stack:
        e = stack.pop()
        if z3.is_quantifier(e):
            stack.append(e.body())
            continue
        if z3.is_app(e) and e.decl().arity() == 1 and e.decl().kind() == z3.Z3_OP_UNINTERPRETED:
            funs[e.decl().name()] = e.decl()
        stack.extend(e.children())
    order = sorted(funs.values(), key=lambda f: int(f.name().rpartition("!")[2]))
    arrays = [z3.Array(f"{f.name()}[]", z3.IntSort(), z3.IntSort()) for f in order]
    pairs = [(f, z3.Select(a, z3.Var(0, z3.IntSort()))) for f, a in zip(order, arrays, strict=True)]
    cons = [z3.substitute_funs(c, *pairs) if pairs else c for c in sc.constraints]
    return ScanInstance(cons, arrays, sc.cur[0])


def _with(s: State, cur: z3.ArithRef, conf: z3.ArithRef) -> State:
    """``s`` with another cursor and confirmed count (same positions, length, flag)."""
    return State([replace(s.groups[0], cur=cur)], conf, s.flag, s.active)


@dataclass
class ScanStep:
    """One induction step of the scan-existence lemma: from a solved scan on ``smaller`` (its
    instance ``given``), candidate counts and cursor for the scan on ``target``."""

    target: State
    smaller: State | None
    given: ScanInstance | None
    counts: list[z3.ArrayRef]
    cur: z3.ArithRef
    premise: list[z3.BoolRef]


def _scan_inputs() -> tuple[z3.ArithRef, z3.BoolRef]:
    return z3.Int("exists_free"), z3.Bool("exists_scheduled")


def _scan_step(policy: str, kind: str) -> ScanStep:
    """The candidates of the lemma's three steps, for a target state ``t`` (one group):

    * ``base``: ``ready = cursor`` (baseline, repair) or ``ready = cursor = 0``: counts constant
      0, cursor kept;
    * ``extend``: ``ready > cursor``, from ``t`` with one confirmed block less: the Phase 1b count
      gets one more entry, the cursor stops where it stopped, else at the new last position
      when that is a stop point, else after it;
    * ``rescan`` (signal-rescan): ``ready = cursor >= 1``, from ``t`` with cursor and ready one less:
      the Phase 1a count gets one more entry."""
    enc, free, scheduled = Quant(1), *_scan_inputs()
    t = enc.state("t")
    cur, ready = t.groups[0].cur, enc.ready(t, 0)
    if kind == "base":
        zero = z3.K(z3.IntSort(), z3.IntVal(0))
        premise = [ready == cur] if policy != "signal-rescan" else [ready == 0, cur == 0]
        n_counts = 2 if policy == "signal-rescan" else 1
        return ScanStep(t, None, None, [zero] * n_counts, cur, premise)
    if kind == "extend":
        s = _with(t, cur, ready - 1)
        given = scan_instance(policy, s, free, scheduled)
        hi, ph1b = ready - 1, given.counts[-1]
        rdy = z3.Or(enc.ready_to_store(policy, t, 0, hi), enc.pins(policy, t, 0, hi))
        scanned = scheduled if policy == "repair" else z3.And(scheduled, 0 < free)
        stop = z3.And(rdy, ph1b[hi] >= free)
        new_cur = z3.If(scanned, z3.If(given.cur < hi, given.cur, z3.If(stop, hi, ready)), cur)
        counts = [*given.counts[:-1], z3.Store(ph1b, ready, ph1b[hi] + z3.If(rdy, 1, 0))]
        return ScanStep(t, s, given, counts, new_cur, [ready > cur])
    s = _with(t, cur - 1, ready - 1)
    given = scan_instance(policy, s, free, scheduled)
    ph1a, k = given.counts[0], cur - 1
    grown = z3.Store(ph1a, cur, ph1a[k] + z3.If(z3.And(enc.ready_to_store(policy, t, 0, k), ph1a[k] < free), 1, 0))
    do_a = z3.And(scheduled, 0 < free, t.flag)
    return ScanStep(t, s, given, [grown, z3.K(z3.IntSort(), z3.If(do_a, grown[cur], 0))], cur,
                    [ready == cur, cur >= 1])


SCAN_LEMMA_STEPS = {"baseline": ("base", "extend"), "repair": ("base", "extend"),
                    "signal-rescan": ("base", "rescan", "extend")}


def scan_exists(policy: str) -> tuple[str, str, dict[str, Any]]:
    """For every N: the relational scan (Quant, one group) has a successor from every state with
    ``0 <= cursor <= ready`` and a free count >= 0. Z3 does no induction, so the lemma is its
    steps, each valid for every N: the candidate counts and cursor of ``_scan_step`` satisfy the
    scan's constraints, given (for ``extend`` and ``rescan``) a solution on the smaller state.
    Induction on ``ready - cursor`` from ``base`` (signal-rescan: first on ``cursor`` with
    ``ready = cursor``, by ``rescan``) concludes."""
    out = []
    for kind in SCAN_LEMMA_STEPS[policy]:
        reset_names()
        step = _scan_step(policy, kind)
        free, scheduled = _scan_inputs()
        goal = scan_instance(policy, step.target, free, scheduled)
        pairs = [(a, b) for a, b in zip(goal.counts, step.counts, strict=True)] + [(goal.cur, step.cur)]
        claim, points = _skolemized([z3.substitute(c, *pairs) for c in goal.constraints])
        premise = [inv_for("bounds", Quant(1), step.target), free >= 0, *step.premise]
        if step.given is not None:
            premise += [*step.given.constraints, *_instances(step.given.constraints, points)]
        out.append((kind, *_valid(premise, claim, hint(Quant(1), step.target) if kind == "extend" else None)))
    return _all_steps(out)


def _skolemized(goal: list[z3.BoolRef]) -> tuple[z3.BoolRef, list[z3.ArithRef]]:
    """``goal`` with each top-level ``ForAll p. phi`` replaced by ``phi`` at a fresh position (valid
    iff the original is), and the positions around those where a hypothesis may be needed."""
    parts: list[z3.BoolRef] = []
    points: list[z3.ArithRef] = []
    for i, c in enumerate(goal):
        if z3.is_quantifier(c) and c.is_forall() and c.num_vars() == 1:
            sk = z3.Int(f"skolem_p{i}")
            parts.append(z3.substitute_vars(c.body(), sk))
            points += [sk - 1, sk, sk + 1]
        else:
            parts.append(c)
    return z3.And(parts), points


def _instances(hypotheses: list[z3.BoolRef], points: list[z3.ArithRef]) -> list[z3.BoolRef]:
    """Ground instances of the ``ForAll p`` hypotheses at ``points`` (implied by them: they only
    spare the solver the search for the instantiations)."""
    return [z3.substitute_vars(h.body(), q) for h in hypotheses
            if z3.is_quantifier(h) and h.is_forall() and h.num_vars() == 1 for q in points]


def existence_every_n(policy: str) -> tuple[str, str, dict[str, Any]]:
    """Every transition has a successor for every N (Quant, one group): the pointwise lemma for
    the environment and bookkeeping transitions, the scan lemma for the plan. signal-rescan's
    ``scan-latched`` is the plan's scan with Phase 1a decided by an input instead of the state's
    flag; its constraints are the plan's on the state with that flag, and the scan lemma holds for
    every flag (nothing it assumes reads it), so the same lemma covers it."""
    scans = ("plan", "scan-latched")
    out = [(name, *pointwise_exists(policy, name)) for name, _ in transitions_for(policy) if name not in scans]
    r, d, _ = scan_exists(policy)
    return _all_steps([*out, *((name, r, d) for name, _ in transitions_for(policy) if name in scans)])


# -- cover: a witness run for each branch the proofs rely on -----------------------------------


WITNESS_M = 4  # positions of the witness runs (Unrolled: quantifier-free, and a run is existential)
Condition = Callable[[Unrolled, list[State], list[Step]], list[z3.BoolRef]]


def _some(enc: Unrolled, body: Callable[[int], z3.BoolRef]) -> z3.BoolRef:
    return z3.Or([body(i) for i in range(enc.M)])


def reach(policy: str, names: tuple[str, ...], cond: Condition) -> tuple[str, str, dict[str, Any]]:
    """A run from registration (``init``) through the transitions ``names`` in order that meets
    ``cond`` exists: ``reached``; else ``unreached`` (the branch is dead, and every proof that
    covers it covers nothing there)."""
    enc = Unrolled(1, WITNESS_M)
    states = [enc.state("w")]
    steps: list[Step] = []
    cons = [init(enc, policy, states[0])]
    for name in names:
        fn, pols = TRANSITIONS[name]
        assert policy in pols, f"{name} is not a {policy} transition"
        steps.append(fn(enc, policy, states[-1]))
        cons += steps[-1].constraints
        states.append(steps[-1].post)
    r, _ = _sat([*cons, *cond(enc, states, steps)])
    result = {"sat": "reached", "unsat": "unreached"}.get(r, "unknown")
    return result, " ; ".join(names), {}


def _restored(enc: Unrolled, states: list[State], steps: list[Step]) -> list[z3.BoolRef]:
    """The repair phase (step 5) re-stores a position."""
    return [_some(enc, steps[4].restored[0])]


def _record_consumed(enc: Unrolled, states: list[State], steps: list[Step]) -> list[z3.BoolRef]:
    """A record made by the eviction (step 4) is re-stored (step 5), and its copy lands (step 6)."""
    return [_some(enc, lambda p: z3.And(enc.v(states[4], 0, "lost", p), steps[4].restored[0](p),
                                        z3.Not(enc.v(states[6], 0, "lost", p)),
                                        enc.v(states[6], 0, "cached", p)))]


def _flag_cycle(enc: Unrolled, states: list[State], steps: list[Step]) -> list[z3.BoolRef]:
    """The eviction (step 4) sets the flag; the next plan (step 5) consumes it and re-stores a hole."""
    scan = steps[4].scan
    assert scan is not None
    return [z3.Not(states[3].flag), states[4].flag, z3.Not(states[5].flag), _some(enc, scan.rescan[0])]


def _pin_stop(enc: Unrolled, states: list[State], steps: list[Step]) -> list[z3.BoolRef]:
    """The plan (step 4) stops at a position that is not READY but whose pin would starve."""
    s, post = states[3], states[4]
    return [steps[3].inputs["scheduled"],
            _some(enc, lambda p: z3.And(post.groups[0].cur == p, p < enc.ready(s, 0), enc.pins("repair", s, 0, p),
                                        z3.Not(enc.ready_to_store("repair", s, 0, p))))]


def _retained_copy(enc: Unrolled, states: list[State], steps: list[Step]) -> list[z3.BoolRef]:
    """The plan (step 3) stores a position the request does not own, from its retained copy,
    and the cursor passes it without indexing it as an owner."""
    s, post, scan = states[2], states[3], steps[2].scan
    assert scan is not None
    return [_some(enc, lambda p: z3.And(scan.sel[0](p), z3.Not(enc.v(s, 0, "owned", p)), enc.v(s, 0, "kept", p),
                                        p < post.groups[0].cur, z3.Not(enc.v(post, 0, "reg", p))))]


def _registered_copy(enc: Unrolled, states: list[State], steps: list[Step]) -> list[z3.BoolRef]:
    """A position the plan (step 2) selected is cached after the completion (step 3)."""
    scan = steps[1].scan
    assert scan is not None
    return [_some(enc, lambda p: z3.And(scan.sel[0](p), z3.Not(enc.v(states[2], 0, "cached", p)),
                                        enc.v(states[3], 0, "cached", p)))]


STORED = ("schedule", "plan", "complete")  # confirmed positions stored and landed
WITNESSES: tuple[tuple[str, str, tuple[str, ...], Condition, str], ...] = (
    # name, policy, run from registration, condition, statement
    ("re-store", "repair", (*STORED, "evict", "repair-phase"), _restored,
     "an evicted position is re-stored by the repair phase"),
    ("record-consumed", "repair", (*STORED, "evict", "repair-phase", "complete"), _record_consumed,
     "a lost record is consumed: its key re-stored and registered again"),
    ("flag-set-and-consumed", "signal-rescan", (*STORED, "evict", "plan"), _flag_cycle,
     "an eviction sets the flag; the next plan consumes it and re-stores the hole"),
    ("pin-stops-scan", "repair", ("schedule", "env-store", "complete", "plan"), _pin_stop,
     "the scan stops at an already-cached position whose pin would starve the selection"),
    ("retained-copy", "repair", ("schedule", "sliding-free", "plan"), _retained_copy,
     "the scan stores a position it does not own from its retained copy, not indexed"),
    *((("completion-registers", pol, STORED, _registered_copy, "a completed store registers its key"))
      for pol in ("baseline", "signal-rescan", "repair")),
)


# -- the catalogue -----------------------------------------------------------------------------


def _cex_t2(enc: Encoding, count: int = 1) -> tuple[str, str, list[dict[str, Any]]]:
    """An eviction below the baseline's cursor (the FIXME)."""
    return counterexamples(enc, "baseline", "c1", evict,
                           lambda s, st: realizable(enc, "baseline", s, st), count)


def _cex_h1(enc: Encoding, count: int = 1) -> tuple[str, str, list[dict[str, Any]]]:
    """The flag is consumed by a planning step that does not schedule the request."""
    return counterexamples(enc, "signal-rescan", "flag", plan_scan,
                           lambda s, st: [z3.Not(st.inputs["scheduled"]),
                                          *realizable(enc, "signal-rescan", s, st)], count)


def _cex_h3(enc: Encoding, count: int = 1) -> tuple[str, str, list[dict[str, Any]]]:
    """Scheduled, flag set, and every CPU block pinned (in-flight stores): Phase 1a re-stores
    nothing and the flag is gone. (With a non-zero free count short of the holes, the
    restore's own allocation evicts again and re-sets the flag: that is H6, not H3.)"""
    return counterexamples(enc, "signal-rescan", "flag", plan_scan,
                           lambda s, st: [st.inputs["scheduled"], s.flag, st.inputs["free"] == 0,
                                          *realizable(enc, "signal-rescan", s, st)], count)


class Completeness(NamedTuple):
    """A completeness counterexample: ``find(enc, count)`` -> (result, detail, up to ``count``
    distinct models), the policy it is about, and what it shows."""

    find: Callable[..., tuple[str, str, list[dict[str, Any]]]]
    policy: str
    statement: str


COUNTEREXAMPLES: dict[str, Completeness] = {
    "completeness-c1:T2": Completeness(_cex_t2, "baseline", "an eviction below the cursor leaves a hole C1 reports"),
    "completeness-flag:H1": Completeness(_cex_h1, "signal-rescan",
                                         "the flag is consumed while the request is not scheduled"),
    "completeness-flag:H3": Completeness(_cex_h3, "signal-rescan", "Phase 1a runs out of CPU space; the flag is gone"),
}
"""The completeness counterexamples (the FIXME and the #47235 hazards) by obligation name; the
catalogue adds ``[G=2]`` (two groups) and ``bounded:...[N<=8]`` (the unrolled encoding)."""


def _first(found: tuple[str, str, list[dict[str, Any]]]) -> tuple[str, str, dict[str, Any]]:
    r, d, models = found
    return r, d, (models[0] if models else {})


def _out_of_space(s: State, st: Step) -> list[z3.BoolRef]:
    """The scan stops early: some confirmed position is left for later."""
    g0 = s.groups[0]
    return [st.inputs["scheduled"], st.post.groups[0].cur < z3.If(s.conf < g0.n, s.conf, g0.n),
            st.post.groups[0].cur > s.groups[0].cur]


def _group_skipped(s: State, st: Step) -> list[z3.BoolRef]:
    """Two groups: the first uses up the free count, the second is not advanced although it has work."""
    g1 = s.groups[1]
    return [st.inputs["scheduled"], g1.cur < z3.If(s.conf < g1.n, s.conf, g1.n),
            st.post.groups[1].cur == g1.cur,
            st.post.groups[0].cur > s.groups[0].cur]


def _lost_record(s: State, st: Step) -> list[z3.BoolRef]:
    enc = Quant(len(s.groups))
    p = z3.Int("witness_p")
    return [s.active, z3.Not(enc.v(s, 0, "lost", p)), enc.v(st.post, 0, "lost", p)]


def catalogue(quick: bool = False, profile: str = "default") -> list[Obligation]:
    """All obligations, in report order. ``quick`` drops the two-group duplicates; the
    ``nightly`` profile adds the heavier bounded checks (``nightly_obligations``)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}")
    extra = nightly_obligations() if profile == "nightly" else []
    return _default_catalogue(quick) + extra


def nightly_obligations() -> list[Obligation]:
    """The bounded cross-checks at larger sizes: bounds, monotonicity, C2, soundness and scan
    agreement for every N <= ``NIGHTLY_BOUND`` (one group), scan agreement for two groups up
    to ``NIGHTLY_BOUND_G2`` (baseline and repair). Existence at N <= 12 is not among them: the
    repair phase's check exhausts the rlimit there."""
    return _bounded_per_policy(NIGHTLY_BOUND, NIGHTLY_BOUND_G2) + _bounded_repair(NIGHTLY_BOUND, 1, "")


def _bounded_per_policy(M: int, M2: int | None) -> list[Obligation]:
    """Cursor bounds, monotonicity and scan agreement for every N <= M (one group), and two-group
    scan agreement up to ``M2`` (None: not asked) for baseline and repair (signal-rescan's is
    unknown within the rlimit even at N <= 2: left to the agreement tests, PROOFS.md)."""
    obs: list[Obligation] = []
    for pol in ("baseline", "signal-rescan", "repair"):
        obs.append(Obligation(f"bounded:cursor-bounds[N<={M}]", pol, "bounded",
                              lambda pol=pol: inductive(Unrolled(1, M), pol, "bounds")))
        obs.append(Obligation(f"bounded:cursor-monotone[N<={M}]", pol, "bounded",
                              lambda pol=pol: monotone(Unrolled(1, M), pol)))
        obs.append(Obligation(f"bounded:scans-agree[N<={M}]", pol, "bounded",
                              lambda pol=pol: scans_agree(pol, 1, M)))
        if M2 is not None and pol != "signal-rescan":
            obs.append(Obligation(f"bounded:scans-agree[N<={M2},G=2]", pol, "bounded",
                                  lambda pol=pol: scans_agree(pol, 2, M2)))
    return obs


def _bounded_repair(M: int, G: int, tag: str) -> list[Obligation]:
    """Repair's C2 and soundness on the unrolled encoding, every N <= M, ``G`` groups."""
    return [Obligation(f"bounded:completeness-c2[N<={M}{tag}]", "repair", "bounded",
                       lambda: inductive(Unrolled(G, M), "repair", "c2")),
            Obligation(f"bounded:soundness[N<={M}{tag}]", "repair", "bounded",
                       lambda: soundness(Unrolled(G, M), "repair"))]


def _default_catalogue(quick: bool) -> list[Obligation]:
    """The default profile's obligations (``kvspec prove``: under a minute here)."""
    obs: list[Obligation] = []
    groups = (1,) if quick else (1, 2)
    for pol in ("baseline", "signal-rescan", "repair"):
        for G in groups:
            tag = "" if G == 1 else f"[G={G}]"
            obs.append(Obligation(f"cursor-bounds{tag}", pol, "proof",
                                  lambda pol=pol, G=G: inductive(Quant(G), pol, "bounds"),
                                  "0 <= cursor <= ready <= N, every N"))
            obs.append(Obligation(f"cursor-monotone{tag}", pol, "proof",
                                  lambda pol=pol, G=G: monotone(Quant(G), pol),
                                  "cursors never move back except at preemption and reset"))
    for G in groups:
        tag = "" if G == 1 else f"[G={G}]"
        obs.append(Obligation(f"completeness-c2{tag}", "repair", "proof",
                              lambda G=G: inductive(Quant(G), "repair", "c2"),
                              "C2: owned confirmed hashed positions below the cursor are cached, in flight "
                              "or recorded lost"))
        obs.append(Obligation(f"soundness{tag}", "repair", "proof", lambda G=G: soundness(Quant(G), "repair"),
                              "only confirmed, hashed positions are stored, owned or from a retained copy; "
                              "only owned ones are re-stored"))
    obs.append(Obligation("no-amplification", "repair", "proof", lambda: no_amplification(Quant(1)),
                          "re-stores consume distinct pending lost records of uncovered keys"))
    obs.append(Obligation("no-lookback", "baseline", "proof", lambda: no_lookback(Quant(1), "baseline"),
                          "the baseline scan never selects below the cursor"))
    for G in groups:  # expected counterexamples (the FIXME and the #47235 hazards)
        for name, cx in COUNTEREXAMPLES.items():
            obs.append(Obligation(name + ("" if G == 1 else f"[G={G}]"), cx.policy, "counterexample",
                                  lambda cx=cx, G=G: _first(cx.find(Quant(G))), cx.statement))
    # bounded cross-checks: a second, quantifier-free encoding with N <= BOUND
    obs += _bounded_per_policy(BOUND, None if quick else BOUND_G2)
    for G in groups:
        obs += _bounded_repair(BOUND, G, "" if G == 1 else f",G={G}")
    if not quick:
        for pol in ("baseline", "signal-rescan", "repair"):
            obs.append(Obligation(f"bounded:cursor-bounds[N<={BOUND},G=2]", pol, "bounded",
                                  lambda pol=pol: inductive(Unrolled(2, BOUND), pol, "bounds")))
            obs.append(Obligation(f"bounded:cursor-monotone[N<={BOUND},G=2]", pol, "bounded",
                                  lambda pol=pol: monotone(Unrolled(2, BOUND), pol)))
    obs.append(Obligation(f"bounded:no-lookback[N<={BOUND}]", "baseline", "bounded",
                          lambda: no_lookback(Unrolled(1, BOUND), "baseline")))
    obs.append(Obligation(f"bounded:no-amplification[N<={BOUND}]", "repair", "bounded",
                          lambda: no_amplification(Unrolled(1, BOUND))))
    for name, cx in COUNTEREXAMPLES.items():
        obs.append(Obligation(f"bounded:{name}[N<={BOUND}]", cx.policy, "counterexample",
                              lambda cx=cx: _first(cx.find(Unrolled(1, BOUND)))))
    # vacuity: broken invariants are refuted; the behaviours the proofs cover are possible
    obs.append(Obligation("vacuity:c2-without-records", "repair", "vacuity",
                          lambda: refuted(Quant(1), "repair", lambda e, s: c1(e, s)),
                          "C1 (no pending records) is not an invariant of repair"))
    obs.append(Obligation("vacuity:cursor-below-ready", "repair", "vacuity",
                          lambda: refuted(Quant(1), "repair",
                                          lambda e, s: z3.Or(s.groups[0].cur == 0,
                                                             s.groups[0].cur < e.ready(s, 0))),
                          "a too-strong cursor bound is refuted"))
    obs.append(Obligation("vacuity:baseline-unsound", "baseline", "vacuity",
                          lambda: _baseline_stores_unowned(Quant(1)),
                          "the baseline scan can store a position the request does not own (H4)"))
    for pol in ("baseline", "signal-rescan", "repair"):
        obs.append(Obligation("vacuity:out-of-space", pol, "vacuity",
                              lambda pol=pol: witness(Quant(1), pol, plan_scan, _out_of_space,
                                                      use_hint=True)))
        if not quick:
            obs.append(Obligation("vacuity:group-skipped[G=2]", pol, "vacuity",
                                  lambda pol=pol: witness(Quant(2), pol, plan_scan, _group_skipped,
                                                          use_hint=True)))
    obs.append(Obligation("vacuity:lost-record", "repair", "vacuity",
                          lambda: witness(Quant(1), "repair", evict, _lost_record, prop="c2")))
    return (obs + existence_and_cover(groups) + convergence_obligations() + keylevel_obligations()
            + _offloading_obligations())


def _offloading_obligations() -> list[Obligation]:
    """The second manager's (``offloading_obligations.py``; imported here, as it builds on this
    module's helpers)."""
    from kvspec.specs.offloading_obligations import offloading_obligations

    return offloading_obligations()


def existence_and_cover(groups: tuple[int, ...]) -> list[Obligation]:
    """Existence (every transition has a successor: every N on Quant, N <= BOUND on Unrolled
    per group count) and a witness run for each branch."""
    obs: list[Obligation] = []
    for pol in ("baseline", "signal-rescan", "repair"):
        obs.append(Obligation("existence", pol, "existence", lambda pol=pol: existence_every_n(pol),
                              "every transition has a successor from every invariant state, every N"))
        for G in groups:
            tag = "" if G == 1 else f",G={G}"
            obs.append(Obligation(f"existence[N<={BOUND}{tag}]", pol, "existence",
                                  lambda pol=pol, G=G: successor_exists(Unrolled(G, BOUND), pol),
                                  "every transition has a successor from every invariant state"))
    for name, pol, names, cond, statement in WITNESSES:
        obs.append(Obligation(f"witness:{name}", pol, "witness",
                              lambda pol=pol, names=names, cond=cond: reach(pol, names, cond), statement))
    return obs


def _baseline_stores_unowned(enc: Encoding) -> tuple[str, str, dict[str, Any]]:
    s, st = _step(enc, "baseline", plan_scan)
    assert st.scan is not None
    p = z3.Int("witness_p")
    r, _ = _sat([inv_for("bounds", enc, s), *st.constraints, st.scan.sel[0](p),
                 z3.Not(enc.v(s, 0, "owned", p))])
    return ("ok" if r == "sat" else "vacuous"), r, {}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped ``run_all``: ``results`` are those of the obligations done before it (the
    one being checked is not among them)."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__()
        self.results = results


def run_all(obs: list[Obligation] | None = None,
            progress: Callable[[Obligation, Result | None], None] | None = None) -> list[Result]:
    """Every obligation in turn; Ctrl-C (inside a Z3 check too: ``encoding.check_sat``) raises
    ``Interrupted`` with the results so far."""
    out: list[Result] = []
    try:
        for ob in obs if obs is not None else catalogue():
            if progress:
                progress(ob, None)
            res = ob.run()
            if progress:
                progress(ob, res)
            out.append(res)
    except KeyboardInterrupt:
        raise Interrupted(out) from None
    except ctypes.ArgumentError as exc:  # Ctrl-C while ctypes converted the arguments of a Z3 call
        if "KeyboardInterrupt" not in str(exc):
            raise
        raise Interrupted(out) from None
    return out


# -- convergence (C4): a ranking function -------------------------------------------------------


def _valid3(assumptions: list[z3.BoolRef], goal: z3.BoolRef, wit: list[z3.BoolRef] | None) -> tuple[str, str]:
    return _valid(assumptions, goal, wit)


def drop_counterexample(assumption: str) -> tuple[str, str, dict[str, Any]]:
    """``convergence:drop-<assumption>``: ``found`` with the model's values (``_read_step``), which
    ``kvspec.drivers.synthesis`` turns into a trace, or ``not found``."""
    from kvspec.specs import convergence as cv

    enc = Unrolled(1, BOUND)
    pre, post, inputs, cons = cv.drop(assumption, enc)
    r, model = _sat(cons, lambda m: _read_step(m, enc, pre, post, inputs))
    if r == "sat":
        return "found", "convergence fails without " + assumption, model
    return ("not found" if r == "unsat" else "unknown"), model.get("reason", ""), {}


def convergence_obligations() -> list[Obligation]:
    """C4 as a ranking proof (``specs/convergence.py``): invariant, non-increasing under E1,
    a fair round empties the pending set, a counterexample per dropped assumption, a witness."""
    from kvspec.specs import convergence as cv

    def steps(kind: str, enc: Encoding) -> Callable[[], tuple[str, str, dict[str, Any]]]:
        fn = {"invariant": cv.invariant, "non-increasing": cv.non_increasing,
              "round-decreases": cv.round_decreases}[kind]
        return lambda: _all_steps(fn(enc, _valid3, hint))

    obs: list[Obligation] = []
    for kind, statement in (("invariant", "C2, the owner index, records only below an active cursor: inductive"),
                            ("non-increasing", "E1 (no eviction of the working set): the pending set never grows"),
                            ("round-decreases", "E1-E3: a fair round (plan ; repair-phase with room) empties it")):
        obs.append(Obligation(f"convergence:{kind}", "repair", "proof", steps(kind, Quant(1)), statement))
        obs.append(Obligation(f"bounded:convergence:{kind}[N<={BOUND}]", "repair", "bounded",
                              steps(kind, Unrolled(1, BOUND)), statement + " (integer rank)"))
    for a, statement in (("E1", "an eviction of the working set raises the rank"),
                         ("E2", "a round without room leaves a non-zero rank"),
                         ("E3", "without a round, an environment step keeps a non-zero pending set")):
        obs.append(Obligation(f"convergence:drop-{a}", "repair", "counterexample",
                              lambda a=a: drop_counterexample(a), statement))
    obs.append(Obligation("witness:convergence", "repair", "witness",
                          lambda: reach("repair", cv.WITNESS_RUN, cv.witness_run),
                          "a run reaches a non-zero rank and a round brings it to zero"))
    return obs


# -- key level: any number of requests sharing keys ---------------------------------------------


def _valid_or_refuted(assumptions: list[z3.BoolRef], goal: z3.BoolRef,
                      wit: list[z3.BoolRef] | None) -> tuple[str, str]:
    """``_valid``; when the refutation half gives up (quantifiers), a counterexample on the
    concrete witness state still decides ``fails`` (a model of the stronger formula is a model)."""
    r, d = _valid(assumptions, goal, wit)
    if r == "unknown" and wit:
        r2, _ = _sat([*assumptions, *wit, z3.Not(goal)])
        if r2 == "sat":
            return "fails", "counterexample on the concrete witness state"
    return r, d


def keylevel_obligations() -> list[Obligation]:
    """C2 + C3 + I1 for any number of requests sharing keys (``specs/keylevel.py``)."""
    from kvspec.specs import keylevel as kl

    return [
        Obligation("keylevel:inductive", "repair", "proof", lambda: _all_steps(kl.inductive(_valid_or_refuted)),
                   "I1, in-flight dedup, C2, owner index, records: inductive for any number of requests "
                   "sharing keys"),
        Obligation("keylevel:no-amplification", "repair", "proof", lambda: _all_steps(kl.c3(_valid_or_refuted)),
                   "C3: each re-stored key is one transfer of a lost, uncovered key, across all requests"),
    ]
