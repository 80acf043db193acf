"""A key-level, multi-request inductive invariant of the repair policy: C2 + C3 + I1.

Requests and keys are uninterpreted sorts, so every statement holds for *any number* of
requests sharing *any* keys (one KV group; positions are integers, every N). The state is
what ``RepairPolicy`` and the pools keep, by key:

| symbol | the model |
|--------|-----------|
| ``key(r, p)`` | the request's key at position p (chained hashes: one request's keys differ) |
| ``cur[r]``, ``active[r]`` | the cursor; the request has live, unfinished store state |
| ``owned[r, p]`` | its block at p carries ``key(r, p)`` and is referenced (``owned_block``) |
| ``cached[k]`` | ``k`` is in the CPU prefix map |
| ``cref[k]``, ``free[k]`` | the CPU ref count of k's block; the block is in the CPU free queue |
| ``nfl[k]`` | ``in_flight_keys[k]`` (transfers of k in flight) |
| ``lost[r, p]`` | a lost record ``(r, p)`` |
| ``reg[r, p]`` | the owner index lists ``(r, p)`` under ``key(r, p)`` |

The invariant ``inv``:

* **I1 (key level)**: a cached key's block is in the free queue iff its ref count is 0; ref
  counts are >= 0; an uncached key has no block in the queue;
* **C3's dedup**: ``0 <= nfl[k] <= 1`` and a key in flight is not cached (no key is stored
  twice at once, and never while the CPU holds it);
* **C2**: every owned position below an active cursor is cached, in flight, or lost;
* **owner index**: those positions are indexed; **records**: a record is held only by an
  active request, below its cursor.

Transitions, each for an arbitrary focal request ``r0`` among any number: ``evict`` (any set
of free cached keys; R1: *every* indexed owner below its cursor gets a record), ``plan`` (r0's
scan to a new cursor: each owned, uncached, not-in-flight position passed is stored and
indexed), ``repair`` (R8: one candidate per key, the representative record, re-stored only
when its key is uncovered; records no longer owned or covered dropped, others kept),
``complete``, ``pin`` (ref counts and the queue move together), ``schedule`` (ownership at and
after r0's cursor changes), ``sliding-free``, ``preempt``, ``finish``. C3 per step: the keys the
repair phase re-stores are pairwise distinct transfers (``nfl <= 1`` after) of lost, uncovered
keys, so re-stores <= distinct lost keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import z3

Req = z3.DeclareSort("Req")
Key = z3.IntSort()  # keys are opaque; integers only so that a concrete witness can name them
KEY = z3.Array("key", Req, z3.IntSort(), Key)
INV_POS = z3.Array("pos_of", Req, Key, z3.IntSort())  # inverse of key(r, .): chained hashes


@dataclass(frozen=True)
class KState:
    cur: Any  # Array(Req, Int)
    active: Any  # Array(Req, Bool)
    owned: Any  # Array(Req, Int, Bool)
    cached: Any  # Array(Key, Bool)
    cref: Any  # Array(Key, Int)
    free: Any  # Array(Key, Bool)
    nfl: Any  # Array(Key, Int)
    lost: Any  # Array(Req, Int, Bool)
    reg: Any  # Array(Req, Int, Bool)


def fresh(tag: str) -> KState:
    rp = (Req, z3.IntSort(), z3.BoolSort())
    return KState(z3.Array(f"{tag}.cur", Req, z3.IntSort()), z3.Array(f"{tag}.active", Req, z3.BoolSort()),
                  z3.Array(f"{tag}.owned", *rp), z3.Array(f"{tag}.cached", Key, z3.BoolSort()),
                  z3.Array(f"{tag}.cref", Key, z3.IntSort()), z3.Array(f"{tag}.free", Key, z3.BoolSort()),
                  z3.Array(f"{tag}.nfl", Key, z3.IntSort()), z3.Array(f"{tag}.lost", *rp),
                  z3.Array(f"{tag}.reg", *rp))


def chained() -> list[z3.BoolRef]:
    """One request's positions have distinct keys (``pos_of`` inverts ``key``)."""
    r, p = z3.Const("ax_r", Req), z3.Int("ax_p")
    return [z3.ForAll([r, p], INV_POS[r, KEY[r, p]] == p, patterns=[KEY[r, p]])]


def below(s: KState, r: Any, p: Any) -> z3.BoolRef:
    return z3.And(0 <= p, p < s.cur[r])


def covered(s: KState, k: Any) -> z3.BoolRef:
    return z3.Or(s.cached[k], s.nfl[k] > 0)


def i1(s: KState) -> z3.BoolRef:
    k = z3.Const("i1_k", Key)
    return z3.ForAll([k], z3.And(s.cref[k] >= 0, z3.Implies(s.cached[k], s.free[k] == (s.cref[k] == 0)),
                                 z3.Implies(z3.Not(s.cached[k]), z3.Not(s.free[k]))))


