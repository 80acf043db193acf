"""Refinement: every operation of the executable model is a run of the Z3 transition system.

Two halves.

* **The abstraction function** ``abstract_snapshot(snapshot)`` maps an engine snapshot
  (``Engine.snapshot()``: pools, scheduler and engine sections) to one abstract focal state
  per request, in the terms of ``encoding.py`` (PROOFS.md, "Refinement", has the table).
  Per group: ``N`` is the length of the connector's id list, ``cur`` its cursor; per
  position ``p < N`` of that list, with ``b`` its id and ``own`` the request's key
  ``(block_hashes[p], g)``:

  - ``hashed``: the scan's source block (``b``, or for a null id the GPU prefix cache's
    block for ``own``: vLLM's null recovery) exists and carries a key;
  - ``owned``: ``b`` is not null, carries ``own``, has GPU ref count >= 1, and ``p`` is in
    the sliding window (``RepairPolicy.owned_block``, the spec's definition: the
    connector's ids and the ref count, not the engine's live table);
  - ``kept`` (repair): not owned, and a retained copy exists: ``b`` if it carries ``own``,
    else the GPU prefix cache's first block for ``own``, with GPU ref count 0
    (``RepairPolicy.retained_block``); such a position is ``hashed`` and its key is ``own``;
  - the position's *key* is the source block's key when it has one, else ``own``;
    ``cached``: the key is in the CPU prefix map; ``cfree``: the first CPU block the map
    lists for it (the one the scan pins) is in the CPU free queue;
  - ``infl``: repair, the key is in ``in_flight_keys``; baseline and signal-rescan, the
    source block is in the in-flight GPU set;
  - ``lost``: repair holds the record ``(request, group, p)``;
  - ``reg``: repair's owner index, which the snapshot does not show: a ghost, free in both
    states, constrained in the before state by the proved invariant ``registered``.

  ``conf`` is (computed tokens - output placeholders) // block size, ``flag`` the
  signal-rescan eviction flag (False for the other policies), ``active`` "unfinished store
  state". Positions at or after ``N`` are unobserved except ``lost``; a request without
  active store state shows only ``active`` and ``lost``.

* **The check** ``check_step(before, after, op, policy)``: for every request, the pair
  (abstract before, abstract after) must be admitted by the operation's *template*, a fixed
  sequence of transitions of ``transitions.py`` (one engine operation is several abstract
  transitions: a step preempts, schedules, lets other requests evict and store, plans,
  repairs...), every intermediate state symbolic, on the ``Unrolled`` encoding with ``M`` the
  state's size. A request registered by the operation starts from the registration state;
  one whose store state ends must end by ``finish`` or ``reset``. Where a position's
  identity (source block and key) changed between the two snapshots, its ``cached``,
  ``cfree`` and ``infl`` after the operation are unobserved: no transition re-keys a
  position. Each template is built once per shape and kept; a check passes the observed
  values as assumptions to the solver (fixed seed, rlimit per check). Cost: O(requests x M x
  G) literals per operation plus one solver call per request (PROOFS.md has the measured
  milliseconds per step).

``refinement_check(before, after, op, config)`` is the entry point for a run loop.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import z3

from kvspec.contract.config import OffloadConfig
from kvspec.model.rules import window_floor
from kvspec.specs.encoding import ARRAYS, State, Unrolled, check_sat
from kvspec.specs.transitions import TRANSITIONS, init, registered, replace_flag

SEED = 7
RLIMIT = 5_000_000
POSITION_QUANTUM = 4  # M is rounded up to a multiple of this, so few template shapes are built
FINISHED = "finished"
ADMITTED_FROM = ("waiting", "preempted")
ADMITTED_TO = ("running", "waiting_for_remote_kvs")
RE_KEYED = ("cached", "cfree", "infl")  # the bits that follow a position's key


# -- the abstraction -------------------------------------------------------------------------


Bit = bool | None  # None: not observed


REFINEMENT_ID = "R1"  # how a refinement failure is named in findings and traces

@dataclass(frozen=True)
class AbstractGroup:
    """One group of one request: N, cursor, per array one bit per position (None: unobserved),
    and per position its identity (source block and key, or key alone for repair)."""

    n: int | None
    cur: int | None
    bits: Mapping[str, tuple[Bit, ...]]
    ident: tuple[Any, ...] = ()

    def render(self) -> dict[str, Any]:
        """Readable form: arrays as strings of 1, 0 and ? (unobserved)."""
        def text(bits: tuple[Bit, ...]) -> str:
            return "".join("?" if b is None else "1" if b else "0" for b in bits)

        return {"N": self.n, "cur": self.cur, **{a: text(self.bits[a]) for a in ARRAYS if a in self.bits}}


@dataclass(frozen=True)
class AbstractRequest:
    rid: str
    status: str | None  # the engine's status; None when the engine no longer shows it
    active: bool
    conf: int | None
    flag: bool
    groups: tuple[AbstractGroup, ...]

    def size(self) -> int:
        """Positions this state needs: its lengths and its lost records."""
        out = [g.n or 0 for g in self.groups]
        out += [max((p + 1 for p, b in enumerate(g.bits.get("lost", ())) if b), default=0) for g in self.groups]
        return max(out, default=0)

    def render(self) -> dict[str, Any]:
        return {"active": self.active, "conf": self.conf, "flag": self.flag,
                "groups": [g.render() for g in self.groups]}


@dataclass(frozen=True)
class _View:
    """A snapshot's sections, indexed once. O(pool sizes + records)."""

    policy: str
    block_size: int
    groups: tuple[tuple[str, int], ...]  # (kind, sliding window) per group
    gpu_hash: Sequence[str | None]
    gpu_ref: Sequence[int]
    gpu_cached: Mapping[str, Sequence[int]]
    cpu_cached: Mapping[str, Sequence[int]]
    cpu_free: frozenset[int]
    in_flight: frozenset[int]
    in_flight_keys: frozenset[str]
    lost: frozenset[tuple[str, int, int]]
    flag: bool

    @staticmethod
    def of(snap: Mapping[str, Any]) -> _View:
        sched, cfg = snap["scheduler"], snap["engine"]["config"]
        ps = sched["policy_state"]
        return _View(
            policy=sched["policy"], block_size=cfg["block_size"],
            groups=tuple((g["kind"], g["sliding_window"]) for g in cfg["groups"]),
            gpu_hash=snap["gpu_pool"]["block_hash"], gpu_ref=snap["gpu_pool"]["ref_cnt"],
            gpu_cached=snap["gpu_pool"]["cached"], cpu_cached=snap["cpu_pool"]["cached"],
            cpu_free=frozenset(snap["cpu_pool"]["free_queue"]), in_flight=frozenset(sched["in_flight"]),
            in_flight_keys=frozenset(ps.get("in_flight_keys", ())),
            lost=frozenset((str(r), int(g), int(p)) for r, g, p in ps.get("lost", ())),
            flag=bool(ps.get("eviction_flag", False)))

    def floor(self, g: int, computed: int, placeholders: int) -> int:
        kind, window = self.groups[g]
        return window_floor(computed, placeholders, window, self.block_size) if kind == "sliding" else 0


