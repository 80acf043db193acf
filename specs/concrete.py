"""Concrete small states, on both sides of the abstraction.

``Pos`` is one position's abstract state; ``Small`` a whole focal request. From a
``Small`` state this module

* evaluates the Z3 planning scan (``scan_unrolled``: the unrolled encoding built over
  concrete values and simplified; ``scan_quantified``: the quantified encoding's unique
  successor, found by the solver and checked unique), and
* builds the real model (``build_model``): a policy scheduler with a tiny configuration
  (block size 1), GPU blocks hashed, owned, in flight as the state says, CPU copies
  cached and free or pinned, lost records and the owner index set, then runs
  ``build_connector_meta`` and reads back the cursor, the selected positions and the
  records (``model_plan``).

The tests compare the two; ``tests/test_spec_agreement.py`` says which states.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import z3

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.types import CachedRequestData, NewRequestData, SchedulerOutput
from kvspec.model import RepairPolicy, SignalRescanPolicy, make_scheduler
from kvspec.model.scheduler import OffloadScheduler, StoreState
from kvspec.specs.encoding import ARRAYS, Group, Quant, State, Unrolled, check_sat
from kvspec.specs.transitions import Step, evict, plan_scan, repair_phase


@dataclass(frozen=True)
class Pos:
    hashed: bool = False
    owned: bool = False
    cached: bool = False
    cfree: bool = False
    infl: bool = False
    lost: bool = False
    reg: bool = False
    kept: bool = False


# the position kinds the exhaustive tests enumerate (see tests/test_spec_agreement.py)
NULL = Pos()  # null id, nothing to recover
UNHASHED = Pos(owned=True)  # a block that carries no key yet
FOREIGN = Pos(hashed=True)  # a stale id: the block carries someone else's key
OWNED = Pos(hashed=True, owned=True)
OWNED_CACHED = Pos(hashed=True, owned=True, cached=True, cfree=True)
OWNED_INFL = Pos(hashed=True, owned=True, infl=True)
KEPT = Pos(hashed=True, kept=True)  # repair: a stale id, freed, still carrying the request's key
KEPT_CACHED = Pos(hashed=True, kept=True, cached=True, cfree=True)
KINDS = (NULL, UNHASHED, FOREIGN, OWNED, OWNED_CACHED, OWNED_INFL)


@dataclass
class Small:
    """One request: per group a list of positions and a cursor; confirmed blocks; the flag.

    ``spare`` is the number of free, unhashed CPU blocks; the CPU free count the scan
    reads is ``spare`` plus the cached copies that sit in the free queue."""

    groups: list[list[Pos]]
    cursors: list[int]
    conf: int
    spare: int
    flag: bool = False
    scheduled: bool = True
    active: bool = True

    @property
    def free(self) -> int:
        return self.spare + sum(1 for ps in self.groups for p in ps if p.hashed and p.cached and p.cfree)


@dataclass
class Outcome:
    cursors: list[int]
    selected: set[tuple[int, int]]  # (group, position) stored this step (scan, rescan, re-store)
    lost: set[tuple[int, int]] = field(default_factory=set)
    reg: set[tuple[int, int]] = field(default_factory=set)


# -- the Z3 side -------------------------------------------------------------------------------


def _concrete_state(st: Small) -> State:
    groups = []
    for g, ps in enumerate(st.groups):
        arr = {a: [z3.BoolVal(getattr(p, a)) for p in ps] for a in ARRAYS}
        groups.append(Group(z3.IntVal(len(ps)), z3.IntVal(st.cursors[g]), arr))
    return State(groups, z3.IntVal(st.conf), z3.BoolVal(st.flag), z3.BoolVal(st.active))


def _true(e: Any) -> bool:
    v = z3.simplify(e)
    assert z3.is_true(v) or z3.is_false(v), f"not concrete: {v}"
    return bool(z3.is_true(v))


@functools.lru_cache(maxsize=64)
def _unrolled_plan(policy: str, G: int, M: int) -> tuple[State, Any, Any, z3.ArithRef, int]:
    """The unrolled ``plan_scan`` built once over symbolic inputs, its outputs packed into one
    integer term: cell bits (selected, owner index, lost record) and then 8 bits per cursor."""
    enc = Unrolled(G, M)
    s = enc.state("e")
    step = plan_scan(enc, policy, s)
    assert step.scan is not None
    bits: list[z3.BoolRef] = []
    for g in range(G):
        for i in range(M):
            bits += [z3.Or(step.scan.sel[g](i), step.scan.rescan[g](i)), enc.v(step.post, g, "reg", i),
                     enc.v(step.post, g, "lost", i)]
    packed: z3.ArithRef = z3.IntVal(0)
    for j, b in enumerate(bits):
        packed = packed + z3.If(b, 1 << j, 0)
    for g, grp in enumerate(step.post.groups):
        packed = packed + grp.cur * (1 << (len(bits) + 8 * g))
    return s, step.inputs["free"], step.inputs["scheduled"], packed, len(bits)


def scan_unrolled(policy: str, st: Small) -> Outcome:
    """The planning step of the unrolled encoding (``plan_scan``) on ``st``: every variable of
    the symbolic term is substituted by its concrete value and the term simplified to a
    constant (one term per policy and shape, built once)."""
    M = max((len(ps) for ps in st.groups), default=0)
    assert all(len(ps) == M for ps in st.groups), "the unrolled evaluation wants equal lengths"
    G = len(st.groups)
    s, free, scheduled, packed, nbits = _unrolled_plan(policy, G, M)
    pairs: list[tuple[Any, Any]] = [(s.conf, z3.IntVal(st.conf)), (s.flag, z3.BoolVal(st.flag)),
                                    (s.active, z3.BoolVal(st.active)), (free, z3.IntVal(st.free)),
                                    (scheduled, z3.BoolVal(st.scheduled))]
    for g, ps in enumerate(st.groups):
        grp = s.groups[g]
        pairs += [(grp.n, z3.IntVal(M)), (grp.cur, z3.IntVal(st.cursors[g]))]
        for a in ARRAYS:
            pairs += [(grp.arr[a][i], z3.BoolVal(getattr(p, a))) for i, p in enumerate(ps)]
    value = z3.simplify(z3.substitute(packed, *pairs))
    assert z3.is_int_value(value), f"not concrete: {value}"
    v = value.as_long()
    out = Outcome([(v >> (nbits + 8 * g)) & 0xFF for g in range(G)], set())
    for g in range(G):
        for i in range(M):
            j = 3 * (g * M + i)
            for k, target in enumerate((out.selected, out.reg, out.lost)):
                if v >> (j + k) & 1:
                    target.add((g, i))
    return out


def _pin_quant(enc: Quant, s: State, st: Small) -> list[z3.BoolRef]:
    out = [s.conf == st.conf, s.flag == st.flag, s.active == st.active]
    for g, ps in enumerate(st.groups):
        grp = s.groups[g]
        out += [grp.n == len(ps), grp.cur == st.cursors[g]]
        for a in ARRAYS:
            out += [z3.Select(grp.arr[a], i) == z3.BoolVal(getattr(p, a)) for i, p in enumerate(ps)]
    return out


def scan_quantified(policy: str, st: Small) -> tuple[Outcome, bool]:
    """The quantified encoding's successor for ``st`` and whether it is the only one."""
    enc = Quant(len(st.groups))
    s = enc.state("c")
    step = plan_scan(enc, policy, s)
    assert step.scan is not None
    sv = z3.Solver()
    sv.set("random_seed", 7)
    sv.set("rlimit", 20_000_000)
    pins = _pin_quant(enc, s, st)
    sv.add(*pins, *step.constraints, step.inputs["free"] == st.free, step.inputs["scheduled"] == st.scheduled)
    span = range(-1, max((len(ps) for ps in st.groups), default=0) + 2)
    sv.add(*step.scan.ground(span))
    assert check_sat(sv) == z3.sat, "the quantified scan has no successor"
    m = sv.model()
    cursors = [m.eval(c, model_completion=True).as_long() for c in step.scan.cur]
    sel_terms = {(g, i): z3.Or(step.scan.sel[g](i), step.scan.rescan[g](i))
                 for g, ps in enumerate(st.groups) for i in range(len(ps))}
    selected = {k for k, t in sel_terms.items() if z3.is_true(m.eval(t, model_completion=True))}
    other = [c != v for c, v in zip(step.scan.cur, cursors, strict=True)]
    other += [t != z3.BoolVal(k in selected) for k, t in sel_terms.items()]
    sv.add(z3.Or(other) if other else z3.BoolVal(False))
    unique = check_sat(sv) == z3.unsat
    return Outcome(cursors, selected), unique


