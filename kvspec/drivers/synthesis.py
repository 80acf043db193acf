"""Z3 counterexamples become engine traces that reach the solver's state.

A completeness counterexample (``kvspec.specs.obligations.COUNTEREXAMPLES``) is an abstract
pre-state of one request, one transition, and a post-state that breaks the property; a
convergence counterexample (``DROPS``: ``convergence:drop-E1|E2|E3``, repair) is the same with
a post-state whose pending set (lost records and holes) did not shrink as C4's ranking needs.
The models are asked for inside ``kvspec.specs.realizable``'s fragment, which this module builds:

* **Goal** (``goal_of``): the pre-state's cursor ``k``, confirmed count ``c``, length ``N`` and,
  per position below the cursor, its status (in flight ``I``, cached and free ``C``, hole
  ``H``, repair: with a lost record ``L``); the failing step (``evict``: which copies it evicts;
  ``plan``: whether the request is scheduled; ``complete``: which store lands); the holes the
  post-state leaves.
* **Construction**, synchronous scheduling (``async_scheduling=False``, like the hand-written
  stories), block size ``B`` chosen by the caller, ``G`` full-attention groups (the fragment's
  groups are twins), a CPU pool of exactly ``G * k`` usable blocks. Request R (family 1)
  prefills ``B`` tokens a step, so each step confirms one block and R's plan stores one
  position per group per store event until the pool is full: the cursor stops at ``k``
  (``_prefix``). R is either *idle* (``max_tokens`` 1: after its prompt nothing schedules it)
  or *decoding* (a token every step). Request Q (family 2, ``h`` blocks, prefilled in one step
  while the pool is still full) is the evictor. Then the events of the positions to evict land
  first (the CPU free queue is LRU, so their copies are at its head), then those of the other
  ``C`` positions; ``I`` events never land. Q's finish flush allocates ``G * h`` blocks: exactly
  the head copies are evicted (for signal-rescan this sets the flag). For ``plan`` the
  pre-state is after the flush and the failing operation is a step (R idle: not scheduled, H1;
  R decoding: scheduled with no free CPU block, H3); for ``evict`` the pre-state is before the
  flush and the flush is the failing operation (T2, drop-E1). For ``complete`` (drop-E3) the
  pre-state is after the flush, as for ``plan``, and the failing operation reports the store
  event of the position that lands. Where the failure persists (T2, H1, H3: the holes;
  drop-E2: no room, nothing lands) two more steps follow; after drop-E1 and drop-E3 a step
  would be a round, which the counterexample is not about. (``_complete``.)
* **Search** (``synthesize``): R's prompt length (``k * B`` to ``(c + 1) * B``), idle or
  decoding, and for a decoding R the number of extra steps before Q's admission decide ``N``
  and ``c``. Each prompt's prefix is run once; a decoding R's is copied after each extra step
  while its confirmed count is at most ``c``. A candidate whose live engine is at the model's
  pre-state (``specs.refinement.abstract_snapshot`` of R equal to the model's, position by
  position) is checked by ``verify``, and the first that passes is returned. O(prompts x
  (c + B)) candidates of O(c + B) operations; measured: 0.003-0.4 s per model here.
"""

from __future__ import annotations

import copy
import itertools
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import KVSpecError
from kvspec.drivers.engine import Engine
from kvspec.drivers.trace import Trace, loads
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import check
from kvspec.specs.convergence import DROP_STATUSES
from kvspec.specs.obligations import COUNTEREXAMPLES, SHOWN, Result
from kvspec.specs.realizable import POSITIONS
from kvspec.specs.refinement import abstract_snapshot

FOCAL, EVICTOR = "R", "Q"
BLOCK = 4  # the block size kvspec prove builds its traces with
GPU_BLOCKS = 96
DECODE_TOKENS = 64  # max_tokens of a decoding focal request (never reached here)
TAIL = 2  # steps after the failing operation
SETTLE_STEPS = 8  # an idle request stops computing within two steps
DROPS = {f"convergence:drop-{a}": step for a, step in zip(DROP_STATUSES, ("evict", "plan", "complete"), strict=True)}
"""The convergence counterexamples (repair) by obligation name, with their failing step."""


