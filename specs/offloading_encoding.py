"""Z3 encoding of the second manager's bookkeeping: vLLM 0.33.0's ``CPUOffloadingManager``
(``kvspec.model.offloading``) with the driver's observations (``kvspec.drivers.offloading``).

The abstraction (PROOFS.md, "The second manager", has the mapping to the snapshots):

* Keys are integers (opaque: the model's ``(hash, group)`` keys numbered per trace); chunk
  slots are integers ``0..N-1``, ``N`` the pool size (``num_chunks``), symbolic.
* Per key: ``res`` (the key has a chunk: the policy's ``resident()``), ``slot`` (its chunk id),
  ``ref`` (its ``ref_cnt``: -1 while being stored), and the driver's observations ``loads``
  (loads in flight by its own ``prepare_load`` calls, ``Observed.loads``) and ``stores`` (a
  store returned by ``prepare_store`` not yet completed, ``Observed.stores``). ``slot`` and
  ``ref`` mean something only where ``res`` holds.
* Per slot: ``used`` (a resident key's chunk is there), ``free`` (it is on the free list) and
  the ghost ``owner`` (the key whose chunk is there: what makes "distinct slots" a statement
  about one key at a time). ``nalloc`` is ``num_allocated``.

Transitions, each one manager call on one key (a call on several keys is a sequence of
them; ``offloading_refinement.py`` maps every driver operation to its sequence):

* ``prepare_store``: a key with no chunk gets one, being stored: the slot ``nalloc`` while
  ``nalloc < N``, else a slot of the free list (which one is a choice: the model takes the
  last freed). No successor when neither exists: the manager evicts first (``evict``) or
  returns None, which changes nothing here.
* ``evict``: **the abstract eviction choice**: any resident key with ``ref == 0`` that the
  offering call does not protect (an input set: the offered keys) loses its chunk, whose slot
  joins the free list. LRU and ARC both choose among exactly those keys (``evict`` of
  ``lru.py`` and ``arc.py`` filter on ``ref_cnt == 0`` and ``protected``) and differ only in
  the order, which is not encoded: the lockstep against vLLM checks it.
* ``complete_store_ok`` / ``complete_store_fail``: the driver completes a store it has in
  flight; a key still being stored becomes ready (``ref`` 0) or loses its chunk and frees its
  slot; any other key is ignored by the manager (``act`` false). The driver forgets the store.
* ``prepare_load``: a ready key (the connector loads only keys a lookup found HIT) gets one
  more load: ``ref`` and the driver's ``loads`` both + 1.
* ``complete_load``: the driver completes a load it has in flight; the manager refuses
  (``act`` false, nothing changes, the driver keeps the load) unless the key has a chunk with
  ``ref > 0``; else both counts - 1.
* ``reset_cache``: every chunk dropped, the pool empty, the driver's observations cleared (it
  never completes a transfer from before a reset).

The other operations (``new``, ``positions``, ``lookup``, ``touch``, ``finish``) change none of
this state.

Three backends evaluate the same transition and invariant code:

* ``Quant`` — Z3 arrays ``Int -> Bool/Int`` and ``ForAll`` over keys and slots: every N, any
  number of keys;
* ``Unrolled(K, M)`` — ``K`` keys and ``M`` slots, each array a Python list of Z3 constants,
  ``0 < N <= M``: quantifier-free and array-free (reads at a symbolic index are ``If``
  chains): an independent second encoding for the bounded cross-checks;
* ``Concrete`` — Python values (dicts with a default), for the refinement check: the
  transitions' constraints are evaluated on the values read off the model's snapshots.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import z3

_ids = itertools.count()

KEY_ARRAYS = {"res": "bool", "slot": "int", "ref": "int", "loads": "int", "stores": "bool"}
SLOT_ARRAYS = {"used": "bool", "free": "bool", "owner": "int"}
STORING = -1  # ref of a chunk being stored


def _fresh(prefix: str) -> str:
    return f"{prefix}!{next(_ids)}"


def reset_names() -> None:
    """Restart fresh-name numbering (an obligation's formulas do not depend on what ran before)."""
    global _ids
    _ids = itertools.count()


# -- backends -------------------------------------------------------------------------------------


class Backend:
    """What the transitions and invariants are written against: array reads and updates,
    Boolean connectives, and quantifiers over keys and slots."""

    kind = "abstract"

    def And(self, *xs: Any) -> Any:
        return z3.And(*xs) if xs else z3.BoolVal(True)

    def Or(self, *xs: Any) -> Any:
        return z3.Or(*xs) if xs else z3.BoolVal(False)

    def Not(self, x: Any) -> Any:
        return z3.Not(x)

    def Implies(self, a: Any, b: Any) -> Any:
        return z3.Implies(a, b)

    def If(self, c: Any, a: Any, b: Any) -> Any:
        return z3.If(c, a, b)

    def true(self) -> Any:
        return z3.BoolVal(True)

    def sel(self, a: Any, i: Any) -> Any:
        raise NotImplementedError

    def upd(self, a: Any, i: Any, v: Any) -> Any:
        raise NotImplementedError

    def const(self, domain: str, v: Any) -> Any:
        """The array over ``domain`` ("key" or "slot") with every entry ``v``."""
        raise NotImplementedError

    def forall(self, domain: str, body: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def exists(self, domain: str, body: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def in_range(self, domain: str, i: Any) -> Any:
        """An index of the domain (always, but for ``Unrolled``'s finite key and slot sets)."""
        return self.true()

    def array(self, tag: str, domain: str, sort: str) -> Any:
        """A fresh symbolic array (symbolic backends only)."""
        raise NotImplementedError

    def scalar(self, tag: str, sort: str) -> Any:
        return z3.Int(_fresh(tag)) if sort == "int" else z3.Bool(_fresh(tag))


class Quant(Backend):
    """Every N, unboundedly many keys: Z3 arrays, ``ForAll`` / ``Exists`` over the integers."""

    kind = "quantified"

    def sel(self, a: Any, i: Any) -> Any:
        return z3.Select(a, i)

    def upd(self, a: Any, i: Any, v: Any) -> Any:
        return z3.Store(a, i, v)

    def const(self, domain: str, v: Any) -> Any:
        val = z3.BoolVal(v) if isinstance(v, bool) else z3.IntVal(v)
        return z3.K(z3.IntSort(), val)

    def forall(self, domain: str, body: Callable[[Any], Any]) -> Any:
        x = z3.Int(_fresh(domain))
        return z3.ForAll([x], body(x))

    def exists(self, domain: str, body: Callable[[Any], Any]) -> Any:
        x = z3.Int(_fresh(domain))
        return z3.Exists([x], body(x))

    def array(self, tag: str, domain: str, sort: str) -> Any:
        rng = z3.IntSort() if sort == "int" else z3.BoolSort()
        return z3.Array(_fresh(tag), z3.IntSort(), rng)


class Unrolled(Backend):
    """``K`` keys, ``M`` slots, ``0 < N <= M``: lists of constants, no quantifiers, no arrays.
    A read at a symbolic index is an ``If`` chain over the domain (its last entry where the
    index is out of range: ``in_range`` rules that out for the keys and slots a transition acts
    on, and the invariant for a resident key's slot and a used slot's owner)."""

    kind = "unrolled"

    def __init__(self, K: int = 4, M: int = 3) -> None:
        self.K, self.M = K, M

    def size(self, domain: str) -> int:
        return self.K if domain == "key" else self.M

    def sel(self, a: list[Any], i: Any) -> Any:
        if isinstance(i, int):
            return a[i]
        out = a[-1]
        for idx in range(len(a) - 2, -1, -1):
            out = z3.If(i == idx, a[idx], out)
        return out

    def upd(self, a: list[Any], i: Any, v: Any) -> list[Any]:
        if isinstance(i, int):
            return [v if idx == i else x for idx, x in enumerate(a)]
        return [z3.If(i == idx, v, x) for idx, x in enumerate(a)]

    def const(self, domain: str, v: Any) -> list[Any]:
        val = z3.BoolVal(v) if isinstance(v, bool) else z3.IntVal(v)
        return [val] * self.size(domain)

    def forall(self, domain: str, body: Callable[[Any], Any]) -> Any:
        return z3.And([body(i) for i in range(self.size(domain))])

    def exists(self, domain: str, body: Callable[[Any], Any]) -> Any:
        return z3.Or([body(i) for i in range(self.size(domain))])

    def in_range(self, domain: str, i: Any) -> Any:
        return z3.And(0 <= i, i < self.size(domain))

    def array(self, tag: str, domain: str, sort: str) -> list[Any]:
        return [self.scalar(f"{tag}[{i}]", sort) for i in range(self.size(domain))]


@dataclass(frozen=True)
class CArray:
    """A concrete array: a default and the entries that differ from it."""

    default: Any
    data: Mapping[Any, Any] = field(default_factory=dict)

    def get(self, i: Any) -> Any:
        return self.data.get(i, self.default)

    def set(self, i: Any, v: Any) -> CArray:
        d = dict(self.data)
        if v == self.default:
            d.pop(i, None)
        else:
            d[i] = v
        return CArray(self.default, d)


class Concrete(Backend):
    """Python values. Quantifiers range over ``keys`` and ``slots``, which must include every
    index where an array of the states at hand differs from its default, plus one where none
    does (what ``domain_of`` builds): there a ``ForAll`` over the integers is decided."""

    kind = "concrete"

    def __init__(self, keys: Iterable[int], slots: Iterable[int]) -> None:
        self.keys, self.slots = sorted(set(keys)), sorted(set(slots))

    def And(self, *xs: Any) -> bool:
        return all(xs)

    def Or(self, *xs: Any) -> bool:
        return any(xs)

    def Not(self, x: Any) -> bool:
        return not x

    def Implies(self, a: Any, b: Any) -> bool:
        return (not a) or bool(b)

    def If(self, c: Any, a: Any, b: Any) -> Any:
        return a if c else b

    def true(self) -> bool:
        return True

    def sel(self, a: CArray, i: Any) -> Any:
        return a.get(i)

    def upd(self, a: CArray, i: Any, v: Any) -> CArray:
        return a.set(i, v)

    def const(self, domain: str, v: Any) -> CArray:
        return CArray(v)

    def forall(self, domain: str, body: Callable[[Any], Any]) -> bool:
        return all(body(i) for i in (self.keys if domain == "key" else self.slots))

    def exists(self, domain: str, body: Callable[[Any], Any]) -> bool:
        return any(body(i) for i in (self.keys if domain == "key" else self.slots))


# -- state ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OState:
    res: Any
    slot: Any
    ref: Any
    loads: Any
    stores: Any
    used: Any
    free: Any
    owner: Any
    nalloc: Any
    n: Any


def state(B: Backend, tag: str = "s") -> OState:
    """A fresh symbolic state."""
    arrays = {name: B.array(f"{tag}.{name}", "key", sort) for name, sort in KEY_ARRAYS.items()}
    arrays |= {name: B.array(f"{tag}.{name}", "slot", sort) for name, sort in SLOT_ARRAYS.items()}
    return OState(**arrays, nalloc=B.scalar(f"{tag}.nalloc", "int"), n=B.scalar(f"{tag}.N", "int"))


@dataclass
class Step:
    """One transition from ``pre``-state: its precondition (on the state and the inputs), its
    constraints on the choices, the successor, and ``act``: the manager acted (False: it
    refused or ignored the call, for the transitions where it can)."""

    post: OState
    pre: list[Any]
    cons: list[Any]
    inputs: dict[str, Any] = field(default_factory=dict)
    choices: dict[str, Any] = field(default_factory=dict)
    act: Any = True


Params = Mapping[str, Any]
TransitionFn = Callable[[Backend, OState, Params], Step]

# per transition: its inputs and its choices, each (name, domain-or-sort)
SIGNATURES: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {
    "prepare_store": ((("k", "key"),), (("j", "slot"),)),
    "evict": ((("prot", "keyset"),), (("v", "key"),)),
    "complete_store_ok": ((("k", "key"),), ()),
    "complete_store_fail": ((("k", "key"),), ()),
    "prepare_load": ((("k", "key"),), ()),
    "complete_load": ((("k", "key"),), ()),
    "reset_cache": ((), ()),
}


def prepare_store(B: Backend, s: OState, p: Params) -> Step:
    k, j = p["k"], p["j"]
    fresh = s.nalloc < s.n
    pre = [B.in_range("key", k), B.Not(B.sel(s.res, k)),
           B.Or(fresh, B.exists("slot", lambda x: B.And(B.in_range("slot", x), B.sel(s.free, x))))]
    cons = [B.in_range("slot", j), B.If(fresh, j == s.nalloc, B.sel(s.free, j))]
    post = replace(s, res=B.upd(s.res, k, True), slot=B.upd(s.slot, k, j), ref=B.upd(s.ref, k, STORING),
                   stores=B.upd(s.stores, k, True), used=B.upd(s.used, j, True), free=B.upd(s.free, j, False),
                   owner=B.upd(s.owner, j, k), nalloc=B.If(fresh, s.nalloc + 1, s.nalloc))
    return Step(post, pre, cons)


def evictable(B: Backend, s: OState, prot: Any, v: Any) -> Any:
    """The keys LRU and ARC choose among: resident, ``ref_cnt == 0``, not protected."""
    return B.And(B.in_range("key", v), B.sel(s.res, v), B.sel(s.ref, v) == 0, B.Not(B.sel(prot, v)))


def _evict_with(guard: Callable[[Backend, OState, Any, Any], Any]) -> TransitionFn:
    def evict(B: Backend, s: OState, p: Params) -> Step:
        prot, v = p["prot"], p["v"]
        pre = [B.exists("key", lambda x: guard(B, s, prot, x))]
        j = B.sel(s.slot, v)
        post = replace(s, res=B.upd(s.res, v, False), used=B.upd(s.used, j, False), free=B.upd(s.free, j, True))
        return Step(post, pre, [guard(B, s, prot, v)])
    return evict


evict = _evict_with(evictable)


def _complete_store(B: Backend, s: OState, p: Params, success: bool, free_slot: bool = True) -> Step:
    k = p["k"]
    act = B.And(B.sel(s.res, k), B.sel(s.ref, k) == STORING)
    pre = [B.in_range("key", k), B.sel(s.stores, k)]
    stores = B.upd(s.stores, k, False)
    if success:
        post = replace(s, ref=B.upd(s.ref, k, B.If(act, 0, B.sel(s.ref, k))), stores=stores)
    else:
        j = B.sel(s.slot, k)
        free = B.upd(s.free, j, B.If(act, True, B.sel(s.free, j))) if free_slot else s.free
        post = replace(s, res=B.upd(s.res, k, B.If(act, False, B.sel(s.res, k))),
                       used=B.upd(s.used, j, B.If(act, False, B.sel(s.used, j))), free=free, stores=stores)
    return Step(post, pre, [], act=act)


def complete_store_ok(B: Backend, s: OState, p: Params) -> Step:
    return _complete_store(B, s, p, True)


def complete_store_fail(B: Backend, s: OState, p: Params) -> Step:
    return _complete_store(B, s, p, False)


def prepare_load(B: Backend, s: OState, p: Params) -> Step:
    k = p["k"]
    pre = [B.in_range("key", k), B.sel(s.res, k), B.sel(s.ref, k) >= 0]
    post = replace(s, ref=B.upd(s.ref, k, B.sel(s.ref, k) + 1), loads=B.upd(s.loads, k, B.sel(s.loads, k) + 1))
    return Step(post, pre, [])


def _complete_load_with(refs_taken: int, accept_from: int) -> TransitionFn:
    """``complete_load`` taking ``refs_taken`` from ``ref`` (1; the mutation 0), accepted from
    ``ref >= accept_from`` (1, vLLM's ``ref_cnt > 0``; the mutation 2)."""
    def complete_load(B: Backend, s: OState, p: Params) -> Step:
        k = p["k"]
        act = B.And(B.sel(s.res, k), B.sel(s.ref, k) >= accept_from)
        pre = [B.in_range("key", k), B.sel(s.loads, k) > 0]
        post = replace(s, ref=B.upd(s.ref, k, B.If(act, B.sel(s.ref, k) - refs_taken, B.sel(s.ref, k))),
                       loads=B.upd(s.loads, k, B.If(act, B.sel(s.loads, k) - 1, B.sel(s.loads, k))))
        return Step(post, pre, [], act=act)
    return complete_load


complete_load = _complete_load_with(1, 1)


def reset_cache(B: Backend, s: OState, p: Params) -> Step:
    post = replace(s, res=B.const("key", False), loads=B.const("key", 0), stores=B.const("key", False),
                   used=B.const("slot", False), free=B.const("slot", False), nalloc=0)
    return Step(post, [], [])


TRANSITIONS: dict[str, TransitionFn] = {
    "prepare_store": prepare_store,
    "evict": evict,
    "complete_store_ok": complete_store_ok,
    "complete_store_fail": complete_store_fail,
    "prepare_load": prepare_load,
    "complete_load": complete_load,
    "reset_cache": reset_cache,
}
WITH_ACT = ("complete_store_ok", "complete_store_fail", "complete_load")  # the manager may ignore or refuse


def symbolic_step(B: Backend, name: str, s: OState, fn: TransitionFn | None = None) -> Step:
    """``name`` (or ``fn`` in its place) from ``s`` with fresh inputs and choices."""
    inputs, choices = SIGNATURES[name]

    def make(pname: str, kind: str) -> Any:
        if kind == "keyset":
            return B.array(pname, "key", "bool")
        return B.scalar(pname, "int")

    ins = {pname: make(pname, kind) for pname, kind in inputs}
    chs = {pname: make(pname, kind) for pname, kind in choices}
    st = (fn or TRANSITIONS[name])(B, s, ins | chs)
    st.inputs, st.choices = ins, chs
    return st


# -- mutations: broken transitions, each breaking one obligation --------------------------------


def _evict_any_nonpositive(B: Backend, s: OState, prot: Any, v: Any) -> Any:
    return B.And(B.in_range("key", v), B.sel(s.res, v), B.sel(s.ref, v) <= 0, B.Not(B.sel(prot, v)))


def _evict_any_ready(B: Backend, s: OState, prot: Any, v: Any) -> Any:
    return B.And(B.in_range("key", v), B.sel(s.res, v), B.sel(s.ref, v) >= 0, B.Not(B.sel(prot, v)))


def _prepare_store_uncounted(B: Backend, s: OState, p: Params) -> Step:
    st = prepare_store(B, s, p)
    return replace(st, post=replace(st.post, nalloc=s.nalloc))


def _failed_store_keeps_slot(B: Backend, s: OState, p: Params) -> Step:
    return _complete_store(B, s, p, False, free_slot=False)


@dataclass(frozen=True)
class Mutation:
    name: str
    transition: str
    fn: TransitionFn
    breaks: str  # the obligation (property) it must break
    statement: str


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("complete-load-keeps-ref", "complete_load", _complete_load_with(0, 1), "refcounts",
             "complete_load does not decrement ref_cnt"),
    Mutation("evict-being-stored", "evict", _evict_with(_evict_any_nonpositive), "in-flight-resident",
             "eviction may take a key being stored (ref_cnt -1)"),
    Mutation("evict-ignores-loads", "evict", _evict_with(_evict_any_ready), "evict-safe",
             "eviction may take any ready key, loads in flight or not"),
    Mutation("failed-store-keeps-slot", "complete_store_fail", _failed_store_keeps_slot, "slots",
             "a failed store drops the key but does not put its slot on the free list"),
    Mutation("fresh-slot-not-counted", "prepare_store", _prepare_store_uncounted, "slots",
             "a fresh slot is taken without counting it in num_allocated"),
    Mutation("complete-load-refuses-last", "complete_load", _complete_load_with(1, 2), "no-refusal",
             "complete_load refuses the last load of a key (ref_cnt > 1 asked)"),
)


# -- initial state and invariants -------------------------------------------------------------


def init(B: Backend, s: OState) -> Any:
    """A new manager and driver: nothing resident, nothing in flight, no slot allocated."""
    return B.And(s.n >= 1, s.nalloc == 0,
                 B.forall("key", lambda k: B.And(B.Not(B.sel(s.res, k)), B.sel(s.loads, k) == 0,
                                                 B.Not(B.sel(s.stores, k)))),
                 B.forall("slot", lambda j: B.And(B.Not(B.sel(s.used, j)), B.Not(B.sel(s.free, j)))))


def wf(B: Backend, s: OState) -> Any:
    """The pool size: ``N >= 1`` (``num_chunks``; ``N <= M`` unrolled)."""
    if isinstance(B, Unrolled):
        return B.And(s.n >= 1, s.n <= B.M)
    return s.n >= 1


def refcounts(B: Backend, s: OState) -> Any:
    """(a) For every resident key: ``ref == -1`` iff the driver has its store in flight, and
    else ``ref`` equals its loads in flight; a key being stored has no load in flight; load
    counts are never negative."""
    def one(k: Any) -> Any:
        r, ld, st = B.sel(s.ref, k), B.sel(s.loads, k), B.sel(s.stores, k)
        return B.And(ld >= 0, B.Implies(B.sel(s.res, k), B.And(
            (r == STORING) == st, B.Implies(st, ld == 0), B.Implies(B.Not(st), r == ld))))
    return B.forall("key", one)


def in_flight_resident(B: Backend, s: OState) -> Any:
    """(b) A key with a load or a store in flight has a chunk."""
    return B.forall("key", lambda k: B.Implies(B.Or(B.sel(s.loads, k) > 0, B.sel(s.stores, k)), B.sel(s.res, k)))


def slots(B: Backend, s: OState) -> Any:
    """(c) ``0 <= num_allocated <= N``; a resident key's slot is below ``num_allocated`` and used by
    it (so resident keys have distinct slots); a used slot's owner is resident there; no slot is
    both used and free; the slots below ``num_allocated`` are each used or free (none leaked),
    and none at or above it is either."""
    per_key = B.forall("key", lambda k: B.Implies(B.sel(s.res, k), B.And(
        0 <= B.sel(s.slot, k), B.sel(s.slot, k) < s.nalloc, B.sel(s.used, B.sel(s.slot, k)),
        B.sel(s.owner, B.sel(s.slot, k)) == k)))

    def one(j: Any) -> Any:
        u, f, o = B.sel(s.used, j), B.sel(s.free, j), B.sel(s.owner, j)
        below = B.And(0 <= j, j < s.nalloc)
        return B.And(B.Not(B.And(u, f)), B.Implies(u, B.And(B.in_range("key", o), B.sel(s.res, o),
                                                              B.sel(s.slot, o) == j)),
                     below == B.Or(u, f))
    return B.And(0 <= s.nalloc, s.nalloc <= s.n, per_key, B.forall("slot", one))


PROPERTIES: dict[str, Callable[[Backend, OState], Any]] = {
    "refcounts": refcounts,
    "in-flight-resident": in_flight_resident,
    "slots": slots,
}


def inv(B: Backend, s: OState, prop: str = "all") -> Any:
    """The inductive invariant for ``prop``: (a) and (b) need each other (an allocation needs a key
    without a chunk to have nothing in flight; an eviction needs ``ref == 0`` to mean no load);
    (c) is inductive alone; ``all`` is the three."""
    parts = [wf(B, s)]
    if prop in ("refcounts", "in-flight-resident", "evict-safe", "no-refusal", "all"):
        parts += [refcounts(B, s), in_flight_resident(B, s)]
    if prop in ("slots", "all"):
        parts.append(slots(B, s))
    return B.And(*parts)