def _repair_solver(st: Small, room: bool, then_evict: bool = False
                   ) -> tuple[z3.Solver, Any, Any, list[tuple[int, int]]]:
    """The repair phase over concrete values; with ``then_evict``, followed by the eviction its
    own CPU allocation may cause (R7 may take a useless entry, whose owners get records)."""
    M = max((len(ps) for ps in st.groups), default=0)
    assert all(len(ps) == M for ps in st.groups)
    enc = Unrolled(len(st.groups), M)
    s = _concrete_state(st)
    step = repair_phase(enc, "repair", s)
    sv = z3.Solver()
    sv.set("random_seed", 7)
    sv.set("rlimit", 20_000_000)
    sv.add(*step.constraints, step.inputs["room"] == room)
    if then_evict:
        ev = evict(enc, "repair", step.post)
        sv.add(*ev.constraints)
        step = Step(ev.post, step.constraints + ev.constraints, restored=step.restored, inputs=step.inputs)
    cells = [(g, i) for g in range(enc.G) for i in range(M)]
    return sv, enc, step, cells


def repair_phase_z3(st: Small, room: bool) -> tuple[Outcome, bool]:
    """The repair phase's successor (re-stored positions, records) over concrete values, and
    whether it is the only one the relation admits."""
    sv, enc, step, cells = _repair_solver(st, room)
    assert check_sat(sv) == z3.sat, "the repair phase has no successor"
    m = sv.model()
    rest = {(g, i) for g, i in cells if z3.is_true(m.eval(step.restored[g](i), model_completion=True))}
    lost = {(g, i) for g, i in cells
            if z3.is_true(m.eval(enc.v(step.post, g, "lost", i), model_completion=True))}
    sv.add(z3.Or([step.restored[g](i) != z3.BoolVal((g, i) in rest) for g, i in cells]
                 + [enc.v(step.post, g, "lost", i) != z3.BoolVal((g, i) in lost) for g, i in cells]
                 + [z3.BoolVal(False)]))
    return Outcome(list(st.cursors), rest, lost=lost), check_sat(sv) == z3.unsat


