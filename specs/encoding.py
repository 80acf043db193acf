"""Z3 encodings of one request's store bookkeeping: state, planning step, coverage transitions.

The abstraction (PROOFS.md beside this file has the full mapping to the model):

* One *focal* request with ``G`` KV groups. Per group: the length ``N`` of its
  accumulated GPU-id list, its cursor ``cur``, and per position ``p`` the booleans

  - ``hashed``: the block the scan would look at exists and carries a key
    (non-null, or a null recovered from the GPU prefix cache);
  - ``owned``: that block carries *this request's* key for ``p`` and is referenced
    (the model's ``owned_block``);
  - ``kept``: ``repair`` only, the position is not owned but a *retained copy* exists (a
    free GPU block carrying this request's key for ``p``, the model's ``retained_block``);
    ``hashed``, ``cached``, ``cfree`` and ``infl`` then describe that key. The environment
    (GPU frees, evictions, other requests' touches) changes it at any time;
  - ``cached``: the position's key is cached on CPU; ``cfree``: that CPU copy sits in
    the CPU free queue (evictable, and a pin takes it out of the free count);
  - ``infl``: the position is being stored (the block is in flight);
  - ``lost``: the ``repair`` policy holds a lost record for the position;
  - ``reg``: ``repair`` has indexed the position as an owner of its key.

  Confirmed positions are ``p < ready = min(N, conf)`` where ``conf`` is the number of
  confirmed full blocks; ``confirmed(p)`` below is that predicate. Keys of distinct
  positions differ (chained hashes); requests sharing keys appear as the environment
  transitions (others store, pin or evict the same keys).
* ``flag`` is the ``signal-rescan`` eviction flag; ``active`` is "the request has live,
  unfinished store state".

Two encodings of the same state share everything but the planning scan:

* ``Quant`` — arrays ``Int -> Bool`` with a symbolic length ``N`` (every ``N``); the scan
  is *relational*: the new cursor is a fresh integer pinned down by quantified
  constraints over a running count.
* ``Unrolled(M)`` — ``M`` boolean constants per array and ``0 <= N <= M``; the scan is a
  *functional* left-to-right loop unrolled in Python (no quantifiers).

Proving the two scans equal for every ``N <= 8`` (``obligations.py``) and comparing the
unrolled scan with the model's Python code on every small state
(``tests/test_spec_agreement.py``) is what ties the proofs to the model.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import z3

ARRAYS = ("hashed", "owned", "cached", "cfree", "infl", "lost", "reg", "kept")
POLICIES = ("baseline", "signal-rescan", "repair")

_ids = itertools.count()

# What Z3 answers for a check that Ctrl-C stopped while Z3's own SIGINT handler was installed (it
# is, during a check, unless the solver's ``ctrl_c`` is off): it cancels the check (``unknown``)
# and Python never sees the signal.
Z3_INTERRUPTED = "interrupted from keyboard"


def check_sat(s: z3.Solver, *assumptions: z3.ExprRef, threaded: bool = True) -> z3.CheckSatResult:
    """``s.check(*assumptions)``, but Ctrl-C raises ``KeyboardInterrupt`` (read as an answer, an
    interrupted check would make an obligation fail, or be retried, and the run go on as if
    nothing had happened).

    In the main thread (``threaded``) the check runs in a helper thread with Z3's own handler
    off, while this thread waits: Python's handler sees the signal at once (whichever handler a
    campaign worker installed), ``Z3_interrupt`` stops the check and the interrupt is raised. A
    helper thread costs about 0.3 ms: callers checking on every fuzzed operation pass
    ``threaded=False`` and get the check itself, with Z3's cancellation read back as the
    interrupt."""
    if not threaded or threading.current_thread() is not threading.main_thread():
        r = s.check(*assumptions)
        if r == z3.unknown and s.reason_unknown() == Z3_INTERRUPTED:
            raise KeyboardInterrupt
        return r
    s.set("ctrl_c", False)
    box: list[z3.CheckSatResult | BaseException] = []

    def check() -> None:
        try:
            box.append(s.check(*assumptions))
        except BaseException as exc:  # handed to the waiting thread
            box.append(exc)

    helper = threading.Thread(target=check, name="z3-check", daemon=True)
    helper.start()
    try:
        helper.join()
    except KeyboardInterrupt:
        s.ctx.interrupt()  # the check answers unknown at once
        helper.join()
        raise
    r = box[0]
    if isinstance(r, BaseException):
        raise r
    return r


class PosPred(Protocol):
    """A predicate over one position (a z3 Int, or a Python int when unrolled). Callers bind
    loop variables as defaults (``lambda p, g=g: ...``), which a ``Callable[[Any], ...]``
    parameter would not accept from a lambda."""

    def __call__(self, p: Any, /) -> z3.BoolRef: ...


class CountStep(Protocol):
    """``step(p, c)`` of a running count: whether position ``p`` counts, given the count ``c``."""

    def __call__(self, p: Any, c: z3.ArithRef, /) -> z3.BoolRef: ...


def _fresh(prefix: str) -> str:
    return f"{prefix}!{next(_ids)}"


def reset_names() -> None:
    """Restart fresh-name numbering, so an obligation's formulas (and so the solver's run)
    do not depend on which obligations ran before it."""
    global _ids
    _ids = itertools.count()


@dataclass
class Group:
    n: z3.ArithRef
    cur: z3.ArithRef
    arr: dict[str, Any]


@dataclass
class State:
    groups: list[Group]
    conf: z3.ArithRef
    flag: z3.BoolRef
    active: z3.BoolRef

    def with_group(self, g: int, **kw: Any) -> State:
        groups = list(self.groups)
        arr = dict(groups[g].arr)
        for name in ARRAYS:
            if name in kw:
                arr[name] = kw.pop(name)
        groups[g] = replace(groups[g], arr=arr, **kw)
        return replace(self, groups=groups)


@dataclass
class Scan:
    """One planning scan of the focal request: constraints, new cursors, selections."""

    constraints: list[z3.BoolRef]
    cur: list[z3.ArithRef]
    sel: list[PosPred]  # position selected by the positional scan (Phase 1b)
    rescan: list[PosPred] = field(default_factory=list)  # Phase 1a selections
    axioms: list[PosPred] = field(default_factory=list)  # bodies of its ForAlls

    def ground(self, points: range) -> list[z3.BoolRef]:
        """Instances of the quantified constraints at ``points``: implied by them, so adding
        them changes nothing but spares the solver the search for the instantiations."""
        return [body(i) for body in self.axioms for i in points]


class Encoding:
    """What both encodings provide; positions are z3 ints (Quant) or Python ints (Unrolled)."""

    kind = "abstract"
    G: int

    def at(self, a: Any, p: Any) -> z3.BoolRef:
        return a[p]

    def forall(self, body: PosPred) -> z3.BoolRef:
        raise NotImplementedError

    def table(self, body: PosPred) -> Any:
        raise NotImplementedError

    def array(self, name: str) -> Any:
        raise NotImplementedError

    def bound(self, n: z3.ArithRef) -> z3.BoolRef:
        return n >= 0

    def state(self, tag: str = "s") -> State:
        groups = []
        for g in range(self.G):
            groups.append(Group(z3.Int(_fresh(f"{tag}.N{g}")), z3.Int(_fresh(f"{tag}.cur{g}")),
                                {a: self.array(f"{tag}.{a}{g}") for a in ARRAYS}))
        return State(groups, z3.Int(_fresh(f"{tag}.conf")), z3.Bool(_fresh(f"{tag}.flag")),
                     z3.Bool(_fresh(f"{tag}.active")))

    # -- derived predicates -------------------------------------------------------------------

    def v(self, s: State, g: int, name: str, p: Any) -> z3.BoolRef:
        return self.at(s.groups[g].arr[name], p)

    def ready(self, s: State, g: int) -> z3.ArithRef:
        n = s.groups[g].n
        return z3.If(s.conf < n, s.conf, n)

    def confirmed(self, s: State, g: int, p: Any) -> z3.BoolRef:
        return z3.And(p >= 0, p < self.ready(s, g))

    def ownh(self, s: State, g: int, p: Any) -> z3.BoolRef:
        return z3.And(self.v(s, g, "owned", p), self.v(s, g, "hashed", p))

    def covered(self, s: State, g: int, p: Any) -> z3.BoolRef:
        return z3.Or(self.v(s, g, "cached", p), self.v(s, g, "infl", p))

    def below(self, s: State, g: int, p: Any) -> z3.BoolRef:
        return z3.And(p >= 0, p < s.groups[g].cur)

    def ready_to_store(self, policy: str, s: State, g: int, p: Any) -> z3.BoolRef:
        """The scan's READY class: baseline rules ignore ownership; repair needs the block owned,
        or a retained copy (R3)."""
        base = z3.And(self.v(s, g, "hashed", p), z3.Not(self.v(s, g, "infl", p)),
                      z3.Not(self.v(s, g, "cached", p)))
        if policy != "repair":
            return base
        return z3.And(base, z3.Or(self.v(s, g, "owned", p), self.v(s, g, "kept", p)))

    def pins(self, policy: str, s: State, g: int, p: Any) -> z3.BoolRef:
        """Repair R5: an owned, already-cached position pins its CPU copy (free count -1); a pin
        that would leave less room than the selection needs stops the scan like a READY one."""
        if policy != "repair":
            return z3.BoolVal(False)
        return z3.And(self.ownh(s, g, p), z3.Not(self.v(s, g, "infl", p)), self.v(s, g, "cached", p),
                      self.v(s, g, "cfree", p))

    def wf(self, s: State) -> z3.BoolRef:
        """Well-formed state: lengths and counts in range."""
        parts = [s.conf >= 0]
        for grp in s.groups:
            parts += [self.bound(grp.n)]
        return z3.And(parts)

    # -- the planning scan (per encoding) ------------------------------------------------------

    def scan(self, policy: str, s: State, free: z3.ArithRef, scheduled: z3.BoolRef,
             rescan: z3.BoolRef) -> Scan:
        raise NotImplementedError


class Quant(Encoding):
    """Symbolic length: arrays Int -> Bool, quantified constraints. Holds for every N."""

    kind = "quantified"

    def __init__(self, G: int = 1) -> None:
        self.G = G

    def forall(self, body: PosPred) -> z3.BoolRef:
        p = z3.Int(_fresh("p"))
        return z3.ForAll([p], body(p))

    def table(self, body: PosPred) -> Any:
        p = z3.Int(_fresh("q"))
        return z3.Lambda([p], body(p))

    def array(self, name: str) -> Any:
        return z3.Array(_fresh(name), z3.IntSort(), z3.BoolSort())

    def _count(self, tag: str, lo: z3.ArithRef, hi: z3.ArithRef, base: z3.ArithRef,
               step: CountStep, axioms: list[PosPred]
               ) -> tuple[z3.FuncDeclRef, list[z3.BoolRef]]:
        """A running count c over [lo, hi): c(lo) = base, c(p+1) = c(p) + [step(p, c(p))]."""
        c = z3.Function(_fresh(tag), z3.IntSort(), z3.IntSort())

        def body(p: Any) -> z3.BoolRef:
            return z3.Implies(z3.And(lo <= p, p < hi), c(p + 1) == c(p) + z3.If(step(p, c(p)), 1, 0))

        p = z3.Int(_fresh("p"))
        axioms.append(body)
        return c, [c(lo) == base, z3.ForAll([p], body(p), patterns=[c(p + 1)])]

    def scan(self, policy: str, s: State, free: z3.ArithRef, scheduled: z3.BoolRef,
             rescan: z3.BoolRef) -> Scan:
        cons: list[z3.BoolRef] = []
        curs: list[z3.ArithRef] = []
        sels: list[PosPred] = []
        resels: list[PosPred] = []
        axioms: list[PosPred] = []
        base: z3.ArithRef = z3.IntVal(0)
        for g in range(self.G):
            cur, ready = s.groups[g].cur, self.ready(s, g)
            rdy = (lambda g_: lambda p: self.ready_to_store(policy, s, g_, p))(g)
            pin: PosPred = (lambda g_: lambda p: self.pins(policy, s, g_, p))(g)
            # signal-rescan / baseline stop at the group boundary once the free count is used up
            scanned = scheduled if policy == "repair" else z3.And(scheduled, base < free)
            # Phase 1a (signal-rescan): [0, min(cur, ready)), never moves the cursor
            if policy == "signal-rescan":
                end = z3.If(cur < ready, cur, ready)
                ca, ax = self._count("cntA", z3.IntVal(0), end, base,
                                     lambda p, c, r=rdy: z3.And(r(p), c < free), axioms)
                cons += ax
                do_a = z3.And(scanned, rescan)

                def sel_a(p: Any, ca: Any = ca, end: Any = end, rdy: Any = rdy,
                          do_a: Any = do_a) -> z3.BoolRef:
                    return z3.And(do_a, p >= 0, p < end, rdy(p), ca(p) < free)

                resels.append(sel_a)
                base_b = z3.If(do_a, ca(end), base)
            else:
                resels.append(lambda p: z3.BoolVal(False))
                base_b = base
            hi = z3.If(ready > cur, ready, cur)
            cb, ax = self._count("cnt", cur, hi, base_b,
                                 lambda p, c, r=rdy, q=pin: z3.Or(r(p), q(p)), axioms)
            cons += ax
            c2 = z3.Int(_fresh("cur'"))
            # out of space: a READY position (or, repair, a pin that would starve the selection)
            # meets a used-up free count; the cursor stops there, not advanced
            def stop(p: Any, cb: Any = cb, rdy: PosPred = rdy, pin: PosPred = pin) -> z3.BoolRef:
                return z3.And(z3.Or(rdy(p), pin(p)), cb(p) >= free)

            p = z3.Int(_fresh("p"))

            def no_stop(p: Any, cur: Any = cur, c2: Any = c2, stop: Any = stop,
                        scanned: Any = scanned) -> z3.BoolRef:
                return z3.Implies(z3.And(scanned, cur <= p, p < c2), z3.Not(stop(p)))

            axioms.append(no_stop)
            cons += [z3.ForAll([p], no_stop(p)),
                     z3.If(scanned, z3.And(cur <= c2, c2 <= hi, z3.Implies(c2 < hi, stop(c2))), c2 == cur)]
            curs.append(c2)

            def sel_b(p: Any, cur: Any = cur, c2: Any = c2, rdy: Any = rdy,
                      scanned: Any = scanned) -> z3.BoolRef:
                return z3.And(scanned, cur <= p, p < c2, rdy(p))

            sels.append(sel_b)
            base = z3.If(scanned, cb(c2), base_b)
        return Scan(cons, curs, sels, resels, axioms)


class Unrolled(Encoding):
    """Bounded: M positions per array, 0 <= N <= M; the scan is a loop unrolled in Python."""

    kind = "unrolled"

    def __init__(self, G: int = 1, M: int = 4) -> None:
        self.G = G
        self.M = M

    def forall(self, body: PosPred) -> z3.BoolRef:
        return z3.And([body(i) for i in range(self.M)] or [z3.BoolVal(True)])

    def table(self, body: PosPred) -> Any:
        return [body(i) for i in range(self.M)]

    def array(self, name: str) -> Any:
        return [z3.Bool(_fresh(f"{name}[{i}]")) for i in range(self.M)]

    def bound(self, n: z3.ArithRef) -> z3.BoolRef:
        return z3.And(n >= 0, n <= self.M)

    def scan(self, policy: str, s: State, free: z3.ArithRef, scheduled: z3.BoolRef,
             rescan: z3.BoolRef) -> Scan:
        curs: list[z3.ArithRef] = []
        sels: list[PosPred] = []
        resels: list[PosPred] = []
        count: z3.ArithRef = z3.IntVal(0)  # CPU blocks consumed so far (selections, plus pins in repair)
        for g in range(self.G):
            cur, ready = s.groups[g].cur, self.ready(s, g)
            scanned = scheduled if policy == "repair" else z3.And(scheduled, count < free)
            sel_a: list[z3.BoolRef] = [z3.BoolVal(False)] * self.M
            if policy == "signal-rescan":
                do_a = z3.And(scanned, rescan)
                for i in range(self.M):
                    rdy_a = self.ready_to_store(policy, s, g, i)
                    take = z3.And(do_a, i < cur, i < ready, rdy_a, count < free)
                    sel_a[i] = take
                    count = count + z3.If(take, 1, 0)
            stopped: z3.BoolRef = z3.BoolVal(False)
            advance: z3.ArithRef = z3.IntVal(0)
            sel_b: list[z3.BoolRef] = []
            for i in range(self.M):
                visit = z3.And(scanned, z3.Not(stopped), i >= cur, i < ready)
                rdy, pin = self.ready_to_store(policy, s, g, i), self.pins(policy, s, g, i)
                stop_here = z3.And(visit, z3.Or(rdy, pin), count >= free)
                take = z3.And(visit, rdy, count < free)
                sel_b.append(take)
                stopped = z3.Or(stopped, stop_here)
                advance = advance + z3.If(z3.And(visit, z3.Not(stop_here)), 1, 0)
                count = count + z3.If(z3.And(visit, z3.Or(rdy, pin), count < free), 1, 0)
            curs.append(cur + advance)
            sels.append(lambda p, sel_b=sel_b: sel_b[p])
            resels.append(lambda p, sel_a=sel_a: sel_a[p])
        return Scan([], curs, sels, resels)
