"""Refinement: every step of the model is admitted by the Z3 transitions, and wrong models are not.

``kvspec.specs.refinement`` maps each engine snapshot to one abstract focal state per request
and checks every (before, after) pair against the transitions an operation may be. Here:

* random traces of the model (``tracegen.random_ops``: block sizes 1-4, few key families so
  requests share keys, world sizes 1-3, sliding-window groups) pass the check on every
  accepted operation, for each policy;
* planted semantic mutations of the model (monkeypatched policy methods) are each rejected
  on some trace, with a rejection that names the request, the group, the operation and the
  abstract values;
* the abstraction reads the snapshot as PROOFS.md defines it (ownership by the connector's
  ids and the ref count).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import KVSpecError
from kvspec.drivers.engine import Engine
from kvspec.drivers.tracegen import random_ops
from kvspec.model import make_scheduler
from kvspec.model.baseline import BaselinePolicy, GroupSelection, Selection
from kvspec.model.repair import RepairPolicy
from kvspec.model.scheduler import Transfer
from kvspec.model.signal_rescan import SignalRescanPolicy
from kvspec.specs.refinement import (
    REFINEMENT_ID,
    REJECTED,
    Rejection,
    StepCheck,
    abstract_snapshot,
    refinement_check,
)

OPS_PER_TRACE = 45
SLIDING = "sliding"


@dataclass(frozen=True)
class Shape:
    """A trace's configuration and generator seed."""

    block_size: int
    world_size: int
    cpu_blocks: int
    sliding_window: int  # 0: one full-attention group only
    families: int
    seed: int

    def config(self, policy: str) -> OffloadConfig:
        groups = (KVGroup(),) if not self.sliding_window else (KVGroup(), KVGroup(SLIDING, self.sliding_window))
        return OffloadConfig(block_size=self.block_size, num_gpu_blocks=20, num_cpu_blocks=self.cpu_blocks,
                             groups=groups, world_size=self.world_size, max_num_batched_tokens=8, policy=policy)


SHAPES = (
    Shape(block_size=1, world_size=1, cpu_blocks=3, sliding_window=0, families=1, seed=11),
    Shape(block_size=2, world_size=2, cpu_blocks=4, sliding_window=3, families=1, seed=12),
    Shape(block_size=3, world_size=3, cpu_blocks=5, sliding_window=0, families=2, seed=13),
    Shape(block_size=4, world_size=2, cpu_blocks=4, sliding_window=8, families=2, seed=14),
)


@dataclass
class TraceRun:
    steps: int  # accepted operations checked
    seconds: float  # spent in the refinement check
    first: Rejection | None


def _accepted(config: OffloadConfig, ops: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any], Any, Any]]:
    """(index, op, snapshot before, snapshot after) for each operation the model accepts."""
    eng = Engine(make_scheduler(config))
    before = eng.snapshot()
    for i, op in enumerate(ops):
        try:
            eng.apply(op)
        except KVSpecError:  # the trace was drawn on a baseline shadow: another policy may refuse
            continue
        after = eng.snapshot()
        yield i, op, before, after
        before = after


def check_trace(shape: Shape, policy: str, n_ops: int = OPS_PER_TRACE) -> TraceRun:
    """Run ``shape``'s trace on the model under ``policy``, checking every accepted operation."""
    config = shape.config(policy)
    ops = random_ops(config, random.Random(shape.seed), n_ops, num_families=shape.families)
    run = TraceRun(0, 0.0, None)
    for i, op, before, after in _accepted(config, ops):
        res = refinement_check(before, after, op, config, i)
        run.steps += 1
        run.seconds += res.seconds
        if not res.ok:
            run.first = res.rejections[0]
            break
    return run