def repair_phase_admits(st: Small, room: bool, out: Outcome) -> bool:
    """Does the Z3 relation "repair phase, then the eviction its allocation causes" admit
    ``out`` as a successor of ``st``?"""
    sv, enc, step, cells = _repair_solver(st, room, then_evict=True)
    for g, i in cells:
        sv.add(step.restored[g](i) == ((g, i) in out.selected))
        sv.add(enc.v(step.post, g, "lost", i) == ((g, i) in out.lost))
    return bool(check_sat(sv) == z3.sat)


# -- the model side ----------------------------------------------------------------------------


@dataclass
class _Req:
    request_id: str
    block_hashes: list[str]
    num_computed_tokens: int
    num_output_placeholders: int = 0
    skip_reading_prefix_cache: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) + 1


def build_model(policy: str, st: Small) -> tuple[OffloadScheduler, dict[int, tuple[int, int]]]:
    """A scheduler whose store state for request "R" is ``st`` (block size 1, full-attention
    groups). Returns it and the map GPU block id -> (group, position)."""
    G = len(st.groups)
    n_pos = sum(len(ps) for ps in st.groups)
    n_cached = sum(1 for ps in st.groups for p in ps if p.hashed and p.cached)
    cfg = OffloadConfig(block_size=1, num_gpu_blocks=n_pos + 2, num_cpu_blocks=1 + n_cached + st.spare + 1,
                        groups=tuple(KVGroup() for _ in range(G)), policy=policy)
    sched = make_scheduler(cfg)
    repair = sched.policy if isinstance(sched.policy, RepairPolicy) else None  # set exactly when policy == "repair"
    gpu, cpu = sched.gpu_pool, sched.cpu_pool
    length = max((len(ps) for ps in st.groups), default=0)
    hashes = [f"h{i}" for i in range(length)]
    req = _Req("R", hashes, st.conf)
    where: dict[int, tuple[int, int]] = {}
    ids: list[list[int]] = []
    cached_cpu: list[int] = []
    pinned_cpu: list[int] = []
    released: list[int] = []
    for g, ps in enumerate(st.groups):
        row = []
        for i, p in enumerate(ps):
            if not p.hashed and not p.owned:  # NULL
                row.append(0)
                continue
            b = gpu.get_new_blocks(1)[0]
            where[b] = (g, i)
            row.append(b)
            if not p.hashed:
                continue
            key = (hashes[i], g) if p.owned or p.kept else (f"x{g}.{i}", g)
            gpu.insert_block_hash(key, b)
            if p.kept:  # a retained copy: the block is freed below, still hashed
                released.append(b)
            if p.infl:
                sched.in_flight_store_gpu_blocks.add(b)
                if repair is not None:
                    repair.in_flight_keys[key] = 1
            if p.cached:
                c = cpu.get_new_blocks(1)[0]
                cpu.insert_block_hash(key, c)
                (cached_cpu if p.cfree else pinned_cpu).append(c)
            if repair is not None and p.owned:
                if p.reg:
                    repair.owners.setdefault(key, {})[("R", g, i)] = None
        ids.append(row)
    # one CPU block stays referenced (the pool's spare slot), the rest: cached copies, then spare free ones
    extra = cpu.get_new_blocks(1)
    spare = cpu.get_new_blocks(st.spare)
    cpu.free_blocks(spare)
    cpu.free_blocks(cached_cpu)
    del extra, pinned_cpu
    if repair is not None:
        for g, ps in enumerate(st.groups):
            for i, p in enumerate(ps):
                if p.lost:
                    repair.lost[("R", g, i)] = (hashes[i], g)
    gpu.free_blocks(released)
    if isinstance(sched.policy, SignalRescanPolicy):  # exactly when policy == "signal-rescan"
        sched.policy.eviction_flag = st.flag
    sched.reqs_to_store["R"] = StoreState(req, [list(r) for r in ids], list(st.cursors))
    assert cpu.get_num_free_blocks() == st.free
    return sched, where


