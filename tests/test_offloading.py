"""The second manager (vLLM's CPUOffloadingManager): its model's rules, its invariants O1-O10,
its known-bug variants, the error contract, traces and the CLI.

Real vLLM's manager is judged against the model in tests/test_vllm_offloading.py (vLLM venv).
"""

from __future__ import annotations

import copy
import io
import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvspec.contract.errors import KVSpecError, TraceError
from kvspec.contract.offloading import OffloadingConfig, OffloadingManagerTarget
from kvspec.drivers import offloading_fuzz as ofz
from kvspec.drivers.offloading import Driver, Generator, random_offloading_config
from kvspec.model.offloading import OffloadingManager, make_offloading_manager
from kvspec.model.offloading.bugs import OFFLOADING_BUGS
from kvspec.model.offloading.lru import LRUPolicy
from kvspec.oracle.catalogue import CONNECTOR_INVARIANTS, OFFLOADING_CATALOGUE, check

TRACES = Path(__file__).parent / "traces" / "offloading"
Snap = dict[str, Any]


def _manager(policy: str = "lru", n: int = 4, **kw: Any) -> OffloadingManager:
    m = make_offloading_manager(OffloadingConfig(num_chunks=n, policy=policy, **kw))
    m.on_new_request("a")
    return m


def _k(i: int, g: int = 0) -> tuple[str, int]:
    return (f"h{i}", g)


def _stored(m: OffloadingManager, keys: list[tuple[str, int]], req: str = "a") -> None:
    out = m.prepare_store(req, keys)
    assert out is not None
    m.complete_store(req, out.keys_to_store)


# -- the model's rules, one example each ------------------------------------------------------


def test_lru_evicts_a_requests_tail_first_and_a_finish_makes_its_head_most_recent() -> None:
    m = _manager(n=3)
    m.set_key_positions("a", [(_k(i), 16 * (i + 1)) for i in range(3)])
    _stored(m, [_k(0), _k(1), _k(2)])
    assert m.snapshot()["policy"]["lru"]["order"] == ["h2:0", "h1:0", "h0:0"]  # later positions first
    m.on_request_finished("a")
    assert m.snapshot()["policy"]["lru"]["order"] == ["h2:0", "h1:0", "h0:0"]  # head refreshed last
    m.on_new_request("b")
    out = m.prepare_store("b", [_k(9)])
    assert out is not None and out.evicted_keys == [_k(2)]


def test_store_protects_its_own_offered_keys_and_fails_when_only_they_are_evictable() -> None:
    m = _manager(n=2)
    _stored(m, [_k(0), _k(1)])
    assert m.prepare_store("a", [_k(0), _k(1), _k(2)]) is None  # h0, h1 offered: nothing to evict
    out = m.prepare_store("a", [_k(1), _k(2)])
    assert out is not None and out.evicted_keys == [_k(0)] and out.keys_to_store == [_k(2)]


def test_being_stored_is_pending_then_ready_and_a_failed_store_frees_its_slot() -> None:
    m = _manager(n=2)
    out = m.prepare_store("a", [_k(0), _k(1)])
    assert out is not None and out.chunk_ids == [0, 1]
    assert m.lookup("a", _k(0)) == "HIT_PENDING"
    m.complete_store("a", [_k(0)])
    m.complete_store("a", [_k(1)], success=False)
    assert (m.lookup("a", _k(0)), m.lookup("a", _k(1))) == ("HIT", "MISS")
    assert m.snapshot()["free_list"] == [1]
    out = m.prepare_store("a", [_k(2)])
    assert out is not None and out.chunk_ids == [1] and out.evicted_keys == []


def test_loads_pin_until_their_last_completion() -> None:
    m = _manager(n=1)
    _stored(m, [_k(0)])
    assert m.prepare_load("a", [_k(0)]) == [0]
    m.on_new_request("b")
    assert m.prepare_load("b", [_k(0)]) == [0]
    assert m.prepare_store("b", [_k(1)]) is None
    m.complete_load("a", [_k(0)])
    assert m.prepare_store("b", [_k(1)]) is None
    m.complete_load("b", [_k(0)])
    out = m.prepare_store("b", [_k(1)])
    assert out is not None and out.evicted_keys == [_k(0)]


