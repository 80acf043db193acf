"""Transitions of the abstract state (``encoding.py``) and the properties proved about them.

Each transition is a function ``(enc, policy, s) -> Step``: constraints relating ``s`` to
the successor ``Step.post`` (fresh variables where the environment chooses). The
environment over-approximates everything other requests, the GPU scheduler and the
workers may do to the focal request's positions; the proofs therefore hold for any
interleaving of these steps, not just the model's call order.

``TRANSITIONS`` lists them by name with the policies they apply to. Transitions in
``CURSOR_RESETS`` may move a cursor back to 0; every other one must not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import z3

from kvspec.specs.encoding import Encoding, PosPred, Scan, State, _fresh


@dataclass
class Step:
    post: State
    constraints: list[z3.BoolRef]
    scan: Scan | None = None
    restored: list[PosPred] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)


def _keep(s: State, **over: Any) -> State:
    return State(list(s.groups), over.get("conf", s.conf), over.get("flag", s.flag),
                 over.get("active", s.active))


def _havoc(enc: Encoding, tag: str) -> Any:
    return enc.array(_fresh(tag))


def _retained_copies(enc: Encoding, s: State, g: int) -> tuple[Any, Any, z3.BoolRef]:
    """Retained copies come and go as the environment frees, touches and evicts GPU blocks (a
    store's completion may free the last reference to another request's block carrying this
    request's key): ``kept`` changes freely. A position with a retained copy is hashed (the
    copy's key is the position's) and not owned, so on a position that is not owned ``hashed``
    changes with ``kept``: unchanged where ``kept`` is, set where ``kept`` is; an owned
    position's ``hashed`` stays (these transitions keep ownership). Returns (kept', hashed',
    the constraint)."""
    kept2, hashed2 = _havoc(enc, f"kept{g}"), _havoc(enc, f"hash{g}")
    follows = enc.forall(lambda p: z3.And(
        z3.Implies(z3.Or(enc.at(kept2, p) == enc.v(s, g, "kept", p), enc.v(s, g, "owned", p)),
                   enc.at(hashed2, p) == enc.v(s, g, "hashed", p)),
        z3.Implies(z3.And(enc.at(kept2, p), z3.Not(enc.v(s, g, "owned", p))), enc.at(hashed2, p))))
    return kept2, hashed2, follows


# -- the planning step -----------------------------------------------------------------------


def plan_scan(enc: Encoding, policy: str, s: State) -> Step:
    """``build_connector_meta``'s positional scan of the focal request (per policy).

    Inputs: ``free`` (CPU free count when the request's scan starts), ``scheduled``
    (the request is in this step's output with tokens). ``signal-rescan`` consumes the
    flag whether or not the focal request is scheduled, and rescans iff it was set."""
    return _scan(enc, policy, s, s.flag, keep_flag=False)


def consume_flag(enc: Encoding, policy: str, s: State) -> Step:
    """signal-rescan: ``build_connector_meta`` starts. The eviction flag is read once for the
    whole build (every scan in it rescans iff it was set) and cleared; evictions later in the
    same build set it again, for the next build. ``plan`` is this and ``scan-latched`` at once;
    the refinement's step templates put the build's other allocations between the two."""
    return Step(_keep(s, flag=z3.BoolVal(False)), [])


def scan_latched(enc: Encoding, policy: str, s: State) -> Step:
    """signal-rescan: the focal request's scan in a build that ``consume`` started: Phase 1a
    runs iff the input ``rescan`` (the flag the build read) is set; the flag stays as the
    build's evictions left it."""
    rescan = z3.Bool(_fresh("rescan"))
    st = _scan(enc, policy, s, rescan, keep_flag=True)
    st.inputs["rescan"] = rescan
    return st


def _scan(enc: Encoding, policy: str, s: State, rescan: z3.BoolRef, keep_flag: bool) -> Step:
    """The focal request's scan with Phase 1a decided by ``rescan``; signal-rescan's flag is
    cleared unless ``keep_flag``."""
    free = z3.Int(_fresh("free"))
    scheduled = z3.Bool(_fresh("scheduled"))
    sc = enc.scan(policy, s, free, scheduled, rescan)
    post = _keep(s, flag=z3.BoolVal(False) if policy == "signal-rescan" and not keep_flag else s.flag)
    for g in range(enc.G):
        grp = s.groups[g]
        sel_b, sel_a = sc.sel[g], sc.rescan[g]
        infl = enc.table(lambda p, g=g, a=sel_a, b=sel_b: z3.Or(enc.v(s, g, "infl", p), a(p), b(p)))
        upd: dict[str, Any] = {"infl": infl, "cur": sc.cur[g]}
        if policy == "repair":
            c2 = sc.cur[g]
            upd["reg"] = enc.table(lambda p, g=g, c2=c2, grp=grp: z3.Or(
                enc.v(s, g, "reg", p),
                z3.And(scheduled, grp.cur <= p, p < c2, enc.ownh(s, g, p))))
        post = post.with_group(g, **upd)
    return Step(post, [free >= 0, *sc.constraints], scan=sc,
                inputs={"free": free, "scheduled": scheduled})


def repair_phase(enc: Encoding, policy: str, s: State) -> Step:
    """Repair R8: pending records still owned and uncovered are re-stored (all of them when
    ``room``; any subset otherwise); the others are dropped."""
    room = z3.Bool(_fresh("room"))
    post = _keep(s)
    cons: list[z3.BoolRef] = []
    restored: list[PosPred] = []
    for g in range(enc.G):
        rest = _havoc(enc, f"rest{g}")

        def wanted(p: Any, g: int = g) -> z3.BoolRef:
            return z3.And(s.active, enc.v(s, g, "lost", p), enc.below(s, g, p), enc.ownh(s, g, p),
                          z3.Not(enc.covered(s, g, p)))

        cons.append(enc.forall(lambda p, g=g, rest=rest, w=wanted: z3.Implies(enc.at(rest, p), w(p))))
        every = enc.forall(lambda p, rest=rest, w=wanted: z3.Implies(w(p), enc.at(rest, p)))
        cons.append(z3.Implies(room, every))
        post = post.with_group(
            g,
            infl=enc.table(lambda p, g=g, rest=rest: z3.Or(enc.v(s, g, "infl", p), enc.at(rest, p))),
            lost=enc.table(lambda p, rest=rest, w=wanted: z3.And(w(p), z3.Not(enc.at(rest, p)))),
        )
        restored.append(lambda p, rest=rest: enc.at(rest, p))
    return Step(post, cons, restored=restored, inputs={"room": room})


# -- coverage changes ------------------------------------------------------------------------


def evict(enc: Encoding, policy: str, s: State) -> Step:
    """A CPU allocation (anyone's: scan, re-store, flush, hand-off) pops free CPU blocks and
    evicts their keys. Repair R1 records every live owner; signal-rescan sets the flag."""
    post = _keep(s)
    cons: list[z3.BoolRef] = []
    any_evicted = z3.Bool(_fresh("evicted_any"))
    for g in range(enc.G):
        ev = _havoc(enc, f"ev{g}")
        cons.append(enc.forall(lambda p, g=g, ev=ev: z3.Implies(
            enc.at(ev, p), z3.And(enc.v(s, g, "cached", p), enc.v(s, g, "cfree", p), any_evicted))))
        upd = {
            "cached": enc.table(lambda p, g=g, ev=ev: z3.And(enc.v(s, g, "cached", p),
                                                             z3.Not(enc.at(ev, p)))),
            "cfree": enc.table(lambda p, g=g, ev=ev: z3.And(enc.v(s, g, "cfree", p), z3.Not(enc.at(ev, p)))),
        }
        if policy == "repair":
            upd["lost"] = enc.table(lambda p, g=g, ev=ev: z3.Or(
                enc.v(s, g, "lost", p),
                z3.And(enc.at(ev, p), s.active, enc.below(s, g, p), enc.ownh(s, g, p),
                       enc.v(s, g, "reg", p))))
        post = post.with_group(g, **upd)
    if policy == "signal-rescan":
        post = replace_flag(post, z3.Or(s.flag, any_evicted))
    return Step(post, cons)


def replace_flag(s: State, flag: z3.BoolRef) -> State:
    return State(s.groups, s.conf, flag, s.active)


def complete(enc: Encoding, policy: str, s: State) -> Step:
    """Store events complete: a key whose transfer completes is registered on CPU (and its
    copy freed to the queue); a key may stay in flight through another transfer."""
    post = _keep(s)
    cons: list[z3.BoolRef] = []
    for g in range(enc.G):
        done, infl2 = _havoc(enc, f"done{g}"), _havoc(enc, f"infl{g}")
        cons.append(enc.forall(lambda p, g=g, d=done, i2=infl2: z3.And(
            z3.Implies(enc.at(d, p), enc.v(s, g, "infl", p)),
            z3.Implies(enc.at(i2, p), enc.v(s, g, "infl", p)),
            z3.Implies(z3.And(enc.v(s, g, "infl", p), z3.Not(enc.at(i2, p))), enc.at(d, p)))))
        kept2, hashed2, follows = _retained_copies(enc, s, g)
        cons.append(follows)
        post = post.with_group(
            g, infl=infl2, cfree=_havoc(enc, f"cfree{g}"), kept=kept2, hashed=hashed2,
            cached=enc.table(lambda p, g=g, d=done: z3.Or(enc.v(s, g, "cached", p), enc.at(d, p))))
    return Step(post, cons)


def env_store(enc: Encoding, policy: str, s: State) -> Step:
    """Other requests (or the finish flush) put the focal request's keys in flight; loads
    and pins move CPU copies in and out of the free queue; GPU blocks are freed, touched and
    evicted (retained copies come and go)."""
    post = _keep(s)
    cons: list[z3.BoolRef] = []
    for g in range(enc.G):
        infl2 = _havoc(enc, f"infl{g}")
        cons.append(enc.forall(lambda p, g=g, i2=infl2: z3.Implies(enc.v(s, g, "infl", p), enc.at(i2, p))))
        kept2, hashed2, follows = _retained_copies(enc, s, g)
        cons.append(follows)
        post = post.with_group(g, infl=infl2, cfree=_havoc(enc, f"cfree{g}"), kept=kept2, hashed=hashed2)
    return Step(post, cons)


def schedule(enc: Encoding, policy: str, s: State) -> Step:
    """A GPU step: new block ids appended (N grows), more tokens confirmed, blocks at or
    after the cursor hashed at schedule time (ownership there may change)."""
    conf2 = z3.Int(_fresh("conf"))
    post = _keep(s, conf=conf2)
    cons: list[z3.BoolRef] = [conf2 >= s.conf]
    for g in range(enc.G):
        n2, own, hsh = z3.Int(_fresh("N")), _havoc(enc, f"own{g}"), _havoc(enc, f"hash{g}")
        grp = s.groups[g]
        cons += [n2 >= grp.n, enc.bound(n2)]
        cons.append(enc.forall(lambda p, g=g, own=own, hsh=hsh, grp=grp: z3.Implies(
            p < grp.cur, z3.And(enc.at(own, p) == enc.v(s, g, "owned", p),
                                enc.at(hsh, p) == enc.v(s, g, "hashed", p)))))
        post = post.with_group(g, n=n2, owned=own, hashed=hsh, kept=_havoc(enc, f"kept{g}"))
    return Step(post, cons)


def sliding_free(enc: Encoding, policy: str, s: State) -> Step:
    """``remove_skipped_blocks``: positions below the window edge are freed (the connector's
    ids go stale: the block may be re-hashed for someone else)."""
    post = _keep(s)
    cons: list[z3.BoolRef] = []
    edges: dict[str, Any] = {}
    for g in range(enc.G):
        edge, hsh = z3.Int(_fresh("edge")), _havoc(enc, f"hash{g}")
        edges[f"edge{g}"] = edge
        cons.append(enc.forall(lambda p, g=g, edge=edge, hsh=hsh: z3.Implies(
            p >= edge, enc.at(hsh, p) == enc.v(s, g, "hashed", p))))
        post = post.with_group(
            g, hashed=hsh, kept=_havoc(enc, f"kept{g}"),
            owned=enc.table(lambda p, g=g, edge=edge: z3.And(enc.v(s, g, "owned", p), p >= edge)))
    return Step(post, cons, inputs=edges)


def preempt(enc: Encoding, policy: str, s: State) -> Step:
    """Preemption: GPU blocks freed, computed tokens 0; the connector resets ids and cursors;
    repair drops the request's records."""
    post = _keep(s, conf=z3.IntVal(0))
    for g in range(enc.G):
        upd: dict[str, Any] = {"n": z3.IntVal(0), "cur": z3.IntVal(0),
                               "owned": enc.table(lambda p: z3.BoolVal(False)), "kept": _havoc(enc, f"kept{g}")}
        if policy == "repair":
            upd["lost"] = enc.table(lambda p: z3.BoolVal(False))
        post = post.with_group(g, **upd)
    return Step(post, [])


def resume(enc: Encoding, policy: str, s: State) -> Step:
    """Resume after preemption, MRV1 (resumed ids) or MRV2 (scheduled as new): both hand the
    connector a full table, which replaces the ids and keeps the cursors (0 since the
    preemption)."""
    conf2 = z3.Int(_fresh("conf"))
    post = _keep(s, conf=conf2)
    cons: list[z3.BoolRef] = [conf2 >= 0]
    for g in range(enc.G):
        n2 = z3.Int(_fresh("N"))
        cons += [s.groups[g].cur == 0, enc.bound(n2)]
        post = post.with_group(g, n=n2, owned=_havoc(enc, f"own{g}"), hashed=_havoc(enc, f"hash{g}"),
                               kept=_havoc(enc, f"kept{g}"))
    return Step(post, cons)


def loaded_full_table(enc: Encoding, policy: str, s: State) -> Step:
    """A request whose load completed is scheduled as new: a full table that extends the old
    one (same blocks below the old length), cursors kept."""
    post = _keep(s)
    cons: list[z3.BoolRef] = []
    for g in range(enc.G):
        grp = s.groups[g]
        n2, own, hsh = z3.Int(_fresh("N")), _havoc(enc, f"own{g}"), _havoc(enc, f"hash{g}")
        cons += [n2 >= grp.n, enc.bound(n2)]
        cons.append(enc.forall(lambda p, g=g, own=own, hsh=hsh, grp=grp: z3.Implies(
            p < grp.n, z3.And(enc.at(own, p) == enc.v(s, g, "owned", p),
                              enc.at(hsh, p) == enc.v(s, g, "hashed", p)))))
        post = post.with_group(g, n=n2, owned=own, hashed=hsh, kept=_havoc(enc, f"kept{g}"))
    return Step(post, cons)


def finish(enc: Encoding, policy: str, s: State) -> Step:
    """The request finishes: its state is finished or dropped; repair drops its records."""
    post = _keep(s, active=z3.BoolVal(False))
    if policy == "repair":
        for g in range(enc.G):
            post = post.with_group(g, lost=enc.table(lambda p: z3.BoolVal(False)))
    return Step(post, [])


def reset(enc: Encoding, policy: str, s: State) -> Step:
    """``reset()``: store state forgotten (cursor gone: 0), transfers abandoned (nothing in
    flight), records and owner index cleared; the CPU cache may be cleared; the flag is
    kept (the model's default)."""
    post = _keep(s)
    cons: list[z3.BoolRef] = []
    for g in range(enc.G):
        cached2 = _havoc(enc, f"cached{g}")
        cons.append(enc.forall(lambda p, g=g, c2=cached2: z3.Implies(enc.at(c2, p),
                                                                     enc.v(s, g, "cached", p))))
        post = post.with_group(g, cur=z3.IntVal(0), cached=cached2, kept=_havoc(enc, f"kept{g}"),
                               infl=enc.table(lambda p: z3.BoolVal(False)),
                               lost=enc.table(lambda p: z3.BoolVal(False)),
                               reg=enc.table(lambda p: z3.BoolVal(False)))
    return Step(post, cons)


TransitionFn = Callable[[Encoding, str, State], Step]

TRANSITIONS: dict[str, tuple[TransitionFn, tuple[str, ...]]] = {
    "plan": (plan_scan, ("baseline", "signal-rescan", "repair")),
    "consume": (consume_flag, ("signal-rescan",)),
    "scan-latched": (scan_latched, ("signal-rescan",)),
    "repair-phase": (repair_phase, ("repair",)),
    "evict": (evict, ("baseline", "signal-rescan", "repair")),
    "complete": (complete, ("baseline", "signal-rescan", "repair")),
    "env-store": (env_store, ("baseline", "signal-rescan", "repair")),
    "schedule": (schedule, ("baseline", "signal-rescan", "repair")),
    "sliding-free": (sliding_free, ("baseline", "signal-rescan", "repair")),
    "preempt": (preempt, ("baseline", "signal-rescan", "repair")),
    "resume": (resume, ("baseline", "signal-rescan", "repair")),
    "loaded-full-table": (loaded_full_table, ("baseline", "signal-rescan", "repair")),
    "finish": (finish, ("baseline", "signal-rescan", "repair")),
    "reset": (reset, ("baseline", "signal-rescan", "repair")),
}
CURSOR_RESETS = ("preempt", "reset")


def transitions_for(policy: str) -> list[tuple[str, TransitionFn]]:
    return [(name, fn) for name, (fn, pols) in TRANSITIONS.items() if policy in pols]


# -- initial state and properties ------------------------------------------------------------


def init(enc: Encoding, policy: str, s: State) -> z3.BoolRef:
    """Registration (``update_state_after_alloc``): empty ids, cursors 0, no records, flag clear."""
    parts = [enc.wf(s), s.active, z3.Not(s.flag)]
    for g in range(enc.G):
        parts += [s.groups[g].n == 0, s.groups[g].cur == 0,
                  enc.forall(lambda p, g=g: z3.And(z3.Not(enc.v(s, g, "lost", p)),
                                                   z3.Not(enc.v(s, g, "reg", p))))]
    return z3.And(parts)


def bounds(enc: Encoding, s: State) -> z3.BoolRef:
    """I9 strengthened: 0 <= cursor <= ready <= N for every group."""
    return z3.And([z3.And(0 <= s.groups[g].cur, s.groups[g].cur <= enc.ready(s, g)) for g in range(enc.G)])


def holes_covered(enc: Encoding, s: State, pending: Callable[[int, Any], z3.BoolRef]) -> z3.BoolRef:
    """Every owned hashed position below an active cursor is cached, in flight, or ``pending``."""
    return z3.Implies(s.active, z3.And([enc.forall(lambda p, g=g: z3.Implies(
        z3.And(enc.below(s, g, p), enc.ownh(s, g, p)),
        z3.Or(enc.covered(s, g, p), pending(g, p)))) for g in range(enc.G)]))


def c1(enc: Encoding, s: State) -> z3.BoolRef:
    return holes_covered(enc, s, lambda g, p: z3.BoolVal(False))


def c2(enc: Encoding, s: State) -> z3.BoolRef:
    return holes_covered(enc, s, lambda g, p: enc.v(s, g, "lost", p))


def registered(enc: Encoding, s: State) -> z3.BoolRef:
    """Repair's owner index covers every owned hashed position below the cursor."""
    return z3.And([enc.forall(lambda p, g=g: z3.Implies(z3.And(enc.below(s, g, p), enc.ownh(s, g, p)),
                                                         enc.v(s, g, "reg", p))) for g in range(enc.G)])


def flag_pending(enc: Encoding, s: State) -> z3.BoolRef:
    """signal-rescan's completeness claim: a hole exists only while the eviction flag is set."""
    return holes_covered(enc, s, lambda g, p: s.flag)


def inv_for(prop: str, enc: Encoding, s: State) -> z3.BoolRef:
    """The inductive invariant proved for ``prop`` (property plus its strengthening)."""
    parts = [enc.wf(s), bounds(enc, s)]
    if prop == "bounds":
        pass
    elif prop == "c2":
        parts += [registered(enc, s), c2(enc, s)]
    elif prop == "c1":
        parts += [c1(enc, s)]
    elif prop == "flag":
        parts += [flag_pending(enc, s)]
    else:
        raise ValueError(prop)
    return z3.And(parts)