def base_name(obligation: str) -> str:
    """``bounded:completeness-c1:T2[N<=8]``, ``completeness-c1:T2[G=2]`` -> ``completeness-c1:T2``."""
    return obligation.removeprefix("bounded:").split("[")[0]


@dataclass(frozen=True)
class Goal:
    """What a counterexample asks of the engine: the pre-state to reach and the step to take."""

    policy: str
    conf: int
    n: int
    cur: int
    status: tuple[str, ...]  # per position below the cursor: "I", "C", "H" or "L"
    step: str  # "evict", "plan" or "complete"
    evicted: tuple[int, ...]  # evict: positions whose copies the step evicts
    scheduled: bool  # plan: the request is scheduled in the failing step
    holes_after: tuple[tuple[int, int], ...]  # (group, position) owned, hashed, below the cursor, uncovered
    groups: int = 1  # twins: every group as group 0
    landed: int = -1  # complete: the position whose store lands
    tail: int = TAIL  # steps after the failing operation

    @property
    def first(self) -> tuple[int, ...]:
        """The positions whose copies Q's flush must evict: the holes, with or without a lost
        record (plan, complete), or the victims (evict)."""
        if self.step == "evict":
            return self.evicted
        return tuple(p for p, s in enumerate(self.status) if s in ("H", "L"))


def goal_of(obligation: str, cex: dict[str, Any]) -> Goal:
    """Read a counterexample model (``obligations.counterexamples``) as a goal. O(POSITIONS)."""
    name = base_name(obligation)
    k, groups = cex["pre.cur0"], _groups(cex)

    def bit(tag: str, a: str, p: int, g: int = 0) -> bool:
        return bool(cex[f"{tag}.{a}{g}"][p])

    status = tuple("I" if bit("pre", "infl", p) else "C" if bit("pre", "cached", p)
                   else "L" if bit("pre", "lost", p) else "H" for p in range(k))
    holes = tuple((g, p) for g in range(groups) for p in range(cex[f"pre.cur{g}"])
                  if bit("post", "owned", p, g) and bit("post", "hashed", p, g)
                  and not bit("post", "cached", p, g) and not bit("post", "infl", p, g))
    step = DROPS.get(name, "evict" if name.endswith("T2") else "plan")
    landed = [p for p in range(k) if not bit("pre", "cached", p) and bit("post", "cached", p)]
    return Goal(COUNTEREXAMPLES[name].policy if name in COUNTEREXAMPLES else "repair", cex["pre.conf"], cex["pre.N0"],
                k, status, step, tuple(p for p in range(k) if bit("pre", "cached", p) and not bit("post", "cached", p)),
                bool(cex.get("scheduled", False)), holes, groups, landed[0] if step == "complete" else -1,
                TAIL if name not in DROPS or step == "plan" else 0)


def _groups(cex: dict[str, Any]) -> int:
    return sum(1 for key in cex if key.startswith("pre.N"))


def expected_state(cex: dict[str, Any], tag: str = "pre") -> dict[str, Any]:
    """The model's pre-state (``tag`` "post": its post-state) as ``AbstractRequest.render()``
    shows one: what the reached engine state must map to. The owner index (``reg``) is a ghost
    the snapshot does not show; retained copies (``kept``, repair's) are absent from the fragment
    and from non-repair models."""
    def group(g: int) -> dict[str, Any]:
        n = cex[f"{tag}.N{g}"]
        arrays = {a: "".join("1" if b else "0" for b in cex[f"{tag}.{a}{g}"][:n]) for a in SHOWN}
        kept = "".join("1" if b else "0" for b in cex.get(f"{tag}.kept{g}", [False] * n)[:n])
        return {"N": n, "cur": cex[f"{tag}.cur{g}"], **arrays, "reg": "?" * n, "kept": kept}

    return {"active": True, "conf": cex[f"{tag}.conf"], "flag": cex[f"{tag}.flag"],
            "groups": [group(g) for g in range(_groups(cex))]}