def test_arc_promotes_a_reused_key_to_t2_and_a_ghost_hit_moves_the_target() -> None:
    m = _manager("arc", n=2)
    _stored(m, [_k(0), _k(1)])
    m.on_new_request("b")
    m.prepare_load("b", [_k(0)])
    m.complete_load("b", [_k(0)])
    m.on_request_finished("b")
    arc = m.snapshot()["policy"]["arc"]
    assert (arc["t1"], arc["t2"]) == (["h1:0"], ["h0:0"])
    out = m.prepare_store("a", [_k(2)])  # T1 (1 key) >= int(target 0): T1's h1 goes to B1
    assert out is not None and out.evicted_keys == [_k(1)]
    m.complete_store("a", [_k(2)])
    m.on_new_request("c")
    m.prepare_store("c", [_k(1)])  # c's store miss on the B1 ghost raises the target
    assert m.snapshot()["policy"]["arc"]["target_t1_size"] == 1.0


def test_store_threshold_admits_a_key_on_its_second_offer() -> None:
    m = _manager(n=2, store_threshold=2)
    out = m.prepare_store("a", [_k(0)])
    assert out is not None and out.keys_to_store == []
    out = m.prepare_store("a", [_k(0)])
    assert out is not None and out.keys_to_store == [_k(0)]


# -- the error contract: a refused call changes nothing ----------------------------------------


def _busy_manager() -> OffloadingManager:
    m = _manager(n=3)
    _stored(m, [_k(0)])
    m.prepare_store("a", [_k(1)])
    m.on_new_request("done")
    m.on_request_finished("done")
    return m