def _source(view: _View, own: str | None, b: int) -> int | None:
    """The block the scan reads for an id: the id itself, or for a null id the GPU prefix
    cache's first block for the request's key (vLLM's null recovery); None if neither."""
    if b != 0:
        return b
    hit = view.gpu_cached.get(own) if own is not None else None
    return hit[0] if hit else None


def _retained(view: _View, own: str | None, b: int) -> bool:
    """Repair's retained copy exists: ``b`` if it carries ``own``, else the GPU prefix cache's
    first block for ``own``, has GPU ref count 0. O(1)."""
    if own is None:
        return False
    if b == 0 or view.gpu_hash[b] != own:
        hit = view.gpu_cached.get(own)
        if not hit:
            return False
        b = hit[0]
    return bool(view.gpu_ref[b] == 0)


def _position(view: _View, req: Mapping[str, Any], g: int, p: int, b: int) -> tuple[dict[str, bool], Any]:
    """The seven observed bits of position ``p`` (id ``b``) of group ``g``, and its identity. O(1)."""
    hashes = req["block_hashes"]
    own = f"{hashes[p]}:{g}" if p < len(hashes) else None
    src = _source(view, own, b)
    src_key = view.gpu_hash[src] if src is not None else None
    owned = (b != 0 and own is not None and view.gpu_hash[b] == own and view.gpu_ref[b] >= 1
             and p >= view.floor(g, req["num_computed_tokens"], req["num_output_placeholders"]))
    kept = view.policy == "repair" and not owned and _retained(view, own, b)
    key = own if kept else (src_key if src_key is not None else own)
    copies = view.cpu_cached.get(key) if key is not None else None
    bits = {
        "hashed": kept or src_key is not None,
        "owned": owned,
        "kept": kept,
        "cached": copies is not None,
        "cfree": copies is not None and copies[0] in view.cpu_free,
        "infl": (key in view.in_flight_keys) if view.policy == "repair" else (src in view.in_flight),
        "lost": False,
    }
    return bits, (key if view.policy == "repair" else (src, key))