def dedup(s: KState) -> z3.BoolRef:
    k = z3.Const("dd_k", Key)
    return z3.ForAll([k], z3.And(0 <= s.nfl[k], s.nfl[k] <= 1, z3.Implies(s.nfl[k] > 0, z3.Not(s.cached[k]))))


def c2(s: KState) -> z3.BoolRef:
    r, p = z3.Const("c2_r", Req), z3.Int("c2_p")
    return z3.ForAll([r, p], z3.Implies(z3.And(s.active[r], below(s, r, p), s.owned[r, p]),
                                        z3.Or(covered(s, KEY[r, p]), s.lost[r, p])))


def indexed(s: KState) -> z3.BoolRef:
    r, p = z3.Const("ix_r", Req), z3.Int("ix_p")
    return z3.ForAll([r, p], z3.Implies(z3.And(s.active[r], below(s, r, p), s.owned[r, p]), s.reg[r, p]))


def records(s: KState) -> z3.BoolRef:
    r, p = z3.Const("rc_r", Req), z3.Int("rc_p")
    return z3.ForAll([r, p], z3.Implies(s.lost[r, p], z3.And(s.active[r], below(s, r, p))))


def cursors(s: KState) -> z3.BoolRef:
    r = z3.Const("cu_r", Req)
    return z3.ForAll([r], s.cur[r] >= 0)


INVARIANT: dict[str, Callable[[KState], z3.BoolRef]] = {
    "I1": i1, "C3-dedup": dedup, "C2": c2, "owner-index": indexed, "records": records, "cursors": cursors}


def inv(s: KState) -> z3.BoolRef:
    return z3.And([f(s) for f in INVARIANT.values()])


def init() -> tuple[KState, list[z3.BoolRef]]:
    """Nothing registered: no request active, nothing cached or in flight, no records."""
    s = fresh("init")
    r, p, k = z3.Const("in_r", Req), z3.Int("in_p"), z3.Const("in_k", Key)
    return s, [z3.ForAll([r], z3.And(z3.Not(s.active[r]), s.cur[r] == 0)),
               z3.ForAll([k], z3.And(z3.Not(s.cached[k]), z3.Not(s.free[k]), s.cref[k] == 0, s.nfl[k] == 0)),
               z3.ForAll([r, p], z3.And(z3.Not(s.lost[r, p]), z3.Not(s.reg[r, p])))]


@dataclass
class KStep:
    post: KState
    constraints: list[z3.BoolRef]
    restored: Any = None  # repair: Key -> Bool, the keys a transfer was launched for


def _rp(body: Callable[[Any, Any], z3.BoolRef]) -> Any:
    r, p = z3.Const("l_r", Req), z3.Int("l_p")
    return z3.Lambda([r, p], body(r, p))


def _k(body: Callable[[Any], Any]) -> Any:
    k = z3.Const("l_k", Key)
    return z3.Lambda([k], body(k))


def _req(body: Callable[[Any], Any]) -> Any:
    r = z3.Const("l_rq", Req)
    return z3.Lambda([r], body(r))


# When True, R1 gives a record only to one owner per key (the mutation the invariant must catch).
FIRST_OWNER_ONLY = False


def evict(s: KState, r0: Any) -> KStep:
    """A CPU allocation evicts free cached keys ``ev``; R1 records every indexed, owned position
    of an active request below its cursor whose key was evicted."""
    ev = z3.Array("ev", Key, z3.BoolSort())
    first = z3.Function("first_owner", Key, Req)
    k = z3.Const("ev_k", Key)
    cons = [z3.ForAll([k], z3.Implies(ev[k], z3.And(s.cached[k], s.free[k])))]

    def rec(r: Any, p: Any) -> z3.BoolRef:
        gets = z3.And(ev[KEY[r, p]], s.active[r], below(s, r, p), s.owned[r, p], s.reg[r, p])
        return z3.And(gets, first(KEY[r, p]) == r) if FIRST_OWNER_ONLY else gets

    post = replace(s, cached=_k(lambda k: z3.And(s.cached[k], z3.Not(ev[k]))),
                   free=_k(lambda k: z3.And(s.free[k], z3.Not(ev[k]))),
                   lost=_rp(lambda r, p: z3.Or(s.lost[r, p], rec(r, p))))
    return KStep(post, cons)