def pending_set(state: dict[str, Any]) -> tuple[tuple[str, int, int], ...]:
    """C4's measure in a rendered state (``AbstractRequest.render()``, ``expected_state``): its
    lost records ``("lost", group, position)`` and holes ``("hole", group, position)`` (owned,
    hashed, below the cursor, neither cached nor in flight), as ``convergence.rank`` counts them."""
    if not state["active"]:
        return ()
    out = []
    for g, grp in enumerate(state["groups"]):
        out += [("lost", g, p) for p, b in enumerate(grp["lost"]) if b == "1"]
        out += [("hole", g, p) for p in range(grp["cur"]) if grp["owned"][p] == grp["hashed"][p] == "1"
                and grp["cached"][p] == grp["infl"][p] == "0"]
    return tuple(sorted(out))


@dataclass(frozen=True)
class Synthesis:
    """A trace: ``ops[:failing]`` reach the pre-state, ``ops[failing]`` is the failing step."""

    config: OffloadConfig
    ops: list[dict[str, Any]]
    failing: int

    def trace(self, obligation: str) -> Trace:
        """The trace as ``kvspec replay`` reads it, with the first C1 finding recorded; a
        convergence trace records none under C2 and C4 (its failing step breaks an assumption C4
        makes: no eviction of the working set, room for the repair, or a step at all)."""
        note = (f"synthesised from the Z3 counterexample {obligation}: operations 0..{self.failing - 1} "
                f"reach its pre-state of request {FOCAL}, operation {self.failing} is its failing step")
        if base_name(obligation) in DROPS:
            return Trace(self.config, list(self.ops), note=note, oracle=("C2", "C4"))
        first = first_c1(self.config, self.ops)
        finding = None if first is None else {"kind": "violation", "op_index": first, "invariant": "C1",
                                              "exception": None}
        return Trace(self.config, list(self.ops), note=note, oracle=("C1",), finding=finding)