def model_plan(policy: str, st: Small) -> Outcome:
    """Run the model's planning step (``build_connector_meta``) on ``st``; read the outcome."""
    sched, where = build_model(policy, st)
    out = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(req_ids=["R"], new_block_ids=[None]),
                          num_scheduled_tokens={"R": 1 if st.scheduled else 0})
    meta = sched.build_connector_meta(out)
    state = sched.reqs_to_store["R"]
    selected = {where[b] for b in meta.store_gpu_blocks}
    assert len(selected) == len(meta.store_gpu_blocks), "a position was selected twice"
    lost: set[tuple[int, int]] = set()
    reg: set[tuple[int, int]] = set()
    if isinstance(sched.policy, RepairPolicy):  # exactly when policy == "repair"
        lost = {(g, i) for (_, g, i) in sched.policy.lost}
        reg = {(g, i) for owners in sched.policy.owners.values() for (_, g, i) in owners}
    return Outcome(list(state.num_stored_blocks), selected, lost, reg)


# -- eviction ------------------------------------------------------------------------------------


@dataclass
class Evicted:
    cached: set[tuple[int, int]]  # positions whose key is still cached on CPU
    lost: set[tuple[int, int]]
    flag: bool


def model_evict(policy: str, st: Small, n: int) -> Evicted:
    """Allocate ``n`` CPU blocks through the scheduler's allocation path (``allocate_cpu``) on
    ``st``: the free queue is spare blocks first, then the cached copies in position order."""
    sched, _ = build_model(policy, st)
    sched.allocate_cpu(n)
    cells = [(g, i) for g, ps in enumerate(st.groups) for i, p in enumerate(ps) if p.hashed]
    length = max((len(ps) for ps in st.groups), default=0)
    hashes = [f"h{i}" for i in range(length)]

    def key(g: int, i: int) -> tuple[str, int]:
        return (hashes[i], g) if st.groups[g][i].owned else (f"x{g}.{i}", g)

    cached = {(g, i) for g, i in cells if sched.cpu_pool.get_one_block(key(g, i)) is not None}
    lost = {(g, i) for (_, g, i) in getattr(sched.policy, "lost", {})}
    return Evicted(cached, lost, bool(getattr(sched.policy, "eviction_flag", False)))


def evict_agrees(policy: str, st: Small, got: Evicted) -> tuple[bool, bool]:
    """(the Z3 eviction relation admits the model's successor, and given which keys left the
    CPU it forces exactly the model's records and flag)."""
    M = max((len(ps) for ps in st.groups), default=0)
    enc = Unrolled(len(st.groups), M)
    s = _concrete_state(st)
    step = evict(enc, policy, s)
    cells = [(g, i) for g in range(enc.G) for i in range(M)]
    sv = z3.Solver()
    sv.set("random_seed", 7)
    sv.set("rlimit", 20_000_000)
    sv.add(*step.constraints)
    sv.add(*[enc.v(step.post, g, "cached", i) == ((g, i) in got.cached) for g, i in cells])
    observed = [enc.v(step.post, g, "lost", i) == ((g, i) in got.lost) for g, i in cells]
    if policy == "signal-rescan":
        observed.append(step.post.flag == got.flag)
    sv.push()
    sv.add(*observed)
    admitted = check_sat(sv) == z3.sat
    sv.pop()
    if policy == "signal-rescan" and not got.flag:
        # the abstraction lets keys outside the request leave too (any of them sets the flag);
        # with none of the request's keys gone, "flag stays clear" is admitted, not forced
        observed.pop()
    sv.add(z3.Not(z3.And(observed)) if observed else z3.BoolVal(False))
    return admitted, check_sat(sv) == z3.unsat