def plan(s: KState, r0: Any) -> KStep:
    """r0's scan moves its cursor to ``c2 >= cur``; each owned position passed whose key is
    neither cached nor in flight is stored (nfl + 1) and indexed (R2, R4)."""
    c2_ = z3.Int("plan_c2")

    def passed(p: Any) -> z3.BoolRef:
        return z3.And(s.cur[r0] <= p, p < c2_)

    def sel(k: Any) -> z3.BoolRef:
        p = INV_POS[r0, k]
        return z3.And(KEY[r0, p] == k, passed(p), s.owned[r0, p], z3.Not(covered(s, k)))

    post = replace(s, cur=z3.Store(s.cur, r0, c2_),
                   nfl=_k(lambda k: s.nfl[k] + z3.If(sel(k), 1, 0)),
                   reg=_rp(lambda r, p: z3.Or(s.reg[r, p], z3.And(r == r0, passed(p), s.owned[r0, p]))))
    return KStep(post, [c2_ >= s.cur[r0], s.active[r0]])


def repair(s: KState, r0: Any) -> KStep:
    """R8 over every record: a record still owned and uncovered is *wanted*; per key, only the
    representative record ``rep(k)`` may be taken (the first in record order) and a transfer of
    the key is launched for it; its record is consumed. Wanted records not taken stay; the
    others are dropped."""
    rep_r, rep_p = z3.Function("rep_r", Key, Req), z3.Function("rep_p", Key, z3.IntSort())
    take = z3.Array("take", Req, z3.IntSort(), z3.BoolSort())
    r, p = z3.Const("rr_r", Req), z3.Int("rr_p")

    def wanted(r: Any, p: Any) -> z3.BoolRef:
        return z3.And(s.lost[r, p], s.active[r], below(s, r, p), s.owned[r, p], z3.Not(covered(s, KEY[r, p])))

    cons = [z3.ForAll([r, p], z3.Implies(take[r, p], z3.And(wanted(r, p), rep_r(KEY[r, p]) == r,
                                                            rep_p(KEY[r, p]) == p)))]

    def restored(k: Any) -> z3.BoolRef:
        return z3.And(take[rep_r(k), rep_p(k)], KEY[rep_r(k), rep_p(k)] == k)

    post = replace(s, nfl=_k(lambda k: s.nfl[k] + z3.If(restored(k), 1, 0)),
                   lost=_rp(lambda r, p: z3.And(wanted(r, p), z3.Not(take[r, p]))))
    return KStep(post, cons, restored=_k(restored))


def complete(s: KState, r0: Any) -> KStep:
    """Transfers land: a key with one in flight (``done``) is cached, its block free (ref 0)."""
    done = z3.Array("done", Key, z3.BoolSort())
    k = z3.Const("cm_k", Key)
    return KStep(replace(s, nfl=_k(lambda k: s.nfl[k] - z3.If(done[k], 1, 0)),
                         cached=_k(lambda k: z3.Or(s.cached[k], done[k])),
                         cref=_k(lambda k: z3.If(done[k], 0, s.cref[k])),
                         free=_k(lambda k: z3.Or(s.free[k], done[k]))),
                 [z3.ForAll([k], z3.Implies(done[k], s.nfl[k] > 0))])


def pin(s: KState, r0: Any) -> KStep:
    """Pins, loads and their release change cached keys' ref counts; the queue follows (R5)."""
    cref2 = z3.Array("cref2", Key, z3.IntSort())
    k = z3.Const("pn_k", Key)
    return KStep(replace(s, cref=cref2, free=_k(lambda k: z3.And(s.cached[k], cref2[k] == 0))),
                 [z3.ForAll([k], z3.And(cref2[k] >= 0, z3.Implies(z3.Not(s.cached[k]), cref2[k] == s.cref[k])))])


def schedule(s: KState, r0: Any) -> KStep:
    """A GPU step for r0: ownership at and after its cursor may change."""
    own = z3.Array("own2", Req, z3.IntSort(), z3.BoolSort())
    r, p = z3.Const("sc_r", Req), z3.Int("sc_p")
    return KStep(replace(s, owned=own),
                 [z3.ForAll([r, p], z3.Implies(z3.Or(r != r0, p < s.cur[r]), own[r, p] == s.owned[r, p]))])


def register(s: KState, r0: Any) -> KStep:
    """A new request r0 (never active before, ids never reused): cursor 0, nothing owned or indexed."""
    return KStep(replace(s, active=z3.Store(s.active, r0, z3.BoolVal(True)), cur=z3.Store(s.cur, r0, z3.IntVal(0)),
                         owned=_rp(lambda r, p: z3.And(s.owned[r, p], r != r0)),
                         reg=_rp(lambda r, p: z3.And(s.reg[r, p], r != r0)),
                         lost=_rp(lambda r, p: z3.And(s.lost[r, p], r != r0))), [z3.Not(s.active[r0])])


def sliding_free(s: KState, r0: Any) -> KStep:
    """Positions of r0 below a window edge stop being owned."""
    edge = z3.Int("edge")
    return KStep(replace(s, owned=_rp(lambda r, p: z3.And(s.owned[r, p], z3.Or(r != r0, p >= edge)))), [])