def _lost_row(view: _View, rid: str, g: int, width: int) -> tuple[bool, ...]:
    return tuple((rid, g, p) in view.lost for p in range(width))


def _group(view: _View, rid: str, req: Mapping[str, Any] | None, st: Mapping[str, Any] | None,
           active: bool, g: int) -> AbstractGroup:
    """One group's abstract values; positions beyond N observe only the lost records."""
    width = 1 + max([p for r, gg, p in view.lost if r == rid and gg == g], default=-1)
    if not active or req is None or st is None:
        return AbstractGroup(None, None, {"lost": _lost_row(view, rid, g, width)})
    ids = st["block_ids"][g]
    cols: dict[str, list[Bit]] = {a: [] for a in ARRAYS}
    ident: list[Any] = []
    for p, b in enumerate(ids):
        bits, who = _position(view, req, g, p, b)
        for a, v in bits.items():
            cols[a].append(v)
        cols["reg"].append(None)
        ident.append(who)
    lost = _lost_row(view, rid, g, max(width, len(ids)))
    cols["lost"] = list(lost)
    return AbstractGroup(len(ids), st["num_stored_blocks"][g], {a: tuple(v) for a, v in cols.items()},
                         tuple(ident))


def abstract_request(view: _View, snap: Mapping[str, Any], rid: str) -> AbstractRequest:
    req = snap["engine"]["requests"].get(rid)
    st = snap["scheduler"]["reqs_to_store"].get(rid)
    status = None if req is None else req["status"]
    active = st is not None and not st["finished"] and req is not None and status != FINISHED
    conf = None
    if active and req is not None:
        conf = max(0, req["num_computed_tokens"] - req["num_output_placeholders"]) // view.block_size
    groups = tuple(_group(view, rid, req, st, active, g) for g in range(len(view.groups)))
    return AbstractRequest(rid, status, active, conf, view.flag if view.policy == "signal-rescan" else False,
                           groups)


def abstract_snapshot(snap: Mapping[str, Any]) -> dict[str, AbstractRequest]:
    """The abstraction function: one abstract focal state per request the snapshot names
    (engine requests and store states). O(requests x positions + pool sizes)."""
    view = _View.of(snap)
    rids = set(snap["engine"]["requests"]) | set(snap["scheduler"]["reqs_to_store"])
    rids |= {r for r, _, _ in view.lost}
    return {rid: abstract_request(view, snap, rid) for rid in sorted(rids)}


# -- templates: which transitions one engine operation is ----------------------------------