@pytest.mark.parametrize("policy", ["baseline", "signal-rescan", "repair"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s.block_size}-w{s.world_size}-sw{s.sliding_window}")
def test_every_model_step_is_admitted(policy: str, shape: Shape) -> None:
    run = check_trace(shape, policy)
    assert run.first is None, str(run.first)
    assert run.steps >= OPS_PER_TRACE // 2


# -- planted mutations of the model ----------------------------------------------------------


def _cursor_back(original: Callable[..., Selection]) -> Callable[..., Selection]:
    """The baseline scan moves a cursor that did not advance one position back."""
    def select(self: BaselinePolicy, st: Any, ids_by_group: list[list[int]]) -> Selection:
        sel = original(self, st, ids_by_group)
        cursors = [c - 1 if c == old and c > 0 else c for c, old in zip(sel.cursors, st.num_stored_blocks,
                                                                           strict=True)]
        return Selection(sel.gpu_ids, cursors)
    return select


def _first_owner_only(self: RepairPolicy, evicted: Any) -> None:
    """Only the first owner of an evicted key gets a lost record."""
    for _, key in evicted:
        if self.sched.cpu_pool.get_one_block(key) is None and self._is_live(key):
            pos = next(iter(self.owners[key]))
            self.lost.setdefault(pos, key)


def _completion_caches_lost(original: Callable[..., None]) -> Callable[..., None]:
    """A completion also caches every lost record's key (on a CPU block taken from the head)."""
    def on_store_completed(self: RepairPolicy, completed: Transfer) -> None:
        original(self, completed)
        cpu = self.sched.cpu_pool
        for key in dict.fromkeys(self.lost.values()):
            if cpu.get_one_block(key) is None and cpu.get_num_free_blocks() > 0:
                block = cpu.get_new_blocks(1)
                cpu.insert_block_hash(key, block[0])
                cpu.free_blocks(block)
        cpu.take_evicted()
    return on_store_completed


def _signal_dropped(self: SignalRescanPolicy, evicted: Any) -> None:
    """Evictions no longer set the signal-rescan flag."""


def _skip_past_stop(original: Callable[..., GroupSelection]) -> Callable[..., GroupSelection]:
    """The baseline scan passes every confirmed position, also the READY one it ran out of space at."""
    def select_group(self: BaselinePolicy, st: Any, g: int, ids: list[int], taken: int,
                     free: int) -> GroupSelection:
        sel = original(self, st, g, ids, taken, free)
        return GroupSelection(sel.gpu_ids, max(sel.advance, self.sched.ready_blocks(st, ids) - st.num_stored_blocks[g]))
    return select_group


def _drop_a_record(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """Repair drops the last pending record although it is still owned and uncovered."""
    def repair_candidates(self: RepairPolicy, finishing: Any) -> list[Any]:
        out = original(self, finishing)
        if not out:
            return out
        self.lost.pop(out[-1][0], None)
        return out[:-1]
    return repair_candidates


MUTATIONS: dict[str, tuple[str, type, str, Callable[[Any], Any]]] = {
    # name: (policy, class, method, replacement built from the original method)
    "cursor-moves-back": ("baseline", BaselinePolicy, "select", _cursor_back),
    "first-owner-only": ("repair", RepairPolicy, "record_losses", lambda _: _first_owner_only),
    "completion-caches-lost": ("repair", RepairPolicy, "on_store_completed", _completion_caches_lost),
    "flag-never-set": ("signal-rescan", SignalRescanPolicy, "on_cpu_evictions", lambda _: _signal_dropped),
    "scan-passes-its-stop": ("baseline", BaselinePolicy, "select_group", _skip_past_stop),
    "record-dropped-early": ("repair", RepairPolicy, "repair_candidates", _drop_a_record),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_planted_mutation_is_rejected(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    policy, cls, method, make = MUTATIONS[name]
    monkeypatch.setattr(cls, method, make(getattr(cls, method)))
    found = None
    for shape in SHAPES:
        found = check_trace(shape, policy, 2 * OPS_PER_TRACE).first
        if found is not None:
            break
    assert found is not None, f"{name}: no trace rejected"
    assert found.verdict == REJECTED and found.op_index is not None and found.conflict
    assert found.before and found.after and found.rid in str(found)


# -- the abstraction and the entry point --------------------------------------------------------


def _snapshots(policy: str, n_ops: int) -> list[dict[str, Any]]:
    config = SHAPES[0].config(policy)
    ops = random_ops(config, random.Random(SHAPES[0].seed), n_ops, num_families=1)
    return [after for _, _, _, after in _accepted(config, ops)]


def test_abstraction_reads_ownership_by_connector_ids_and_ref_count() -> None:
    """``owned`` needs the connector's id, the request's key on that block and ref count >= 1:
    zeroing the ref count of an owned block makes the position unowned."""
    snap = next(s for s in _snapshots("repair", 30)
                if any(True in g.bits.get("owned", ()) for a in abstract_snapshot(s).values() for g in a.groups))
    rid, g, p = next((a.rid, gi, p) for a in abstract_snapshot(snap).values()
                     for gi, grp in enumerate(a.groups) for p, b in enumerate(grp.bits.get("owned", ())) if b)
    block = snap["scheduler"]["reqs_to_store"][rid]["block_ids"][g][p]
    snap["gpu_pool"]["ref_cnt"][block] = 0
    assert abstract_snapshot(snap)[rid].groups[g].bits["owned"][p] is False


def test_ownership_agrees_with_the_oracle() -> None:
    """The oracle's C2 reads ownership from the engine's live table without a ref count; the
    abstraction from the connector's ids with one. On the states the engine reaches (window
    floor applied by both) the owned positions below a cursor are the same."""
    from kvspec.oracle.catalogue import owned_below_cursor

    compared = 0
    for shape in SHAPES:
        config = shape.config("repair")
        ops = random_ops(config, random.Random(shape.seed), OPS_PER_TRACE, num_families=shape.families)
        for _, _, _, snap in _accepted(config, ops):
            oracle = {(r, g, p) for r, g, p, _, _ in owned_below_cursor(snap)}
            spec = {(a.rid, g, p) for a in abstract_snapshot(snap).values() if a.active
                    for g, grp in enumerate(a.groups) for p in range(grp.cur or 0)
                    if grp.bits["owned"][p] and grp.bits["hashed"][p]}
            assert oracle == spec, (oracle ^ spec)
            compared += bool(spec)
    assert compared > 10


def test_entry_point_judges_a_pair() -> None:
    """``refinement_check`` on an unchanged state after an ``add`` admits it; a cursor moved back
    by hand is rejected, naming the request and group."""
    config = SHAPES[0].config("repair")
    snaps = _snapshots("repair", 30)
    snap = next(s for s in snaps if any(max(st["num_stored_blocks"]) > 0
                                        for st in s["scheduler"]["reqs_to_store"].values()))
    ok = refinement_check(snap, snap, {"op": "add", "rid": "x", "family": 0, "prompt_len": 1}, config)
    assert isinstance(ok, StepCheck) and ok.ok and ok.checked >= 1
    rid = next(r for r, st in snap["scheduler"]["reqs_to_store"].items() if max(st["num_stored_blocks"]) > 0)
    st = snap["scheduler"]["reqs_to_store"][rid]
    g = st["num_stored_blocks"].index(max(st["num_stored_blocks"]))
    after = {**snap, "scheduler": {**snap["scheduler"], "reqs_to_store": {
        **snap["scheduler"]["reqs_to_store"],
        rid: {**st, "num_stored_blocks": [c - 1 if i == g else c for i, c in enumerate(st["num_stored_blocks"])]}}}}
    bad = refinement_check(snap, after, {"op": "report", "event": 0, "count": 1}, config, 7)
    assert not bad.ok
    rej = bad.rejections[0]
    assert (rej.rid, rej.group, rej.op_index, rej.op) == (rid, g, 7, "report")
    assert f"post.g{g}.cur" in rej.conflict


def test_the_run_loop_reports_refinement_as_r1(monkeypatch: pytest.MonkeyPatch) -> None:
    """``harness.Run(..., refine=True)`` (what ``replay --refine``, ``fuzz --refine`` and the
    refinement state machines use) turns the first rejection into a violation of R1, and without a
    mutation the same traces are clean."""
    from kvspec.drivers.harness import Run

    def first_finding(policy: str) -> Any:
        for shape in SHAPES:
            config = shape.config(policy)
            run = Run(config, make_scheduler, (), refine=True)
            for op in random_ops(config, random.Random(shape.seed), 2 * OPS_PER_TRACE, num_families=shape.families):
                found = run.apply(op, recorded=False)
                if found is not None:
                    return found
        return None

    assert first_finding("baseline") is None
    policy, cls, method, make = MUTATIONS["cursor-moves-back"]
    monkeypatch.setattr(cls, method, make(getattr(cls, method)))
    found = first_finding(policy)
    assert found is not None and found.violation is not None and found.violation.id == REFINEMENT_ID, found


def test_fuzz_refine_finds_shrinks_and_replays(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``kvspec fuzz --refine`` on a model whose evictions never set the signal-rescan flag (the
    policy's claimed invariants do not see it): the finding is R1, shrunk, and its saved trace
    replays to R1 with ``kvspec replay`` (refinement switched on by the recorded finding)."""
    import json

    from kvspec.cli import main

    policy, cls, method, make = MUTATIONS["flag-never-set"]
    monkeypatch.setattr(cls, method, make(getattr(cls, method)))
    out = tmp_path / "found"
    assert main(["fuzz", "--policy", policy, "--budget", "60", "--refine", "--out", str(out), "--json"]) == 1
    trace = next(out.glob("*shrunk*.jsonl"))
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["finding"]["invariant"] == REFINEMENT_ID, header
    assert main(["replay", str(trace)]) == 1


def test_a_completion_that_frees_a_retained_copy_is_admitted() -> None:
    """Found by ``kvspec fuzz --refine`` on the repair model: r14 holds block 10 (unhashed) at
    position 1, whose key block 6 carries; block 6's last reference is store event 8's, whose
    request finished. The report completing event 8 frees it, so r14's position 1 gains a retained
    copy (``kept``) and with it ``hashed``. The report's transitions let ``kept`` change but kept
    ``hashed``, and R1 rejected a correct step; now a position that is not owned is hashed
    exactly when its retained copy comes (``transitions._retained_copies``)."""
    from kvspec.drivers import trace as trace_io
    from kvspec.drivers.harness import replay

    tr = trace_io.read(Path(__file__).parent / "traces" / "oracle" / "r1-retained-copy-freed-by-completion.jsonl")
    assert tr.finding is not None and tr.finding["invariant"] == "R1"  # what the old transitions reported
    out = replay(tr, make_scheduler, tr.oracle, refine=True)
    assert not out.failed, out.describe()
    pairs = [(before, after) for i, op, before, after in _accepted(tr.config, tr.ops) if i == 31]
    (before, after), = pairs
    assert tr.ops[31]["op"] == "report"
    pre, post = abstract_snapshot(before)["r14"].groups[0], abstract_snapshot(after)["r14"].groups[0]
    assert (pre.bits["kept"][1], pre.bits["hashed"][1], pre.bits["owned"][1]) == (False, False, False)
    assert (post.bits["kept"][1], post.bits["hashed"][1]) == (True, True)


FLAG_TRACE = Path(__file__).parent / "traces" / "oracle" / "r1-signal-rescan-flag-read-at-build-start.jsonl"


def test_evictions_earlier_in_the_build_do_not_make_the_scan_rescan() -> None:
    """Found by ``kvspec fuzz --refine --policy signal-rescan``: the flag is clear when step 37
    starts; r11, scanned before r9 in the same build, evicts r9's cached copies (positions 1-3),
    which sets the flag for the next build; r9's scan reads the flag the build started with and
    does not rescan ``[0, cursor)`` (vLLM + pr47235 does the same, in lockstep). With the whole
    plan one transition after that eviction (``evict ; env-store ; plan``), the eviction set the
    flag before the plan read it, so the encoding demanded a rescan of position 0 and R1 rejected
    a correct step. The step template now reads the flag when the build starts (``consume``) and
    scans with what it read (``scan-latched``)."""
    from kvspec.drivers import trace as trace_io
    from kvspec.drivers.harness import replay

    tr = trace_io.read(FLAG_TRACE)
    out = replay(tr, make_scheduler, tr.oracle, refine=True)
    assert not out.failed, out.describe()


def test_the_flag_trace_shows_the_build_that_sets_the_flag() -> None:
    """The trace above is what it says: step 37 starts with the flag clear, evicts r9's cached
    copies and leaves the flag set; r9 does not rescan position 0; the model breaks no invariant
    there. With the plan read as one transition (the old template) R1 rejects the step."""
    from kvspec.drivers import trace as trace_io
    from kvspec.drivers.harness import VIOLATION, replay
    from kvspec.specs import refinement

    tr = trace_io.read(FLAG_TRACE)
    (before, after), = [(b, a) for i, _, b, a in _accepted(tr.config, tr.ops) if i == 37]
    assert before["scheduler"]["policy_state"]["eviction_flag"] is False
    assert after["scheduler"]["policy_state"]["eviction_flag"] is True
    pre, post = abstract_snapshot(before)["r9"].groups[0], abstract_snapshot(after)["r9"].groups[0]
    assert (pre.cur, pre.bits["cached"][1:4], pre.bits["infl"][0]) == (1, (True, True, True), False)
    assert post.bits["cached"][1:4] == (False, False, False) and post.bits["infl"][0] is False
    assert not replay(tr, make_scheduler, tr.oracle).failed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(refinement, "LATCHED_PLAN_STEP", refinement.PLAN_STEP)
        out = replay(tr, make_scheduler, tr.oracle, refine=True)
    assert out.kind == VIOLATION and out.op_index == 37 and out.violation is not None
    assert out.violation.id == REFINEMENT_ID


def test_a_copy_unpinned_and_evicted_before_the_scan_is_admitted() -> None:
    """Found by ``--refine`` campaigns on sliding-window configurations (baseline, synchronous
    scheduling): r0's two cached copies in group 0 are pinned (its load) when step 31 starts; in
    the step the pins are released, other requests' allocations evict the copies, and r0's scan
    finds the positions uncached and stores them again. The step template had the environment
    evict before it released pins (``evict ; env-store ; plan``), so a copy pinned at the start
    could not be evicted before the scan, and R1 rejected a correct step; the template now lets
    the environment release pins first (``env-store ; evict ; env-store ; plan``)."""
    from kvspec.drivers import trace as trace_io
    from kvspec.drivers.harness import replay

    tr = trace_io.read(Path(__file__).parent / "traces" / "oracle" / "r1-load-pin-released-then-evicted.jsonl")
    (before, after), = [(b, a) for i, _, b, a in _accepted(tr.config, tr.ops) if i == 31]
    pre, post = abstract_snapshot(before)["r0"].groups[0], abstract_snapshot(after)["r0"].groups[0]
    assert pre.bits["cached"][:2] == (True, True) and pre.bits["cfree"][:2] == (False, False)
    assert post.bits["cached"][:2] == (False, False) and post.bits["infl"][:2] == (True, True)
    out = replay(tr, make_scheduler, tr.oracle, refine=True)
    assert not out.failed, out.describe()
