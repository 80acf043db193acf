"""The invariant catalogue: every entry fires on a bad snapshot and is quiet on good ones.

Good snapshots come from real engine runs (several configurations, every policy):
chunked prefill, decode, split worker reports, preemption with both resume styles,
a sliding-window group, a CPU load after the GPU cache lost a prefix, finishes and
resets. Bad snapshots are those good snapshots with one thing broken by hand; each
test asserts the violation's id and exactly the blocks or requests it names.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scenario_kit import SYNC

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.drivers.engine import Engine
from kvspec.drivers.harness import Outcome
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import CATALOGUE, Violation, check

Snap = dict[str, Any]
POLICIES = ("baseline", "signal-rescan", "repair")


def _drain(e: Engine, split: bool) -> None:
    for ev in sorted(e.reports_left):
        while ev in e.reports_left:
            e.apply({"op": "report", "event": ev, "count": 1 if split else e.reports_left[ev]})
    for rid in sorted(e.loads_shipped):
        e.apply({"op": "load_done", "rid": rid})


def _script(kind: str) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = [
        {"op": "add", "rid": "a", "family": 1, "prompt_len": 70, "max_tokens": 3},
        {"op": "add", "rid": "b", "family": 2, "prompt_len": 40, "max_tokens": 2},
        {"op": "step", "admit": ["a", "b"], "chunk": 32},
    ]
    for _ in range(4):
        ops += [{"op": "step", "chunk": 32}, {"op": "drain"}]
    if kind == "preempt":
        ops += [{"op": "step", "preempt": ["a"]}, {"op": "step", "admit": ["a"], "resume": "mrv1"},
                {"op": "drain"}, {"op": "step", "preempt": ["a"]},
                {"op": "step", "admit": ["a"], "resume": "mrv2"}, {"op": "step"}, {"op": "drain"}]
    ops += [{"op": "finish", "rid": "b"}, {"op": "step"}, {"op": "drain"},
            {"op": "finish", "rid": "a"}, {"op": "step"}, {"op": "drain"},
            # a filler takes every GPU block, so a's prefix survives only on the CPU
            {"op": "add", "rid": "f", "family": 3, "prompt_len": 23 * 16 - 8, "max_tokens": 1},
            {"op": "step", "admit": ["f"], "chunk": 23 * 16}, {"op": "finish", "rid": "f"},
            {"op": "step"}, {"op": "drain"},
            {"op": "add", "rid": "c", "family": 1, "prompt_len": 70, "max_tokens": 2},
            {"op": "step", "admit": ["c"]}, {"op": "drain"}, {"op": "step"}, {"op": "step"},
            {"op": "drain"},
            # a reset with d's store in flight is refused until the workers report
            {"op": "add", "rid": "d", "family": 4, "prompt_len": 40, "max_tokens": 2},
            {"op": "step", "admit": ["d"]}, {"op": "step"}, {"op": "reset"}, {"op": "drain"},
            {"op": "finish", "rid": "c"}, {"op": "finish", "rid": "d"}, {"op": "step"}, {"op": "drain"},
            {"op": "reset"}]
    return ops


CONFIGS = {
    "plain": {},
    "split": {"world_size": 2},
    "preempt": {},
    "swa": {"groups": (KVGroup(), KVGroup("sliding", 32)), "num_gpu_blocks": 47},
}


def good_run(policy: str, kind: str) -> Iterator[tuple[Engine, Snap]]:
    """(engine, snapshot) after every operation of a real run."""
    cfg = {"num_cpu_blocks": 40, "num_gpu_blocks": 24, "policy": policy, **CONFIGS[kind]}
    e = Engine(make_scheduler(OffloadConfig(**{**SYNC, **cfg})))  # type: ignore[arg-type]
    for op in _script(kind):
        if op["op"] == "drain":
            _drain(e, split=kind == "split")
        else:
            e.apply(op)
        yield e, e.snapshot()


def pressure_run() -> Iterator[Snap]:
    """repair under CPU pressure: T2, a competing request, re-stores, finishes."""
    e = Engine(make_scheduler(OffloadConfig(num_cpu_blocks=7, policy="repair", **SYNC)))
    ops: list[dict[str, Any]] = [
        {"op": "add", "rid": "r", "family": 1, "prompt_len": 97, "max_tokens": 6},
        {"op": "add", "rid": "q", "family": 2, "prompt_len": 49, "max_tokens": 4},
        {"op": "step", "admit": ["r"], "chunk": 64}]
    ops += [{"op": "step", "chunk": 64}, {"op": "drain"}] * 2
    ops += [{"op": "step", "admit": ["q"]}, {"op": "drain"}]
    ops += [{"op": "step"}, {"op": "drain"}] * 4
    ops += [{"op": "finish", "rid": "q"}, {"op": "step"}, {"op": "drain"}, {"op": "step"}, {"op": "drain"},
            {"op": "finish", "rid": "r"}, {"op": "step"}, {"op": "drain"}]
    for op in ops:
        if op["op"] == "drain":
            _drain(e, split=False)
        else:
            e.apply(op)
        yield e.snapshot()


# -- quiet on good runs --------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("policy", POLICIES)
def test_quiet_on_good_runs(policy: str, kind: str) -> None:
    seen = {"store": 0, "load": 0, "reset_false": 0, "reset_true": 0}
    for e, snap in good_run(policy, kind):
        assert check(snap) == [], (e.last_op, [str(v) for v in check(snap)])
        sched = snap["scheduler"]
        seen["store"] += bool(sched["store_events"])
        seen["load"] += bool(sched["reqs_to_load"])
        if e.last_op == "reset":
            seen["reset_true" if e.last_result[1] else "reset_false"] += 1
    # the runs really exercise what the catalogue watches
    assert seen["store"] and seen["reset_false"] and seen["reset_true"], seen
    if kind != "swa":  # with a sliding-window group the GPU keeps enough of a's prefix
        assert seen["load"] and e.target.load_event_counter >= 1, seen


def test_repair_quiet_under_pressure_except_plain_completeness() -> None:
    lost_seen = restores = 0
    for snap in pressure_run():
        assert [str(v) for v in check(snap) if v.id != "C1"] == []
        ps = snap["scheduler"]["policy_state"]
        lost_seen += bool(ps["lost"])
        restores += ps["restores_last_plan"]
    assert lost_seen and restores  # the run did lose entries and repair them


# -- fires on bad snapshots ----------------------------------------------------------------

Mutator = Callable[[Snap], tuple[tuple[int, ...], tuple[str, ...]] | None]
"""Breaks one thing in a copy of a good snapshot; returns (blocks, requests) the violation
must name, or None when the snapshot lacks what the mutation needs."""


def _running(s: Snap) -> list[tuple[str, dict[str, Any]]]:
    return [(rid, r) for rid, r in s["engine"]["requests"].items() if r["status"] == "running"]


def _first_store_event(s: Snap) -> tuple[str, dict[str, list[int]]] | None:
    events = s["scheduler"]["store_events"]
    return next(iter(events.items())) if events else None


def m_i1(s: Snap) -> Any:
    q = s["cpu_pool"]["free_queue"]
    b = q[0]
    s["cpu_pool"]["ref_cnt"][b] = 1  # referenced, yet still queued
    return (b,), ()


def m_i2(s: Snap) -> Any:
    s["gpu_pool"]["free_queue"].insert(0, 0)
    return (0,), ()


def m_i3(s: Snap) -> Any:
    cached = s["cpu_pool"]["cached"]
    if not cached:
        return None
    b = next(iter(cached.values()))[0]
    s["cpu_pool"]["block_hash"][b] = None  # the map lists it, the block forgot its key
    return (b,), ()


def m_i4(s: Snap) -> Any:
    b = s["cpu_pool"]["free_queue"][-1]
    s["cpu_pool"]["free_queue"].remove(b)
    s["cpu_pool"]["ref_cnt"][b] = 1  # a ref nobody accounts for (I1 still holds)
    return (b,), ()


def m_i5(s: Snap) -> Any:
    running = _running(s)
    if not running:
        return None
    b = running[0][1]["table"][0][0]
    s["gpu_pool"]["ref_cnt"][b] += 1
    return (b,), ()


def m_i6(s: Snap) -> Any:
    ev = _first_store_event(s)
    if ev is None:
        return None
    c = ev[1]["cpu"][0]
    s["cpu_pool"]["ref_cnt"][c] = 0
    return (c,), ()


def m_i7(s: Snap) -> Any:
    if s["scheduler"]["lazy"]:
        return None
    listed = {b for t in s["scheduler"]["store_events"].values() for b in t["gpu"]}
    b = next(b for b in range(1, s["gpu_pool"]["num_blocks"]) if b not in listed
             and b not in s["scheduler"]["in_flight"])
    s["scheduler"]["in_flight"].append(b)
    return (b,), ()


def m_i8(s: Snap) -> Any:
    ev = _first_store_event(s)
    if ev is None:
        return None
    e, t = ev
    g = t["gpu"][0]
    t["gpu"].append(g)
    t["cpu"].append(s["cpu_pool"]["free_queue"][0])
    flags = s["engine"]["store_selection_confirmed"][e]
    flags.append(flags[0])
    return (g,), ()


def m_i9(s: Snap) -> Any:
    stores = s["scheduler"]["reqs_to_store"]
    if not stores:
        return None
    rid, st = next(iter(stores.items()))
    st["num_stored_blocks"][0] = len(st["block_ids"][0]) + 1
    return (), (rid,)


def m_i10(s: Snap) -> Any:
    ev = _first_store_event(s)
    if ev is None:
        return None
    e, t = ev
    s["engine"]["store_selection_confirmed"][e][0] = False  # planned before it was confirmed
    return (t["gpu"][0],), ()


def m_i11(s: Snap) -> Any:
    cached = s["cpu_pool"]["cached"]
    if not cached:
        return None
    b = next(iter(cached.values()))[0]
    s["engine"]["cpu_data"][b] = "f" * 16
    return (b,), ()


def m_i12(s: Snap) -> Any:
    for rid, r in _running(s):
        if r["num_computed_tokens"] >= 16:
            b = r["table"][0][0]
            s["engine"]["gpu_data"][b] = "e" * 16
            return (b,), (rid,)
    return None


def m_i13(s: Snap) -> Any:
    if not s["scheduler"]["store_events"]:
        return None
    s["scheduler"]["store_event_counter"] = 0
    return (), ()


def m_i14(s: Snap) -> Any:
    fin = [rid for rid, r in s["engine"]["requests"].items() if r["status"] == "finished"]
    if not fin:
        return None
    s["scheduler"]["pending_cpu_hits"][fin[0]] = {"blocks": [[]], "hit_len": 16, "num_computed_tokens": 0}
    return (), (fin[0],)


def m_i15(s: Snap) -> Any:
    eng = s["engine"]
    if eng["last_op"] != "reset" or not eng["last_result"][1]:
        return None
    eng["last_result"][1] = False  # no transfer was abandoned, yet reset says it failed
    return (), ()


def _hole(s: Snap) -> Any:
    """Drop the CPU entry of position 0 of a running request whose cursor passed it."""
    for rid, st in s["scheduler"]["reqs_to_store"].items():
        r = s["engine"]["requests"].get(rid)
        if r is None or r["status"] != "running" or st["finished"] or st["num_stored_blocks"][0] < 1:
            continue
        b = r["table"][0][0]
        key = s["gpu_pool"]["block_hash"][b]
        if key is None or key not in s["cpu_pool"]["cached"]:
            continue
        if any(b in t["gpu"] for t in s["scheduler"]["store_events"].values()):
            continue
        for c in s["cpu_pool"]["cached"].pop(key):
            s["cpu_pool"]["block_hash"][c] = None
        return (b,), (rid,)
    return None


def m_c1(s: Snap) -> Any:
    return _hole(s)


def m_c2(s: Snap) -> Any:
    s["scheduler"]["policy_state"]["lost"] = []
    return _hole(s)


def m_c3(s: Snap) -> Any:
    ev = _first_store_event(s)
    if ev is None or len(ev[1]["gpu"]) < 2:
        return None
    g1, g2 = ev[1]["gpu"][:2]
    s["gpu_pool"]["block_hash"][g2] = s["gpu_pool"]["block_hash"][g1]  # one key stored twice
    return (g1, g2), ()


def m_c4(s: Snap) -> Any:
    named = _hole(s)
    if named is None:
        return None
    s["engine"]["last_op"] = "step"
    s["engine"]["converging_step"] = True
    return named


def _plan(**facts: Any) -> dict[str, Any]:
    """An engine ``last_plan`` observation of a quiet step, with ``facts`` overriding."""
    plan = {"copies": 0, "new_work_copies": 0, "restore_copies": 0, "lost_keys": 0, "unlost_restores": [],
            "judged_cached_evicted": [], "live_useful_evicted": []}
    return {**plan, **facts}


def m_c3_count(s: Snap) -> Any:
    s["engine"]["last_plan"] = _plan(copies=3, restore_copies=3, lost_keys=2)  # more re-stores than losses
    return (), ()


def m_c5(s: Snap) -> Any:
    s["engine"]["last_plan"] = _plan(judged_cached_evicted=["0123456789abcdef:0"])
    return (), ()


def m_c6(s: Snap) -> Any:
    s["engine"]["last_plan"] = _plan(copies=1, new_work_copies=1, restore_copies=0,
                                     live_useful_evicted=["0123456789abcdef:0", "fedcba9876543210:0"])
    return (), ()


def m_c7(s: Snap) -> Any:
    fin = [rid for rid, r in s["engine"]["requests"].items() if r["status"] == "finished"]
    if not fin:
        return None
    s["engine"]["last_op"] = "finish"
    s["engine"]["finishes"] = [{"rid": fin[0], "keys": ["0123456789abcdef:0"], "fresh": [],
                                "unstored": ["0123456789abcdef:0"], "out_of_space": False}]
    return (), (fin[0],)


def m_c8(s: Snap) -> Any:
    """A finish whose flush left unstored a key that was on CPU nowhere before: C8 (and C7)."""
    if m_c7(s) is None:
        return None
    s["engine"]["finishes"][0]["fresh"] = ["0123456789abcdef:0"]
    return (), (s["engine"]["finishes"][0]["rid"],)


MUTATORS: dict[str, Mutator] = {
    "I1": m_i1, "I2": m_i2, "I3": m_i3, "I4": m_i4, "I5": m_i5, "I6": m_i6, "I7": m_i7, "I8": m_i8,
    "I9": m_i9, "I10": m_i10, "I11": m_i11, "I12": m_i12, "I13": m_i13, "I14": m_i14, "I15": m_i15,
    "C1": m_c1, "C2": m_c2, "C3": m_c3, "C4": m_c4, "C5": m_c5, "C6": m_c6, "C7": m_c7,
    "C8": m_c8,
}


def test_every_catalogue_entry_has_a_bad_snapshot() -> None:
    assert sorted(CATALOGUE) == sorted(MUTATORS)


def _good_snapshots(policy: str) -> list[Snap]:
    return [snap for kind in ("plain", "preempt") for _, snap in good_run(policy, kind)]


@pytest.fixture(scope="module")
def good_snapshots() -> dict[str, list[Snap]]:
    return {p: _good_snapshots(p) for p in POLICIES}


@pytest.mark.parametrize("inv", sorted(MUTATORS, key=lambda i: (i[0], int(i[1:]))))
@pytest.mark.parametrize("policy", POLICIES)
def test_fires_on_bad_snapshot(policy: str, inv: str, good_snapshots: dict[str, list[Snap]]) -> None:
    fired = 0
    for good in good_snapshots[policy]:
        assert check(good, [inv]) == []
        bad = copy.deepcopy(good)
        named = MUTATORS[inv](bad)
        if named is None:
            continue
        blocks, requests = named
        got = check(bad, [inv])
        assert len(got) == 1, [str(v) for v in got]
        v = got[0]
        assert isinstance(v, Violation)
        assert (v.id, v.blocks, v.requests) == (inv, blocks, requests), str(v)
        assert v.message
        fired += 1
    assert fired >= 1, f"no good snapshot could be broken for {inv}"


def m_c3_unlost(s: Snap) -> Any:
    s["engine"]["last_plan"] = _plan(copies=1, restore_copies=1, lost_keys=1, unlost_restores=["0123456789abcdef:0"])
    return (), ()


@pytest.mark.parametrize("mutate", [m_c3_count, m_c3_unlost])
def test_c3_fires_on_each_observed_fact(mutate: Mutator, good_snapshots: dict[str, list[Snap]]) -> None:
    good = good_snapshots["repair"][-1]
    bad = copy.deepcopy(good)
    mutate(bad)
    assert [v.id for v in check(bad, ["C3"])] == ["C3"]


def test_finish_flush_keys_follow_the_window_on_confirmed_tokens() -> None:
    """The keys a finish flush must cover (C7, C8) leave out the positions below the sliding window
    counted on the confirmed tokens, as ownership does. In this trace (found by a 10-minute
    campaign on vllm+repair) r0 finishes with 95 computed tokens, 2 of them placeholders: with a
    32-token window its g1 p3 is still inside the window of its 93 confirmed tokens, so repair
    owns it and keeps its cached entry. The flush runs out of space, and that entry is the one
    CPU block left free: the flush's own key, so C7 holds. A floor on the 95 computed tokens left
    p3 out of the keys and C7 fired."""
    from kvspec.adapters.targets import get_factory
    from kvspec.drivers import trace as trace_io
    from kvspec.drivers.harness import start_run

    tr = trace_io.read(Path(__file__).parent / "traces" / "oracle" / "c7-flush-window-on-confirmed-tokens.jsonl")
    run = start_run(tr.config, get_factory("model"), tr.oracle)
    assert not isinstance(run, Outcome)
    for op in tr.ops:
        found = run.apply(op)
        assert found is None, found.describe()
    (fin,) = run.engine.finishes
    assert fin["rid"] == "r0"
    assert fin["keys"] == ["00878bdfb6f388a4:0", "d141be77d493a010:1", "00878bdfb6f388a4:1"]
    assert fin["out_of_space"] and "d141be77d493a010:1" in run.engine.snapshot()["cpu_pool"]["cached"]


def test_a_finish_flush_is_confirmed_when_it_was_queued() -> None:
    """I10 asks that a stored block was confirmed when its store was planned; a finish flush is
    planned when the request finishes and sent at the next build. In this trace (found by fuzzing
    unpatched vLLM 0.33.0 at the manager level; the baseline model does the same) r12 finishes
    holding block 7 at a confirmed position (a GPU prefix hit, then a CPU load); at the next step
    the flush becomes store event 5 while r13, whose prompt fills that block, holds it one token
    short of confirmed. Judged at the build alone, I10 fired on a store of computed data."""
    from kvspec.adapters.targets import get_factory
    from kvspec.drivers import trace as trace_io
    from kvspec.drivers.harness import start_run

    tr = trace_io.read(Path(__file__).parent / "traces" / "oracle" / "i10-finish-flush-confirmed-when-queued.jsonl")
    assert tr.finding is not None and tr.finding["invariant"] == "I10"  # what the old rule reported
    run = start_run(tr.config, get_factory("model"), tr.oracle)
    assert not isinstance(run, Outcome)
    for op in tr.ops[:-1]:
        found = run.apply(op)
        assert found is None, found.describe()
    r13 = run.engine.snapshot()["engine"]["requests"]["r13"]  # before the step that plans the flush
    assert r13["table"][0][0] == 7 and r13["num_computed_tokens"] - r13["num_output_placeholders"] < 16
    found = run.apply(tr.ops[-1])
    assert found is None, found.describe()
    snap = run.engine.snapshot()
    assert snap["scheduler"]["store_events"]["5"]["gpu"] == [7]
    assert snap["engine"]["store_selection_confirmed"]["5"] == [True]


# -- the paths a check skips when a cheap count shows nothing to name ------------------------
# I2 and I3 name a store's label and the unlisted blocks only after a C-speed test found one;
# I4-I6 count abandoned loads with the pending ones. Each mutator breaks what such a test guards.


def m_i2_store(s: Snap) -> Any:
    ev = _first_store_event(s)
    if ev is None:
        return None
    ev[1]["gpu"][0] = 0  # a null block in a store event
    return (0,), ()


def m_i3_unlisted(s: Snap) -> Any:
    pool = s["cpu_pool"]
    b = next((b for b in pool["free_queue"] if pool["block_hash"][b] is None), None)
    if b is None:
        return None
    pool["block_hash"][b] = "0123456789abcdef:0"  # hashed, in no map entry
    return (b,), ()


def m_i3_destination(s: Snap) -> Any:
    ev = _first_store_event(s)
    if ev is None:
        return None
    c = ev[1]["cpu"][0]
    key = "0123456789abcdef:0"
    s["cpu_pool"]["block_hash"][c] = key  # a store destination already hashed (and listed, so only that)
    s["cpu_pool"]["cached"][key] = [c]
    return (c,), ()


def m_i4_abandoned_load(s: Snap) -> Any:
    pool = s["cpu_pool"]
    c = next((b for b in pool["free_queue"] if pool["block_hash"][b] is None), None)
    if c is None:
        return None
    # an abandoned load reads CPU block c, whose ref count does not count it
    s["scheduler"]["abandoned_reqs_to_load"]["gone"] = {"gpu": [], "cpu": [c], "load_event": 0, "finished": True}
    return (c,), ()


GUARDED = {"I2": m_i2_store, "I3": m_i3_unlisted, "I3 destination": m_i3_destination, "I4": m_i4_abandoned_load}


@pytest.mark.parametrize("case", sorted(GUARDED))
def test_fires_past_the_cheap_tests(case: str, good_snapshots: dict[str, list[Snap]]) -> None:
    inv = case.split()[0]
    fired = 0
    for good in good_snapshots["repair"]:
        bad = copy.deepcopy(good)
        named = GUARDED[case](bad)
        if named is None:
            continue
        got = check(bad, [inv])
        assert [(v.id, v.blocks, v.requests) for v in got] == [(inv, *named)], [str(v) for v in got]
        fired += 1
    assert fired >= 1, f"no good snapshot could be broken for {case}"