# the environment before the focal scan: pins released (a finished load's), then allocations
# evicting the copies so freed, then other stores and pins
PLAN_STEP = ("sliding-free", "schedule", "env-store", "evict", "env-store", "plan", "evict", "env-store")
# signal-rescan reads its flag once per build, before the allocations of the requests scanned
# ahead of the focal one: the plan split in two around them (``consume`` ... ``scan-latched``)
LATCHED_PLAN_STEP = ("sliding-free", "schedule", "consume", "env-store", "evict", "env-store", "scan-latched",
                     "evict", "env-store")
REPAIR_STEP = ("repair-phase", "evict", "env-store")
AFTER_STEP = ("schedule", "sliding-free")  # computed tokens advance after the planning step
FLUSH = ("evict", "env-store", "evict", "env-store")  # a finish flush: CPU allocations, stores
REGISTER = "register"  # update_state_after_alloc: not a transition of transitions.py, see registration()


@dataclass(frozen=True)
class Template:
    """A sequence of transition names; ``REGISTER`` first means "start from registration"."""

    slots: tuple[str, ...]

    @property
    def fresh(self) -> bool:
        return bool(self.slots) and self.slots[0] == REGISTER

    @property
    def steps(self) -> tuple[str, ...]:
        return self.slots[1:] if self.fresh else self.slots


def _step_template(policy: str, op: Mapping[str, Any], rid: str, pre: AbstractRequest,
                   post: AbstractRequest, stops: int) -> tuple[str, ...]:
    """A step: preemption (named by the operation, or the scheduler's own when an allocation
    fails), admission (full table) or a loaded request's full table, the schedule, others'
    evictions and stores around the focal request's plan, repair's phase, then the computed
    tokens advance. Under async scheduling the step then processes the batch before it: tokens
    are confirmed (a schedule), and each of the ``stops`` requests that reached ``max_tokens``
    finishes there, its finish flush evicting and storing as a ``finish`` operation's does (the
    focal request's own ``finish`` last, when it is one of them)."""
    preempted = rid in (op.get("preempt") or ()) or (pre.status == "running" and post.status == "preempted")
    admitted = rid in (op.get("admit") or ()) and post.status in ADMITTED_TO and (
        preempted or pre.status in ADMITTED_FROM or pre.status is None)
    head: list[str] = []
    if not pre.active:
        head.append(REGISTER)
    if preempted:
        head.append("preempt")
    if admitted:
        head.append("resume")
    elif pre.status == "loaded":
        head.append("loaded-full-table")
    tail: tuple[str, ...] = ()
    if stops:
        stopped = pre.active and not post.active and post.status in (FINISHED, None)
        tail = ("schedule", *FLUSH * stops, *(("finish",) if stopped else ()))
    plan = LATCHED_PLAN_STEP if policy == "signal-rescan" else PLAN_STEP
    return (*head, *plan, *(REPAIR_STEP if policy == "repair" else ()), *AFTER_STEP, *tail)


def template(policy: str, op: Mapping[str, Any], rid: str, pre: AbstractRequest,
             post: AbstractRequest, stops: int = 0) -> Template | None:
    """The transitions operation ``op`` may be for request ``rid``; None when neither state is
    active (nothing to check). Only ``finish`` (of that request), a step that stopped it at
    ``max_tokens`` (async scheduling; ``stops`` requests stopped in the step) and ``reset`` end
    store state; ``check_request`` rejects any other template whose pair does (``ENDED``)."""
    name = op.get("op")
    if not pre.active and not post.active:
        return None
    if name == "step":
        return Template(_step_template(policy, op, rid, pre, post, stops))
    slots: tuple[str, ...]
    if name == "finish":  # the finish flush allocates (evicts) and stores, the finishing request's too
        slots = (*FLUSH, "finish") if op.get("rid") == rid else FLUSH
    elif name == "reset":
        slots = ("reset", "finish")
    elif name == "report":
        slots = ("env-store", "complete")
    elif name == "load_done":
        slots = ("env-store",)
    else:  # add, and any operation the target was not called for
        slots = ()
    if not pre.active:
        slots = (REGISTER, *slots)
    return Template(slots)


# -- the composition, built once per shape ------------------------------------------------