BAD_CALLS: list[tuple[str, Callable[[OffloadingManager], object]]] = [
    ("unknown request", lambda m: m.lookup("nobody", _k(0))),
    ("request twice", lambda m: m.on_new_request("a")),
    ("empty request id", lambda m: m.on_new_request("")),
    ("finished request stores", lambda m: m.prepare_store("done", [_k(5)])),
    ("finished request looks up", lambda m: m.lookup("done", _k(0))),
    ("key twice", lambda m: m.prepare_store("a", [_k(5), _k(5)])),
    ("malformed key", lambda m: m.prepare_store("a", [("h", -1)])),
    ("key not a tuple", lambda m: m.touch("a", ["h0:0"])),  # type: ignore[list-item]
    ("keys a string", lambda m: m.touch("a", "h0")),  # type: ignore[arg-type]
    ("load of a key not cached", lambda m: m.prepare_load("a", [_k(0), _k(7)])),
    ("load of a key being stored", lambda m: m.prepare_load("a", [_k(1)])),
    ("load completed, none in flight", lambda m: m.complete_load("a", [_k(0)])),
    ("negative position", lambda m: m.set_key_positions("a", [(_k(0), -1)])),
    ("success not a bool", lambda m: m.complete_store("a", [_k(1)], success=1)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("what", "call"), BAD_CALLS, ids=[w for w, _ in BAD_CALLS])
def test_a_refused_call_raises_a_kvspec_error_and_changes_nothing(what: str, call: Callable[[OffloadingManager],
                                                                                            object]) -> None:
    m = _busy_manager()
    before = m.snapshot()
    with pytest.raises(KVSpecError):
        call(m)
    assert m.snapshot() == before
    m._check()


def test_a_config_vllm_would_reject_is_refused() -> None:
    for bad in ({"num_chunks": 0}, {"policy": "fifo"}, {"store_threshold": True}, {"max_tracker_size": 0}):
        with pytest.raises(KVSpecError, match=next(iter(bad))):
            OffloadingConfig(**bad).validate()  # type: ignore[arg-type]


# -- invariants: quiet on the model, each fires on a snapshot broken by hand --------------------


def _random_snapshots(traces: int, length: int = 80) -> list[Snap]:
    out = []
    for seed in range(traces):
        rng = random.Random(seed)
        gen = Generator(rng)
        d = Driver(make_offloading_manager(random_offloading_config(rng)))
        for _ in range(length):
            for op in gen.next_ops():
                gen.feed(op, d.apply(op))
                assert isinstance(d.target, OffloadingManager)
                d.target._check()
                out.append(d.snapshot())
    return out


SNAPS = _random_snapshots(60)


def test_the_model_satisfies_every_offloading_invariant_after_every_operation() -> None:
    assert len(SNAPS) > 4000
    bad = [(i, v) for i, s in enumerate(SNAPS) for v in check(s)]
    assert bad == []


def _first(pred: Callable[[Snap], bool]) -> Snap:
    return copy.deepcopy(next(s for s in SNAPS if pred(s)))


def _store(s: Snap, evicting: bool = False) -> bool:
    last = s["observed"]["last"]
    return last.get("op") == "store" and not last["failed"] and bool(last["stored"]) and (
        bool(last["evicted"]) or not evicting)


def _break_o1(s: Snap) -> None:
    s["free_list"].append(next(iter(s["chunks"].values()))["chunk"])


def _break_o2(s: Snap) -> None:
    s["chunks"][s["observed"]["stores"][0]]["ref_cnt"] = 0


def _break_o3(s: Snap) -> None:
    del s["chunks"][s["observed"]["stores"][0]]


def _break_o4(s: Snap) -> None:
    key = s["observed"]["last"]["stored"][0]
    s["observed"]["last"]["pre_chunks"][key] = {"chunk": 0, "ref_cnt": -1}


def _break_o5(s: Snap) -> None:
    key = s["observed"]["last"]["evicted"][0]
    s["observed"]["last"]["pre_chunks"][key]["ref_cnt"] = 1


def _break_o6(s: Snap) -> None:
    s["observed"]["last"]["evicted"].append("ghost:0")


def _break_o7(s: Snap) -> None:
    s["counters"]["evictable"] += 1


def _break_o8(s: Snap) -> None:
    key = next(iter(s["observed"]["last"]["results"]))
    s["observed"]["last"]["results"][key] = "HIT" if s["observed"]["last"]["results"][key] != "HIT" else "MISS"


def _break_o9(s: Snap) -> None:
    s["policy"]["lru"]["order"].reverse()


def _break_o10(s: Snap) -> None:
    s["policy"]["arc"]["b1"].append(next(iter(s["chunks"])))


BREAKS: dict[str, tuple[Callable[[Snap], bool], Callable[[Snap], None]]] = {
    "O1": (lambda s: bool(s["chunks"]), _break_o1),
    "O2": (lambda s: bool(s["observed"]["stores"]), _break_o2),
    "O3": (lambda s: bool(s["observed"]["stores"]), _break_o3),
    "O4": (_store, _break_o4),
    "O5": (lambda s: _store(s, evicting=True), _break_o5),
    "O6": (_store, _break_o6),
    "O7": (lambda s: True, _break_o7),
    "O8": (lambda s: s["observed"]["last"].get("op") == "lookup", _break_o8),
    "O9": (lambda s: "lru" in s["policy"] and len(s["policy"]["lru"]["order"]) > 1, _break_o9),
    "O10": (lambda s: "arc" in s["policy"] and bool(s["chunks"]), _break_o10),
}


def test_every_manager_level_offloading_invariant_has_a_break() -> None:
    """The connector-level ones (O11-O15) are broken on vLLM's own snapshots, in the vLLM stage."""
    assert sorted(BREAKS) == sorted(i for i in OFFLOADING_CATALOGUE if i not in CONNECTOR_INVARIANTS)


@pytest.mark.parametrize("inv", list(BREAKS))
def test_each_offloading_invariant_fires_on_a_snapshot_broken_by_hand(inv: str) -> None:
    pick, breaker = BREAKS[inv]
    s = _first(pick)
    assert check(s, [inv]) == []
    breaker(s)
    assert [v.id for v in check(s, [inv])] != [], f"{inv} did not fire"


def test_check_judges_a_snapshot_by_its_own_managers_invariants_only() -> None:
    s = SNAPS[-1]
    assert {inv.manager for inv in OFFLOADING_CATALOGUE.values()} == {"offloading"}
    with pytest.raises(KVSpecError, match="I1 is not one of the offloading"):
        check(s, ["I1"])
    with pytest.raises(KVSpecError, match="unknown manager"):
        check({**s, "manager": "tiering"})


# -- known bugs: found by the invariants alone, and their shrunk traces -------------------------


@pytest.mark.parametrize("name", list(OFFLOADING_BUGS))
def test_each_offloading_bug_variant_is_found_by_its_oracle_alone(name: str) -> None:
    bug = OFFLOADING_BUGS[name]
    res = ofz.fuzz(bug.manager, budget=30.0, seed=1, oracle=bug.oracle, policy=bug.policy)
    assert res.finding is not None and res.finding.kind == "violation"
    assert res.finding.invariant in bug.oracle


@pytest.mark.parametrize("name", list(OFFLOADING_BUGS))
def test_shipped_offloading_bug_traces_reproduce_on_the_variant_and_are_clean_on_the_model(name: str) -> None:
    with (TRACES / f"{name}.jsonl").open() as fh:
        tr = ofz.read_trace(fh)
    assert tr.target == f"bug:{name}" and tr.finding is not None
    out = ofz.run(OFFLOADING_BUGS[name].manager, tr.config, tr.ops, tr.oracle)
    assert out.finding is not None and out.finding.invariant == tr.finding["invariant"]
    assert out.finding.op_index == tr.finding["op_index"]
    clean = ofz.run(make_offloading_manager, tr.config, tr.ops, tuple(OFFLOADING_CATALOGUE))
    assert clean.finding is None and not clean.rejected


def test_the_fuzzer_finds_nothing_on_the_model() -> None:
    res = ofz.fuzz(make_offloading_manager, budget=1.0, seed=7, oracle=tuple(OFFLOADING_CATALOGUE))
    assert res.finding is None and res.traces > 5 and res.rejected == 0


def test_a_crash_of_the_target_is_a_finding_not_a_rejection() -> None:
    class Crashes(OffloadingManager):
        def complete_load(self, req_id: str, keys: Any) -> None:
            raise RuntimeError("boom")

    res = ofz.fuzz(Crashes, budget=30.0, seed=3, oracle=tuple(OFFLOADING_CATALOGUE))
    assert res.finding is not None and res.finding.kind == "crash" and "RuntimeError" in res.finding.message
    assert res.trace[-1]["op"] == "load_done"


# -- traces --------------------------------------------------------------------------------


def _trace_text(**header: Any) -> str:
    base = {"kvspec_trace": 1, "manager": "offloading", "config": {"num_chunks": 2}, "target": "offloading",
            "oracle": ["O1"], "finding": None}
    return json.dumps({**base, **header}) + "\n" + json.dumps({"op": "new", "req": "a"}) + "\n"


@pytest.mark.parametrize(("text", "field"), [
    ('{"kvspec_trace": 1, "manager": "offloading", "manager": "x"}\n', "duplicate key"),
    (_trace_text(config={"num_chunks": 0}), "num_chunks"),
    (_trace_text(config={"num_chunks": 2, "extra": 1}), "extra"),
    (_trace_text(finding={"kind": "violation", "op_index": 1_000_000}), "op_index"),
    (_trace_text(oracle="O1"), "oracle"),
    ("[1]\n", "JSON object"),
    ("", "empty"),
])
def test_a_malformed_offloading_trace_is_refused_naming_what_is_wrong(text: str, field: str) -> None:
    with pytest.raises(TraceError, match=field):
        ofz.read_trace(io.StringIO(text))


def test_the_driver_refuses_an_unknown_operation_or_field_and_a_completion_not_in_flight() -> None:
    d = Driver(make_offloading_manager(OffloadingConfig()))
    d.apply({"op": "new", "req": "a"})
    before = d.snapshot()
    for op in ({"op": "evict"}, {"op": "touch", "req": "a", "keys": [], "when": 1},
               {"op": "store_done", "req": "a", "keys": [["h", 0]]},
               {"op": "load_done", "req": "a", "keys": [["h", 0]]}, {"op": "load", "req": "a", "keys": "h"}):
        with pytest.raises(KVSpecError):
            d.apply(op)
    assert d.snapshot() == before


# -- the command line ------------------------------------------------------------------------


def _kvspec(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_fuzz_and_replay_of_a_bug_variant_exit_1_and_the_model_exits_0(tmp_path: Path) -> None:
    r = _kvspec("fuzz", "--target", "bug:lru-evicts-newest", "--budget", "20", "--out", str(tmp_path), "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["finding"]["invariant"] == "O9" and doc["policy"] == "lru"
    trace = doc["finding"]["trace"]
    r = _kvspec("replay", trace, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["reproduces_recorded"] is True
    r = _kvspec("replay", trace, "--target", "offloading", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["finding"] is None
    r = _kvspec("fuzz", "--target", "offloading", "--budget", "1", "--out", str(tmp_path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["finding"] is None
    assert json.loads(r.stdout)["oracle"]["ids"] == [f"O{i}" for i in range(1, 11)]  # O11-O15 need a connector


@pytest.mark.parametrize("args", [
    ("--target", "offloading", "--policy", "repair"),
    ("--target", "model", "--policy", "arc"),
    ("--target", "offloading", "--oracle", "C1"),
    ("--target", "offloading", "--refine"),
    ("--target", "offloading", "--workers", "2"),
    ("--target", "bug:lru-evicts-newest", "--policy", "arc"),
])
def test_cli_fuzz_refuses_options_of_the_other_manager_with_exit_2(args: tuple[str, ...], tmp_path: Path) -> None:
    r = _kvspec("fuzz", *args, "--budget", "1", "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip()


def test_model_target_is_an_offloading_manager_target() -> None:
    assert isinstance(make_offloading_manager(OffloadingConfig()), OffloadingManagerTarget)


def test_spec_chapter_9_lists_every_offloading_invariant_and_variant_by_name() -> None:
    spec = (Path(__file__).parents[1] / "specs" / "SPEC.md").read_text()
    chapter = spec[spec.index("## 9. A second manager"):spec.index("## 10. Open points")]
    rows = [ln.split("|") for ln in chapter.splitlines() if ln.startswith("| O")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [(i, inv.title) for i, inv in OFFLOADING_CATALOGUE.items()]
    for name, bug in OFFLOADING_BUGS.items():
        assert f"| `{name}` |" in chapter and all(i in bug.oracle for i in
                                                 [ln.split("|")[3].strip() for ln in chapter.splitlines()
                                                  if ln.startswith(f"| `{name}` |")])


HISTORY = sorted((Path(__file__).parent / "traces" / "offloading_history").rglob("*.jsonl"))


@pytest.mark.parametrize("path", HISTORY, ids=lambda p: f"{p.parent.name}/{p.stem[-14:]}")
def test_history_findings_have_a_known_cause_and_are_clean_on_the_model(path: Path) -> None:
    """Findings of `kvspec history --manager offloading` on old releases: each is explained by a
    known cause of its release, and the model (vLLM 0.33.0's rules) makes no finding on the same
    calls (it may refuse one: a call the old release's own answers led the generator to make)."""
    from kvspec.commands._offloading import known_cause

    with path.open() as fh:
        tr = ofz.read_trace(fh)
    version = tr.target.partition("@")[2]
    assert tr.target.startswith("vllm-offloading@") and version == path.parent.name and tr.finding is not None
    assert known_cause(version, tr.finding["invariant"], tr.config.policy, tr.config.to_json())
    out = ofz.run(make_offloading_manager, tr.config, tr.ops, tuple(OFFLOADING_CATALOGUE))
    assert out.finding is None


def test_known_causes_end_at_their_fix_and_need_their_configuration() -> None:
    from kvspec.commands._offloading import known_cause

    assert known_cause("0.29.0", "O6", "arc", {"store_threshold": 1})
    assert not known_cause("0.31.0", "O6", "arc", {"store_threshold": 1})
    assert not known_cause("0.29.0", "O6", "lru", {"store_threshold": 1})
    assert known_cause("0.23.0", "O5", "lru", {"store_threshold": 2})
    assert not known_cause("0.23.0", "O5", "lru", {"store_threshold": 1})


@pytest.mark.parametrize(("args", "says"), [
    (("--workers", "2"), "one after another"),
    (("--versions", "0.19.1"), "predates request contexts"),
    (("--versions", "0.30.7"), "no venv for vLLM 0.30.7"),
    (("--raw",), "--raw is not available"),
])
def test_cli_history_of_the_offloading_manager_refuses_what_it_cannot_do(args: tuple[str, ...], says: str) -> None:
    r = _kvspec("history", "--manager", "offloading", "--budget", "1", *args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


def test_arc_b2_ghost_hit_lowers_the_target_by_at_least_one() -> None:
    from kvspec.model.offloading.arc import ARCPolicy
    from kvspec.model.offloading.policy import RequestContext

    arc = ARCPolicy(4)
    arc.target, arc.b2 = 3.0, {_k(1): None, _k(2): None}
    arc.on_store_miss([_k(1)], RequestContext("r"))  # |B1| / |B2| = 0: the step is max(1, 0) = 1
    assert arc.target == 2.0 and list(arc.b2) == [_k(2), _k(1)]
    arc.b1 = {_k(3): None}
    arc.on_store_miss([_k(3)], RequestContext("r"))  # |B2| / |B1| = 2
    assert arc.target == 4.0


def test_lru_self_check_refuses_a_rank_above_the_counter() -> None:
    m = _manager(n=2)
    _stored(m, [_k(0)])
    m._check()
    lru = m.policy
    assert isinstance(lru, LRUPolicy)
    lru.ranks[_k(0)] = (lru.next_rank + 1, 0)
    with pytest.raises(AssertionError):
        m._check()


def test_arc_self_check_refuses_either_ghost_list_over_capacity() -> None:
    for ghost in ("b1", "b2"):
        m = _manager("arc", n=1)
        m._check()
        setattr(m.policy, ghost, {_k(7): None, _k(8): None})
        with pytest.raises(AssertionError):
            m._check()


def test_cli_bugs_of_the_offloading_manager_gives_time_to_find_rows(tmp_path: Path) -> None:
    r = _kvspec("bugs", "--manager", "offloading", "--only", "lru-evicts-newest,offloading-failed-store-leak",
                "--seeds", "2", "--budget", "20", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["bug"] for row in rows] == ["lru-evicts-newest", "offloading-failed-store-leak"]
    assert [row["invariant"] for row in rows] == ["O9", "O1"]
    assert all(row["found"] and row["found_seeds"] == 2 and row["median_ops"] > 0 for row in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bug-lru-evicts-newest-O9.jsonl",
                                                         "bug-offloading-failed-store-leak-O1.jsonl"]
    r = _kvspec("bugs", "--only", "lru-evicts-newest", "--budget", "1")
    assert r.returncode == 2 and "--manager offloading" in r.stderr


def test_check_snapshot_reads_the_offloading_managers_snapshots(tmp_path: Path) -> None:
    m = _busy_manager()
    path = tmp_path / "offloading.json"
    path.write_text(json.dumps(m.snapshot()))
    r = _kvspec("check-snapshot", str(path))
    assert r.returncode == 0, r.stderr
    assert "claims of the offloading manager: 4 invariant(s) checked; skipped O2, O3, O4, O5, O6, O8" in r.stdout