def c1_positions(snap: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """(group, position) of the focal request that C1 reports, in order."""
    out = []
    for v in check(snap, ["C1"]):
        words = v.message.split()
        if FOCAL in v.requests and words[0] == "group" and words[2] == "position":
            out.append((int(words[1]), int(words[3].rstrip(":"))))
    return tuple(sorted(out))


def first_c1(config: OffloadConfig, ops: list[dict[str, Any]]) -> int | None:
    """The index of the first operation after which C1 reports something, or None."""
    e = Engine(make_scheduler(config))
    for i, op in enumerate(ops):
        e.apply(op)
        if check(e.snapshot(), ["C1"]):
            return i
    return None


class _Recorder:
    """An engine and the operations applied to it."""

    def __init__(self, config: OffloadConfig) -> None:
        self.engine = Engine(make_scheduler(config))
        self.ops: list[dict[str, Any]] = []

    def apply(self, **op: Any) -> Any:
        self.ops.append(op)
        return self.engine.apply(op)

    def settle(self, block_size: int) -> bool:
        """Step until the focal request computes nothing more (idle: its ``max_tokens`` reached);
        False if it still computes after ``SETTLE_STEPS`` steps."""
        r = self.engine.requests[FOCAL]
        before = -1
        for _ in range(SETTLE_STEPS):
            if before == r.num_computed_tokens:
                return True
            before = r.num_computed_tokens
            self.apply(op="step", chunk=block_size)
        return False

    def stored(self) -> int:
        st = self.engine.snapshot()["scheduler"]["reqs_to_store"].get(FOCAL)
        return 0 if st is None else min(st["num_stored_blocks"])


def _report_order(rec: _Recorder, goal: Goal) -> list[int] | None:
    """R's store events to land: those of ``goal.first`` first, then those of the other cached
    positions; None when one event mixes positions that must be treated differently."""
    position = {b: p for t in rec.engine.requests[FOCAL].table for p, b in enumerate(t)}
    first, later = [], []
    for e, (gpu, _) in sorted(rec.engine.store_transfers.items()):
        kinds = {"first" if p in goal.first else goal.status[p] for p in (position[b] for b in gpu)}
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
        if kind == "first":
            first.append(e)
        elif kind == "C":
            later.append(e)
        elif kind == "H":  # a hole that the flush does not evict: not in the fragment
            return None
    return first + later


def _prefix(goal: Goal, B: int, prompt: int, decoding: bool) -> _Recorder | None:
    """R added, admitted and prefilled ``B`` tokens a step until its cursor is ``goal.cur`` (the
    CPU pool full); None when it never gets there."""
    cfg = OffloadConfig(block_size=B, num_cpu_blocks=goal.groups * goal.cur + 1, num_gpu_blocks=GPU_BLOCKS,
                        groups=(KVGroup(),) * goal.groups, policy=goal.policy, async_scheduling=False,
                        max_num_batched_tokens=4096)
    rec = _Recorder(cfg)
    rec.apply(op="add", rid=FOCAL, family=1, prompt_len=prompt, max_tokens=DECODE_TOKENS if decoding else 1)
    rec.apply(op="step", admit=[FOCAL], chunk=B)
    for _ in range(2 * (goal.conf + 2)):
        if rec.stored() >= goal.cur:
            break
        rec.apply(op="step", chunk=B)
    return rec if rec.stored() == goal.cur else None


def _complete(rec: _Recorder, goal: Goal, B: int) -> Synthesis | None:
    """From R's prefix: Q admitted, the events landed in order, Q's flush (plan), then the failing
    operation and the tail. ``rec``'s engine is left at the pre-state. None when the events do
    not fit the goal."""
    h = len(goal.first)
    rec.apply(op="add", rid=EVICTOR, family=2, prompt_len=h * B, max_tokens=1)
    rec.apply(op="step", admit=[EVICTOR], chunk=h * B)
    order = _report_order(rec, goal)
    if order is None:
        return None
    for e in order:
        rec.apply(op="report", event=e)
    if goal.step != "evict":
        rec.apply(op="finish", rid=EVICTOR)
    failing = len(rec.ops)
    if goal.step == "complete":
        position = {b: p for t in rec.engine.requests[FOCAL].table for p, b in enumerate(t)}
        events = [e for e, (gpu, _) in rec.engine.store_transfers.items()
                  if {position.get(b) for b in gpu} == {goal.landed}]
        if len(events) != 1:
            return None
        last: dict[str, Any] = {"op": "report", "event": events[0]}
    else:
        last = {"op": "finish", "rid": EVICTOR} if goal.step == "evict" else {"op": "step", "chunk": B}
    return Synthesis(rec.engine.config, [*rec.ops, last] + [{"op": "step", "chunk": B}] * goal.tail, failing)


def verify(obligation: str, cex: dict[str, Any], syn: Synthesis) -> str | None:
    """None when the trace does what the counterexample says, else what it does not. The trace is
    written and read back (``kvspec replay``'s format) and run on a fresh model: after
    ``ops[:failing]`` the focal request maps (``abstract_snapshot``) to exactly the model's
    pre-state; after the failing operation and each later one, C1 reports exactly the model's
    post-state holes below the cursor and the signal-rescan flag is clear (so its completeness
    claim, a hole only while the flag is set, fails there); and C1 holds before the failing
    operation exactly when the model's pre-state has no hole. A convergence counterexample's
    trace is checked on its pending set instead (``_verify_drop``). O(trace length) engine
    operations."""
    goal = goal_of(obligation, cex)
    trace = loads(syn.trace(obligation).dumps())
    ops = trace.ops
    e = Engine(make_scheduler(trace.config))
    for op in ops[: syn.failing]:
        e.apply(op)
    state = abstract_snapshot(e.snapshot()).get(FOCAL)
    want = expected_state(cex)
    if state is None or state.render() != want:
        return f"pre-state {None if state is None else state.render()} != the model's {want}"
    if base_name(obligation) in DROPS:
        return _verify_drop(base_name(obligation), cex, e, ops[syn.failing:], syn.failing)
    if bool(c1_positions(e.snapshot())) != ("H" in goal.status):
        return f"C1 before the failing operation: {c1_positions(e.snapshot())}, the model's holes {goal.status}"
    for i, op in enumerate(ops[syn.failing:], syn.failing):
        e.apply(op)
        snap = e.snapshot()
        if c1_positions(snap) != goal.holes_after:
            return f"operation {i}: C1 at {c1_positions(snap)}, the model's holes {goal.holes_after}"
        if snap["scheduler"]["policy_state"].get("eviction_flag", False):
            return f"operation {i}: the eviction flag is still set"
    return None


def _verify_drop(name: str, cex: dict[str, Any], e: Engine, rest: list[dict[str, Any]], failing: int) -> str | None:
    """``verify`` for a convergence counterexample, from the pre-state on: after the failing
    operation and each later one the focal request's pending set (``pending_set``) is the
    model's post-state's, non-empty, and it did what the counterexample says: drop-E1 grew it,
    drop-E2 and drop-E3 left it as it was."""
    before = pending_set(expected_state(cex))
    after = pending_set(expected_state(cex, "post"))
    grows = name.endswith("E1")
    if not after or (len(after) <= len(before) if grows else after != before):
        return f"the model's pending sets {before} -> {after} are not a {name} counterexample"
    for i, op in enumerate(rest, failing):
        e.apply(op)
        state = abstract_snapshot(e.snapshot()).get(FOCAL)
        got = () if state is None else pending_set(state.render())
        if got != after:
            return f"operation {i}: pending {got}, the model's {after}"
    return None


def _candidates(goal: Goal, B: int) -> Iterator[_Recorder]:
    """R's prefixes, then each number of extra steps that keeps its confirmed count within the
    goal's (a copy each): for every prompt length, idle first where the step allows it (an idle
    request is settled, extra steps change nothing). O(prompts x (B + c)) engine steps."""
    modes = (True,) if goal.step == "plan" and goal.scheduled else \
        (False,) if goal.step == "plan" else (False, True)
    for decoding, prompt in itertools.product(modes, range(max(1, goal.cur * B), (goal.conf + 1) * B + 1)):
        try:
            rec = _prefix(goal, B, prompt, decoding)
            if rec is None or not (decoding or rec.settle(B)):
                continue
        except KVSpecError:
            continue  # an operation the engine refuses: not this prompt
        if not decoding:
            yield rec
            continue
        r = rec.engine.requests[FOCAL]
        for _ in range((goal.conf + 2) * B):  # a decoding request computes a token a step
            if r.num_computed_tokens // B > goal.conf:
                break
            yield copy.deepcopy(rec)
            rec.apply(op="step", chunk=B)


def synthesize(obligation: str, cex: dict[str, Any], block_size: int) -> Synthesis | None:
    """The first candidate trace that reaches the model's pre-state and reproduces its holes
    (``verify``); None when no candidate does (the model is outside what the construction
    builds). A candidate is verified only when its live engine is at the model's pre-state."""
    goal, want = goal_of(obligation, cex), expected_state(cex)
    assert goal.n <= POSITIONS
    for rec in _candidates(goal, block_size):
        try:
            syn = _complete(rec, goal, block_size)
        except KVSpecError:
            continue  # an operation the engine refuses: not this candidate
        state = abstract_snapshot(rec.engine.snapshot()).get(FOCAL)
        if syn is not None and state is not None and state.render() == want and verify(obligation, cex, syn) is None:
            return syn
    return None


def trace_file(directory: Path, obligation: str, policy: str) -> Path:
    """Where ``kvspec prove --traces`` writes an obligation's trace: one file per (name, policy)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{obligation}-{policy}").strip("_")
    return directory / f"{stem}.jsonl"


def realise(res: Result, save: Path | None = None, block_size: int = BLOCK) -> None:
    """For a found completeness or convergence counterexample (``kvspec prove``): synthesise its trace and
    ``verify`` it; the result's detail then names the trace's length and failing operation, and
    the trace is written under ``save`` when given. No trace, or one that does not verify, turns
    the result into ``no trace`` (a failure). The synthesis time is added to the result's. Other
    results are left as they are."""
    if res.kind != "counterexample" or res.result != "found" or base_name(res.name) not in (*COUNTEREXAMPLES, *DROPS):
        return
    t0 = time.perf_counter()
    syn = synthesize(res.name, res.model, block_size)
    res.seconds += time.perf_counter() - t0
    if syn is None:
        res.result, res.detail = "no trace", f"no trace reaches the model's pre-state {expected_state(res.model)}"
        return
    res.detail = (f"trace of {len(syn.ops)} operations (block size {block_size}): operations 0-{syn.failing - 1} "
                  f"reach the pre-state, operation {syn.failing} is the failing step")
    if save is not None:
        syn.trace(res.name).write(trace_file(save, res.name, res.policy))