def registration(enc: Unrolled, policy: str, s: State) -> z3.BoolRef:
    """``update_state_after_alloc`` registering a request: ``transitions.init`` (no ids,
    cursors 0, no records, no owner index, active) without its flag clause, since the flag is
    pool-wide and may be set when another request registers."""
    return init(enc, policy, replace_flag(s, z3.BoolVal(False)))


@dataclass
class _Chain:
    """A template composed over symbolic states: ``pre`` -> ... -> ``post``, in a solver.

    Observations are *literals*: one Boolean tracker per (state, term, value), defined once in
    the solver (``tracker == (term == value)``), so a check is one ``check(assumptions)`` call
    whose unsat core names the conflicting observations. O(1) per literal after the first."""

    enc: Unrolled
    pre: State
    post: State
    solver: z3.Solver
    literals: dict[tuple[str, Any], z3.BoolRef] = field(default_factory=dict)

    def literal(self, label: str, term: z3.ExprRef, value: bool | int) -> z3.BoolRef:
        """The assumption "``term`` (named ``label``) has ``value``"."""
        key = (label, value)
        lit = self.literals.get(key)
        if lit is None:
            if isinstance(value, bool):
                base = self.literals.get((label, not value))
                if base is not None:  # the other polarity exists: its negation
                    lit = self.literals[key] = z3.Not(base)
                    return lit
            lit = z3.Bool(f"{label}={value}")
            self.solver.add(lit == (term == value))
            self.literals[key] = lit
        return lit


def _solver() -> z3.Solver:
    s = z3.SolverFor("QF_LIA")
    s.set("random_seed", SEED)
    s.set("rlimit", RLIMIT)
    return s


@functools.lru_cache(maxsize=256)
def chain(policy: str, slots: tuple[str, ...], kinds: tuple[str, ...], M: int) -> _Chain:
    """Compose ``slots`` (a ``Template``'s) for ``policy`` on ``Unrolled(len(kinds), M)``: the
    intermediate states are the transitions' own (fresh variables where they choose), so the
    solver looks for any run through them. Full-attention groups have no sliding-window edge.
    O(len(slots) x M x groups) terms, built once per argument tuple."""
    tpl = Template(slots)
    enc = Unrolled(len(kinds), M)
    pre = enc.state("pre")
    sv = _solver()
    sv.add(enc.wf(pre))
    sv.add(*([registration(enc, policy, pre)] if tpl.fresh else []))
    if policy == "repair" and not tpl.fresh:
        sv.add(registered(enc, pre))  # the ghost owner index satisfies the proved invariant
    s = pre
    read = None  # the flag the build read (``consume``), which ``scan-latched`` decides by
    for name in tpl.steps:
        fn, pols = TRANSITIONS[name]
        assert policy in pols, f"{name} is not a {policy} transition"
        if name == "consume":
            read = s.flag
        st = fn(enc, policy, s)
        sv.add(*st.constraints, *(st.inputs[f"edge{g}"] <= 0 for g, k in enumerate(kinds)
                                  if name == "sliding-free" and k != "sliding"))
        if name == "scan-latched":
            assert read is not None, "scan-latched without the consume that starts its build"
            sv.add(st.inputs["rescan"] == read)
        s = st.post
    return _Chain(enc, pre, s, sv)


# -- observations -------------------------------------------------------------------------


class Observation(NamedTuple):
    """One observed value of one abstract state, as a solver assumption."""

    label: str
    group: int | None  # None: a request-wide value (active, conf, flag)
    literal: z3.BoolRef  # an assumption: a tracker or its negation