def preempt(s: KState, r0: Any) -> KStep:
    """r0 preempted: nothing owned, cursor 0, its records dropped."""
    return KStep(replace(s, cur=z3.Store(s.cur, r0, z3.IntVal(0)),
                         owned=_rp(lambda r, p: z3.And(s.owned[r, p], r != r0)),
                         lost=_rp(lambda r, p: z3.And(s.lost[r, p], r != r0))), [])


def finish(s: KState, r0: Any) -> KStep:
    """r0 finishes: no longer active, its records dropped (stale index entries may stay)."""
    return KStep(replace(s, active=z3.Store(s.active, r0, z3.BoolVal(False)),
                         lost=_rp(lambda r, p: z3.And(s.lost[r, p], r != r0))), [])


TRANSITIONS: dict[str, Callable[[KState, Any], KStep]] = {
    "evict": evict, "plan": plan, "repair": repair, "complete": complete, "pin": pin, "schedule": schedule,
    "register": register, "sliding-free": sliding_free, "preempt": preempt, "finish": finish}


def c3_goal(s: KState, st: KStep) -> z3.BoolRef:
    """C3 for one repair phase: each re-stored key is one transfer (nfl <= 1 after) of a key that
    was lost (some record of it) and uncovered before."""
    k, r, p = z3.Const("c3_k", Key), z3.Const("c3_r", Req), z3.Int("c3_p")
    lost_key = z3.Exists([r, p], z3.And(s.lost[r, p], KEY[r, p] == k))
    return z3.ForAll([k], z3.Implies(st.restored[k], z3.And(lost_key, z3.Not(covered(s, k)), st.post.nfl[k] == 1)))


def shared_key_state(s: KState, idle: Any = None) -> list[z3.BoolRef]:
    """A concrete instance for the non-vacuity half of a check (model-based instantiation alone
    gives up on these formulas): every request has key p at position p (so every key is shared
    by all requests), is active with cursor 1 and owns and has indexed position 0; key 0 is
    cached, free and unpinned; nothing in flight, no records. A step's own choices stay free.
    ``idle``: one request that is not active (yet)."""
    r, p, k = z3.Const("w_r", Req), z3.Int("w_p"), z3.Int("w_k")
    a, b = z3.Const("wA", Req), z3.Const("wB", Req)
    return [a != b, KEY == z3.Lambda([r, p], p), INV_POS == z3.Lambda([r, k], k),
            s.active == z3.Lambda([r], z3.BoolVal(True) if idle is None else r != idle),
            s.cur == z3.Lambda([r], z3.IntVal(1)),
            s.owned == z3.Lambda([r, p], p == 0), s.reg == z3.Lambda([r, p], p == 0),
            s.lost == z3.Lambda([r, p], z3.BoolVal(False)),
            s.cached == z3.Lambda([k], k == 0), s.free == z3.Lambda([k], k == 0),
            s.cref == z3.Lambda([k], z3.IntVal(0)), s.nfl == z3.Lambda([k], z3.IntVal(0))]


Valid = Callable[[list[z3.BoolRef], z3.BoolRef, list[z3.BoolRef] | None], tuple[str, str]]


def inductive(valid: Valid) -> list[tuple[str, str, str]]:
    """``init => inv`` and, for each transition of an arbitrary request r0, ``inv and step => inv'``."""
    s, cons = init()
    r, p = z3.Const("w_r", Req), z3.Int("w_p")
    concrete = [KEY == z3.Lambda([r, p], p), INV_POS == z3.Lambda([r, p], p),
                s.active == z3.K(Req, z3.BoolVal(False)), s.cur == z3.K(Req, z3.IntVal(0)),
                s.cached == z3.K(Key, z3.BoolVal(False)), s.free == z3.K(Key, z3.BoolVal(False)),
                s.cref == z3.K(Key, z3.IntVal(0)), s.nfl == z3.K(Key, z3.IntVal(0)),
                s.lost == z3.Lambda([r, p], z3.BoolVal(False)), s.reg == z3.Lambda([r, p], z3.BoolVal(False)),
                s.owned == z3.Lambda([r, p], z3.BoolVal(False))]
    out = [("init", *valid([*chained(), *cons], inv(s), concrete))]
    for name, fn in TRANSITIONS.items():
        s, r0 = fresh("s"), z3.Const("r0", Req)
        st = fn(s, r0)
        wit = shared_key_state(s, r0 if name == "register" else None)
        out.append((name, *valid([*chained(), inv(s), *st.constraints], inv(st.post), wit)))
    return out


def c3(valid: Valid) -> list[tuple[str, str, str]]:
    s, r0 = fresh("s"), z3.Const("r0", Req)
    st = repair(s, r0)
    return [("repair", *valid([*chained(), inv(s), *st.constraints], c3_goal(s, st), shared_key_state(s)))]