# -- bookkeeping transitions: preemption, full tables, finish, reset -----------------------------


@dataclass
class Book:
    cursors: list[int] | None  # None: the request has no store state any more
    lengths: list[int] | None
    lost: set[tuple[int, int]]
    infl: set[tuple[int, int]]
    active: bool


def model_bookkeeping(policy: str, st: Small, what: str, extra: int = 0) -> Book:
    """Apply one bookkeeping transition to ``st`` through the model's public entry points:
    ``preempt`` (a step listing R in ``preempted_req_ids``), ``full-table`` (R scheduled as a
    new request whose table extends its ids by ``extra`` blocks), ``finish``
    (``request_finished``) or ``reset``."""
    sched, where = build_model(policy, st)
    st_r = sched.reqs_to_store["R"]
    if what == "preempt":
        sched.build_connector_meta(SchedulerOutput(preempted_req_ids={"R"}))
    elif what == "full-table":
        table = tuple([*ids, *sched.gpu_pool.get_new_blocks(extra)] for ids in st_r.block_ids)
        sched.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[NewRequestData("R", table)],
                                                   num_scheduled_tokens={"R": 0}))
    elif what == "finish":
        sched.request_finished(st_r.request)
    elif what == "reset":
        sched.reset()
    else:
        raise ValueError(what)
    now = sched.reqs_to_store.get("R")
    lost = {(g, i) for (_, g, i) in getattr(sched.policy, "lost", {})}
    infl = {where[b] for b in sched.in_flight_store_gpu_blocks if b in where}
    if now is None or now.finished:
        return Book(None, None, lost, infl, False)
    return Book(list(now.num_stored_blocks), [len(ids) for ids in now.block_ids], lost, infl, True)


def bookkeeping_agrees(policy: str, st: Small, what: str, got: Book) -> bool:
    """Does the Z3 transition (``preempt``, ``loaded-full-table``, ``finish``, ``reset``) admit
    the model's outcome? A request without store state reads as cursor 0 (reset) or inactive."""
    from kvspec.specs.transitions import finish, loaded_full_table, preempt, reset

    fn = {"preempt": preempt, "full-table": loaded_full_table, "finish": finish, "reset": reset}[what]
    M = max((len(ps) for ps in st.groups), default=0) + 2
    enc = Unrolled(len(st.groups), M)
    s = enc.state("b")
    step = fn(enc, policy, s)
    sv = z3.Solver()
    sv.set("random_seed", 7)
    sv.set("rlimit", 20_000_000)
    sv.add(*step.constraints, s.conf == st.conf, s.active == st.active, s.flag == st.flag)
    if policy == "repair" and what in ("preempt", "full-table"):
        # these arrive through build_connector_meta, whose repair phase runs every step
        # (and the eviction its allocation may cause, see repair_phase_admits)
        rp = repair_phase(enc, policy, step.post)
        ev = evict(enc, policy, rp.post)
        sv.add(*rp.constraints, *ev.constraints)
        step = Step(ev.post, step.constraints + rp.constraints + ev.constraints)
    for g, ps in enumerate(st.groups):
        grp = s.groups[g]
        sv.add(grp.n == len(ps), grp.cur == st.cursors[g])
        for a in ARRAYS:
            sv.add(*[grp.arr[a][i] == getattr(p, a) for i, p in enumerate(ps)])
        post = step.post.groups[g]
        if got.cursors is not None:
            sv.add(post.cur == got.cursors[g])
            assert got.lengths is not None
            sv.add(post.n == got.lengths[g])
        elif what == "reset":
            sv.add(post.cur == 0)
        for i in range(len(ps)):
            sv.add(enc.v(step.post, g, "lost", i) == ((g, i) in got.lost))
            if policy == "repair" or what == "reset":
                sv.add(enc.v(step.post, g, "infl", i) == ((g, i) in got.infl))
    if what == "finish":
        sv.add(step.post.active == got.active)
    return bool(check_sat(sv) == z3.sat)