def _observe_state(c: _Chain, s: State, a: AbstractRequest, tag: str,
                   skip: Mapping[int, set[int]] | None = None) -> list[Observation]:
    """Assumptions pinning the symbolic state ``s`` to the observed values of ``a``; ``skip``
    lists, per group, positions whose re-keyed bits are left free."""
    out = [Observation(f"{tag}.active", None, c.literal(f"{tag}.active", s.active, a.active)),
           Observation(f"{tag}.flag", None, c.literal(f"{tag}.flag", s.flag, a.flag))]
    if a.conf is not None:
        out.append(Observation(f"{tag}.conf", None, c.literal(f"{tag}.conf", s.conf, a.conf)))
    for g, ag in enumerate(a.groups):
        grp = s.groups[g]
        for label, term, value in ((f"{tag}.g{g}.N", grp.n, ag.n), (f"{tag}.g{g}.cur", grp.cur, ag.cur)):
            if value is not None:
                out.append(Observation(label, g, c.literal(label, term, value)))
        free = (skip or {}).get(g, set())
        for name, row in ag.bits.items():
            for p, bit in enumerate(row[: c.enc.M]):
                if bit is None or (name in RE_KEYED and p in free):
                    continue
                label = f"{tag}.g{g}.{name}[{p}]"
                out.append(Observation(label, g, c.literal(label, c.enc.v(s, g, name, p), bit)))
    return out


def _re_keyed(pre: AbstractRequest, post: AbstractRequest) -> dict[int, set[int]]:
    """Per group, positions present in both states whose identity changed."""
    out: dict[int, set[int]] = {}
    for g, (a, b) in enumerate(zip(pre.groups, post.groups, strict=True)):
        out[g] = {p for p, (x, y) in enumerate(zip(a.ident, b.ident, strict=False)) if x != y}
    return out


def observations(c: _Chain, fresh: bool, pre: AbstractRequest, post: AbstractRequest) -> list[Observation]:
    """What the two snapshots fix: the before state (only the flag when the request registers
    in this operation) and the after state (re-keyed positions excepted)."""
    out = [Observation("pre.flag", None, c.literal("pre.flag", c.pre.flag, pre.flag))] if fresh else \
        _observe_state(c, c.pre, pre, "pre")
    return out + _observe_state(c, c.post, post, "post", None if fresh else _re_keyed(pre, post))


# -- the check ------------------------------------------------------------------------------


REJECTED, UNKNOWN, ENDED = "rejected", "unknown", "ended without finish"


@dataclass(frozen=True)
class Rejection:
    """A (before, after) pair of one request that the template does not admit."""

    rid: str
    op_index: int | None
    op: str
    verdict: str  # REJECTED, UNKNOWN or ENDED
    group: int | None  # the group that alone conflicts; None: only the groups together do
    template: tuple[str, ...]
    before: dict[str, Any]
    after: dict[str, Any]
    conflict: tuple[str, ...] = ()  # observations that cannot all hold (an unsat core)

    def __str__(self) -> str:
        where = f"op {self.op_index} ({self.op})" if self.op_index is not None else self.op
        grp = "" if self.group is None else f", group {self.group}"
        return (f"refinement: {where}, request {self.rid}{grp}: {self.verdict} by "
                f"{' ; '.join(self.template) or 'no transition'}; conflict {', '.join(self.conflict[:8])}; "
                f"before {self.before}; after {self.after}")


@dataclass
class StepCheck:
    """The verdict on one operation: every request checked, the rejections, the time taken."""

    checked: int = 0
    rejections: list[Rejection] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.rejections


def _size(pre: AbstractRequest, post: AbstractRequest) -> int:
    m = max(pre.size(), post.size(), 1)
    return -(-m // POSITION_QUANTUM) * POSITION_QUANTUM


def _solve(c: _Chain, obs: Iterable[Observation]) -> z3.CheckSatResult:
    return check_sat(c.solver, *(o.literal for o in obs), threaded=False)  # once per fuzzed operation


def _diagnose(c: _Chain, obs: list[Observation], groups: int) -> tuple[int | None, tuple[str, ...]]:
    """The group whose observations alone conflict (None if none does), and the unsat core of
    the conflicting observations (by label)."""
    culprit = None
    for g in range(groups):
        mine = [o for o in obs if o.group in (None, g)]
        if _solve(c, mine) == z3.unsat:
            culprit, obs = g, mine
            break
    if _solve(c, obs) != z3.unsat:
        return culprit, ()
    label = {o.literal.get_id(): o.label for o in obs}
    return culprit, tuple(sorted(label[lit.get_id()] for lit in c.solver.unsat_core()))


def check_request(policy: str, kinds: tuple[str, ...], op: Mapping[str, Any], rid: str,
                  pre: AbstractRequest, post: AbstractRequest, op_index: int | None = None, stops: int = 0
                  ) -> Rejection | None:
    """Check one request's pair against its template; None when admitted (or nothing to check)."""
    tpl = template(policy, op, rid, pre, post, stops)
    if tpl is None:
        return None
    name = str(op.get("op"))
    if pre.active and not post.active and not {"finish", "reset"} & set(tpl.slots):
        return Rejection(rid, op_index, name, ENDED, None, tpl.slots, pre.render(), post.render())
    c = chain(policy, tpl.slots, kinds, _size(pre, post))
    obs = observations(c, tpl.fresh, pre, post)
    verdict = _solve(c, obs)
    if verdict == z3.sat:
        return None
    group, core = _diagnose(c, obs, len(kinds)) if verdict == z3.unsat else (None, ())
    return Rejection(rid, op_index, name, REJECTED if verdict == z3.unsat else UNKNOWN, group, tpl.slots,
                     pre.render(), post.render(), core)


def check_step(before: Mapping[str, Any], after: Mapping[str, Any], op: Mapping[str, Any], policy: str,
               op_index: int | None = None) -> StepCheck:
    """Every request's (before, after) pair is admitted by the transitions ``op`` may be.
    ``before``/``after``: engine snapshots around one accepted operation. O(requests) solver
    calls on cached templates."""
    t0 = time.perf_counter()
    out = StepCheck()
    if before["scheduler"]["lazy"]:
        return out  # lazy offload keeps no per-request store state: nothing to abstract
    kinds = tuple(g["kind"] for g in before["engine"]["config"]["groups"])
    pre, post = abstract_snapshot(before), abstract_snapshot(after)
    absent = [_absent(len(kinds), snap, policy) for snap in (before, after)]
    stops = _stops(before, after) if op.get("op") == "step" else 0
    for rid in sorted(set(pre) | set(post)):
        a, b = pre.get(rid, absent[0]), post.get(rid, absent[1])
        if not a.active and not b.active:
            continue
        out.checked += 1
        bad = check_request(policy, kinds, op, rid, a, b, op_index, stops)
        if bad is not None:
            out.rejections.append(bad)
    out.seconds = time.perf_counter() - t0
    return out


def _stops(before: Mapping[str, Any], after: Mapping[str, Any]) -> int:
    """Requests a step finished by itself (async scheduling: stopped at ``max_tokens`` when the
    batch that sampled their last token was processed, a preempted one by its stale output):
    unfinished before, finished or gone after."""
    unfinished = {rid for rid, r in before["engine"]["requests"].items() if r["status"] != FINISHED}
    now = after["engine"]["requests"]
    return sum(1 for rid in unfinished if rid not in now or now[rid]["status"] == FINISHED)


def _absent(groups: int, snap: Mapping[str, Any], policy: str) -> AbstractRequest:
    """A request the snapshot does not name: inactive, only the pool-wide flag observed."""
    flag = policy == "signal-rescan" and bool(snap["scheduler"]["policy_state"].get("eviction_flag", False))
    return AbstractRequest("", None, False, None, flag, tuple(AbstractGroup(None, None, {}) for _ in range(groups)))


def refinement_check(before: Mapping[str, Any], after: Mapping[str, Any], op: Mapping[str, Any],
                     config: OffloadConfig, op_index: int | None = None) -> StepCheck:
    """The run loop's entry point: ``check_step`` under ``config``'s policy, for an operation the
    engine accepted (a rejected one leaves the state unchanged and is not an abstract step);
    ``before``/``after`` are ``Engine.snapshot()`` around it."""
    return check_step(before, after, op, config.policy, op_index)
