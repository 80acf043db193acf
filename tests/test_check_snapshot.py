"""``kvspec check-snapshot`` and the snapshot format (schema + kvspec.contract.snapshot_io, whose schema
pass is kvspec.contract.schema_check)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from scenario_kit import SYNC, T1_CONFIG, T1_OPS

from kvspec.adapters.claims import resolve
from kvspec.cli import main
from kvspec.contract.config import POLICIES, KVGroup, OffloadConfig
from kvspec.contract.errors import SnapshotFormatError
from kvspec.contract.schema_check import SUPPORTED_KEYWORDS, unsupported_keywords
from kvspec.contract.snapshot_io import load_schema, load_snapshot, snapshot_issues, validate_snapshot
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import CATALOGUE

T2_OPS: list[dict[str, Any]] = [  # docs §8 T2: R's first two blocks are evicted by its own later stores
    {"op": "add", "rid": "R", "family": 1, "prompt_len": 97, "max_tokens": 8},
    {"op": "step", "admit": ["R"], "chunk": 64},
    {"op": "step", "chunk": 64},
    {"op": "report", "event": 0},
    {"op": "step", "chunk": 64},
    {"op": "report", "event": 1},
]



def run_engine(policy: str, ops: list[dict[str, Any]], **cfg: Any) -> Engine:
    if ops is T1_OPS or (ops and ops[: len(T1_OPS)] == T1_OPS):
        cfg = {**T1_CONFIG, **cfg}
    eng = Engine(make_scheduler(OffloadConfig(policy=policy, **{**SYNC, **cfg})))
    for op in ops:
        eng.apply(op)
    return eng


def write(tmp_path: Path, snap: object, name: str = "snap.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(snap), encoding="utf-8")
    return str(p)


# -- the format ------------------------------------------------------------------------------


def test_schema_uses_only_keywords_the_validator_implements() -> None:
    assert not list(unsupported_keywords(load_schema()))
    assert list(unsupported_keywords({"type": "object", "uniqueItems": True})) == ["uniqueItems"]
    assert "uniqueItems" not in SUPPORTED_KEYWORDS


@pytest.mark.parametrize("policy", ["baseline", "signal-rescan", "repair"])
@pytest.mark.parametrize("ops", [T1_OPS, T2_OPS], ids=["T1", "T2"])
def test_real_snapshots_follow_the_schema(policy: str, ops: list[dict[str, Any]]) -> None:
    eng = run_engine(policy, ops)
    if ops is T1_OPS:  # R2's CPU hit is registered and shipped as a load
        assert eng.snapshot()["scheduler"]["reqs_to_load"]["R2"]["load_event"] == 0
    for snap in (eng.snapshot(), eng.target.snapshot()):
        assert snapshot_issues(json.loads(json.dumps(snap))) == []


def test_lazy_and_multi_group_snapshots_follow_the_schema() -> None:
    lazy_ops = [{"op": "add", "rid": "R", "family": 1, "prompt_len": 33, "max_tokens": 1},
                {"op": "step", "admit": ["R"]}, {"op": "finish", "rid": "R"}, {"op": "step"}]
    lazy = run_engine("baseline", lazy_ops, lazy_offload=True)
    snap = json.loads(json.dumps(lazy.snapshot()))
    assert snap["scheduler"]["lazy"] and snap["scheduler"]["store_events"]  # the lazy walk stored
    assert snapshot_issues(snap) == []
    swa = run_engine("repair", T2_OPS[:-1], groups=(KVGroup(), KVGroup("sliding", 32)), num_gpu_blocks=32,
                     num_cpu_blocks=9)
    snap = json.loads(json.dumps(swa.snapshot()))
    assert len(snap["engine"]["config"]["groups"]) == 2
    assert snapshot_issues(snap) == []


def test_reset_snapshot_follows_the_schema() -> None:
    eng = run_engine("repair", [*T1_OPS, {"op": "reset"}])
    snap = json.loads(json.dumps(eng.snapshot()))
    assert snap["engine"]["last_op"] == "reset"
    assert snap["scheduler"]["abandoned_reqs_to_load"]  # R2's shipped load outlives the reset
    assert snap["engine"]["last_result"] == [False, False]  # GPU blocks in use; a load abandoned
    assert snapshot_issues(snap) == []


def _t2_snapshot() -> dict[str, Any]:
    return json.loads(json.dumps(run_engine("baseline", T2_OPS).snapshot()))


@pytest.mark.parametrize(
    ("mutate", "path", "why"),
    [
        (lambda s: s["scheduler"]["reqs_to_store"]["R"].__setitem__("num_stored_blocks", "x"),
         "scheduler.reqs_to_store.R.num_stored_blocks", 'expected a list of integers, got "x"'),
        (lambda s: s["scheduler"]["reqs_to_store"]["R"]["num_stored_blocks"].__setitem__(0, "x"),
         "scheduler.reqs_to_store.R.num_stored_blocks[0]", 'expected an integer, got "x"'),
        (lambda s: s["scheduler"]["reqs_to_store"]["R"].pop("finished"),
         "scheduler.reqs_to_store.R.finished", "required field is missing"),
        (lambda s: s["cpu_pool"]["block_hash"].__setitem__(1, "nogroup"),
         "cpu_pool.block_hash[1]", "cache key"),
        (lambda s: s["cpu_pool"]["free_queue"].append(99),
         "cpu_pool.free_queue[4]", "block id 99 out of range 0..4"),
        (lambda s: s["gpu_pool"]["ref_cnt"].pop(),
         "gpu_pool.ref_cnt", "one entry per block (16)"),
        (lambda s: s["scheduler"].__setitem__("surprise", 1),
         "scheduler.surprise", "unknown field"),
        (lambda s: s["scheduler"]["store_events"].__setitem__("first", {"gpu": [], "cpu": []}),
         "scheduler.store_events.first", "event id"),
        (lambda s: s["scheduler"]["store_events"].__setitem__("7", {"gpu": [1, 2], "cpu": [3]}),
         "scheduler.store_events.7", "differ in length"),
        (lambda s: s["engine"]["requests"]["R"].__setitem__("status", "sleeping"),
         "engine.requests.R.status", "expected one of"),
        (lambda s: s["engine"]["config"].__setitem__("num_cpu_blocks", 9),
         "engine.config.num_cpu_blocks", "cpu_pool.num_blocks is 5"),
        (lambda s: s.pop("scheduler"), "scheduler", "required field is missing"),
        (lambda s: s["engine"].update(last_op="reset", last_result=[True]),
         "engine.last_result", "exactly 2 items"),
        (lambda s: s["scheduler"]["policy_state"].update(restores_last_plan=1),
         "scheduler.policy_state.lost_keys_at_repair", "required when 'restores_last_plan'"),
    ],
)
def test_malformed_snapshots_name_the_field(mutate: Any, path: str, why: str) -> None:
    snap = _t2_snapshot()
    mutate(snap)
    with pytest.raises(SnapshotFormatError) as info:
        validate_snapshot(snap)
    first = str(info.value)
    assert first.startswith(f"{path}: "), first
    assert why in first


def test_deep_python_values_are_refused_without_recursion() -> None:
    """validate_snapshot on an in-memory value nested far deeper than Python's recursion limit:
    a SnapshotFormatError naming the path, never a RecursionError."""
    deep: Any = []
    for _ in range(20_000):
        deep = [deep]
    snap = _t2_snapshot()
    snap["engine"]["last_result"] = deep
    with pytest.raises(SnapshotFormatError, match=r"^engine\.last_result\[0\]\[0\].*nesting too deep"):
        validate_snapshot(snap)
    assert snapshot_issues({"x-": deep})[0].reason.startswith("nesting too deep")


def test_fast_paths_report_the_first_bad_element_exactly() -> None:
    """Long lists are checked in bulk; a bad element anywhere is still reported at its index
    with the general message (bool is not an integer; an int subclass is)."""
    import enum

    class Small(enum.IntEnum):
        ONE = 1

    snap = _t2_snapshot()
    n = 5000
    for pool in ("gpu_pool", "cpu_pool"):
        snap[pool].update(num_blocks=n, ref_cnt=[0] * n, block_hash=[None] * n,
                          free_queue=list(range(1, n)), cached={})
    snap["engine"]["config"].update(num_gpu_blocks=n, num_cpu_blocks=n)
    snap["engine"].update(gpu_data=[None] * n, cpu_data=[None] * n, requests={}, store_selection_confirmed={},
                          reports_left={}, loads_in_flight=[])
    snap["scheduler"].update(reqs_to_store={}, store_events={}, store_event_to_reqs={}, in_flight=[],
                             store_event_pending_counts={})
    assert snapshot_issues(snap) == []
    snap["gpu_pool"]["ref_cnt"][4321] = Small.ONE  # an int subclass: the bulk check falls back, and accepts it
    assert snapshot_issues(snap) == []
    snap["cpu_pool"]["free_queue"][3000] = True
    snap["cpu_pool"]["block_hash"][4000] = "nogroup"
    snap["cpu_pool"]["block_hash"][4001] = "a:1"
    issues = [str(i) for i in snapshot_issues(snap)]
    assert issues == ["cpu_pool.block_hash[4000]: expected a cache key \"<hash>:<group>\" or null, got \"nogroup\"",
                      "cpu_pool.free_queue[3000]: expected a block id (integer), got true"]
    snap["cpu_pool"]["block_hash"][4000] = None
    snap["cpu_pool"]["free_queue"][3000] = 3001
    snap["cpu_pool"]["cached"] = {f"h{i}:0": [i] for i in range(1, 200)}
    snap["cpu_pool"]["cached"]["h7:0"] = []
    snap["cpu_pool"]["cached"]["nokey"] = [3]
    assert [str(i) for i in snapshot_issues(snap)] == [
        'cpu_pool.cached["h7:0"]: expected at least 1 item(s), got 0',
        'cpu_pool.cached.nokey: invalid key "nokey": expected a cache key "<hash>:<group>"']


def test_extension_fields_are_allowed() -> None:
    snap = _t2_snapshot()
    snap["x-engine-name"] = "mine"
    snap["engine"]["x-note"] = {"anything": [1]}
    assert snapshot_issues(snap) == []


def test_load_snapshot_refuses_bad_json_and_duplicate_keys(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpu_pool": {"num_blocks": 2,}}', encoding="utf-8")
    with pytest.raises(SnapshotFormatError, match=r"not valid JSON: line 1 column"):
        load_snapshot(bad)
    dup = tmp_path / "dup.json"
    dup.write_text('{"gpu_pool": 1, "gpu_pool": 2}', encoding="utf-8")
    with pytest.raises(SnapshotFormatError, match='duplicate key "gpu_pool"'):
        load_snapshot(dup)
    nan = tmp_path / "nan.json"
    nan.write_text('{"a": NaN}', encoding="utf-8")
    with pytest.raises(SnapshotFormatError, match="NaN is not a JSON number"):
        load_snapshot(nan)


# -- the command -----------------------------------------------------------------------------


def test_good_snapshot_from_a_real_run_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = run_engine("repair", T1_OPS).snapshot()
    assert main(["check-snapshot", write(tmp_path, snap)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: no invariant violated")


def test_t2_under_baseline_exits_1_naming_c1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, _t2_snapshot())
    assert main(["check-snapshot", path, "--oracle", "all"]) == 1
    lines = capsys.readouterr().out.splitlines()
    c1 = [ln for ln in lines if ln.startswith("C1: ")]
    assert len(c1) == 2 and all("requests R" in ln for ln in c1)
    assert "position 0" in c1[0] and "position 1" in c1[1]
    assert lines[-1].startswith("FAIL: 4 violation(s) of C1, C2")
    assert "(oracle all: " in lines[-1]


def test_default_oracle_is_the_policys_claims(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """T2's holes are the FIXME baseline does not claim to fix (C1, C2 are not its claims): by
    default the snapshot is judged by what scheduler.policy claims under engine.config, clean."""
    snap = _t2_snapshot()
    path = write(tmp_path, snap)
    assert main(["check-snapshot", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: no invariant violated") and "(oracle claims of baseline: " in out
    assert main(["check-snapshot", path, "--oracle", "claims", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    want = resolve(None, OffloadConfig.from_json(snap["engine"]["config"]))
    assert doc["oracle"] == {"name": "claims of baseline", "ids": list(want.ids)}
    assert doc["checked"] == list(want.ids) and doc["skipped"] == []
    assert "C1" not in doc["checked"] and "I8" in doc["checked"]


def test_default_oracle_of_a_multi_group_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swa = run_engine("baseline", T2_OPS[:-1], groups=(KVGroup(), KVGroup("sliding", 32)), num_gpu_blocks=32,
                     num_cpu_blocks=9)
    assert main(["check-snapshot", write(tmp_path, swa.snapshot()), "--json"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert "I8" not in doc["oracle"]["ids"] and "I10" not in doc["oracle"]["ids"]  # full attention only
    rep = run_engine("repair", T1_OPS)
    assert main(["check-snapshot", write(tmp_path, rep.snapshot()), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["oracle"]["name"] == "claims of repair" and "C2" in doc["checked"]


def test_schema_enumerates_the_policies() -> None:
    defs = load_schema()["$defs"]
    assert defs["policy"]["enum"] == list(POLICIES)
    assert defs["scheduler"]["properties"]["policy"]["$ref"] == "#/$defs/policy"
    assert defs["engine"]["properties"]["config"]["properties"]["policy"]["$ref"] == "#/$defs/policy"


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, _t2_snapshot())
    assert main(["check-snapshot", path, "--json", "--oracle", "all"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert doc["oracle"] == {"name": "all", "ids": list(CATALOGUE)}
    assert {v["id"] for v in doc["violations"]} == {"C1", "C2"}
    assert doc["violations"][0]["requests"] == ["R"] and doc["violations"][0]["blocks"] == [1]


def test_ids_restrict_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, _t2_snapshot())
    assert main(["check-snapshot", path, "--ids", "I1,I3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"ok": True, "oracle": {"name": "I1,I3", "ids": ["I1", "I3"]}, "violations": [],
                   "checked": ["I1", "I3"], "skipped": []}
    assert main(["check-snapshot", path, "--oracle", "I1,I3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == doc  # --ids is a synonym of an --oracle id list
    assert main(["check-snapshot", path, "--ids", "C1"]) == 1
    assert main(["check-snapshot", path, "--ids", "I1,Z9"]) == 2
    assert "unknown invariant id(s) 'Z9'" in capsys.readouterr().err
    assert main(["check-snapshot", path, "--ids", "I1", "--oracle", "I1"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_tampered_pool_exits_1_with_i1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = run_engine("repair", T1_OPS).snapshot()
    queued = snap["cpu_pool"]["free_queue"][0]
    snap["cpu_pool"]["ref_cnt"][queued] = 1  # referenced, yet still in the free queue
    assert main(["check-snapshot", write(tmp_path, snap), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    i1 = [v for v in doc["violations"] if v["id"] == "I1"]
    assert i1 and i1[0]["blocks"] == [queued]


def test_without_engine_section_engine_invariants_are_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    eng = run_engine("baseline", T2_OPS)
    path = write(tmp_path, eng.target.snapshot())
    assert main(["check-snapshot", path]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "I5" in out and "no engine section" in out
    assert main(["check-snapshot", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # baseline claims I8 and I10 only for full attention: without a config, neither is in the oracle
    assert "I8" not in doc["oracle"]["ids"] and "I10" not in doc["oracle"]["ids"]
    assert doc["skipped"] == [i for i in doc["oracle"]["ids"] if CATALOGUE[i].needs_engine]
    assert "I5" in doc["skipped"] and "I1" in doc["checked"]
    assert main(["check-snapshot", path, "--oracle", "all"]) == 0  # 'all' skips and says so, too
    assert "C1" in capsys.readouterr().out


def test_explicit_engine_ids_without_engine_section_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, run_engine("baseline", T2_OPS).target.snapshot())
    for option in ("--ids", "--oracle"):
        assert main(["check-snapshot", path, option, "I1,I5,C1"]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert f"{option}: I5, C1 need(s) the engine section" in captured.err
    assert main(["check-snapshot", path, "--ids", "I1"]) == 0


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not valid JSON: line 1 column 2"),
        ("[]", "(root): expected an object, got []"),
        (None, "scheduler.reqs_to_store.R.num_stored_blocks: expected a list of integers"),
    ],
)
def test_malformed_files_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              content: str | None, needle: str) -> None:
    if content is None:
        snap = _t2_snapshot()
        snap["scheduler"]["reqs_to_store"]["R"]["num_stored_blocks"] = "x"
        content = json.dumps(snap)
    p = tmp_path / "m.json"
    p.write_text(content, encoding="utf-8")
    assert main(["check-snapshot", str(p)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and needle in err and "Traceback" not in err
    assert main(["check-snapshot", str(p), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and needle in doc["error"]


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-snapshot", str(tmp_path / "absent.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(obj, dict):
        return [path] + [p for k, v in obj.items() for p in _leaves(v, (*path, k))]
    if isinstance(obj, list):
        return [path] + [p for i, v in enumerate(obj) for p in _leaves(v, (*path, i))]
    return [path]


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    return obj


@pytest.mark.parametrize("junk", ["x", -3, 10**6, None, [], {}, [7], True])
def test_no_mutation_ever_crashes_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              junk: Any) -> None:
    """Replace every node of a real snapshot (with pins, loads and events in it) in turn by
    junk: the command answers 0, 1 or 2, never with an exception."""
    base = json.loads(json.dumps(run_engine("repair", T1_OPS).snapshot()))
    codes = set()
    for path in _leaves(base):
        snap = _set(copy.deepcopy(base), path, copy.deepcopy(junk))
        p = write(tmp_path, snap)
        rc = main(["check-snapshot", p])
        assert rc in (0, 1, 2), path
        codes.add(rc)
        capsys.readouterr()
    assert 2 in codes


def test_subprocess_run(tmp_path: Path) -> None:
    path = write(tmp_path, _t2_snapshot())
    proc = subprocess.run([sys.executable, "-m", "kvspec.cli", "check-snapshot", path, "--json", "--oracle", "all"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert not doc["ok"] and doc["violations"][0]["id"] == "C1"


@pytest.mark.parametrize(
    ("policy", "extra"),
    [("baseline", {}), ("signal-rescan", {}), ("repair", {}), ("baseline", {"lazy_offload": True}),
     ("repair", {"groups": (KVGroup(), KVGroup("sliding", 32))}),
     ("signal-rescan", {"groups": (KVGroup(), KVGroup("sliding", 32))})],
    ids=["baseline", "signal-rescan", "repair", "lazy", "repair-swa", "rescan-swa"],
)
def test_every_snapshot_of_random_runs_follows_the_schema(policy: str, extra: dict[str, Any]) -> None:
    """Pins, loads, preemptions, resets, abandoned transfers: whatever the engine model reaches,
    its snapshot (and the target's own) is accepted, so the format covers all of the model."""
    import random
    from dataclasses import replace

    from kvspec.drivers.harness import Run
    from kvspec.drivers.opgen import OpGenerator, RandomChoices, random_config

    sections: set[str] = set()
    for seed in range(4):
        choices = RandomChoices(random.Random(seed))
        cfg = replace(random_config(choices, policy), **extra)
        run, gen = Run(cfg, make_scheduler, ()), OpGenerator(cfg, choices)
        for _ in range(80):
            assert run.apply(gen.next_op(run.engine)) is None  # generated, so accepted and judged
            snap = json.loads(json.dumps(run.snapshot))
            issues = snapshot_issues(snap)
            assert issues == [], (seed, issues[:3])
            sched = snap["scheduler"]
            sections |= {k for k in ("pending_cpu_hits", "reqs_to_load", "store_events", "reqs_to_store",
                                     "abandoned_store_events", "pending_finished_stores") if sched[k]}
    assert {"store_events"} <= sections  # the runs did exercise the bookkeeping


def test_dump_round_trip_and_refusal(tmp_path: Path) -> None:
    from kvspec.contract.snapshot_io import dump_snapshot

    snap = json.loads(json.dumps(run_engine("repair", T1_OPS).snapshot()))
    path = tmp_path / "s.json"
    dump_snapshot(snap, path)
    assert load_snapshot(path) == {"format_version": 1, **snap}  # the version written first
    snap["cpu_pool"]["ref_cnt"] = "many"
    with pytest.raises(SnapshotFormatError, match=r"^cpu_pool\.ref_cnt: expected a list of integers"):
        dump_snapshot(snap, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


# -- big snapshots: the validator's fast paths -----------------------------------------------


def big_snapshot(n: int) -> dict[str, Any]:
    """A realistic snapshot of 10^5-10^6-block pools: GPU and CPU pools of ``n`` blocks, mostly
    free, a few thousand cached keys on each, four long requests (one finished, its flush
    stored), live store state, and the engine section (per-block content lists of ``n``)."""
    eng = Engine(make_scheduler(OffloadConfig(policy="repair", num_gpu_blocks=n, num_cpu_blocks=n,
                                              max_num_batched_tokens=4096)))
    ops: list[dict[str, Any]] = [{"op": "add", "rid": f"R{i}", "family": i + 1, "prompt_len": 8000, "max_tokens": 4}
                                 for i in range(4)]
    ops += [{"op": "step", "admit": ["R0", "R1", "R2", "R3"], "chunk": 4096}]
    ops += [{"op": "step", "chunk": 4096}] * 3
    ops += [{"op": "report", "event": 0}, {"op": "report", "event": 1}, {"op": "finish", "rid": "R0"},
            {"op": "step", "chunk": 4096}]
    for op in ops:
        eng.apply(op)
    return json.loads(json.dumps(eng.snapshot()))


def _check_big(n: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = big_snapshot(n)
    gpu, cpu = snap["gpu_pool"], snap["cpu_pool"]
    assert gpu["num_blocks"] == cpu["num_blocks"] == n and len(snap["engine"]["gpu_data"]) == n
    assert len(gpu["free_queue"]) > n - 3000 and len(gpu["cached"]) >= 1000 and len(cpu["cached"]) >= 1000
    path = write(tmp_path, snap, "big.json")
    assert main(["check-snapshot", path, "--oracle", "all"]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.startswith("ok: no invariant violated")

    queued = gpu["free_queue"][len(gpu["free_queue"]) // 2]  # one element: a queued block referenced
    gpu["ref_cnt"][queued] = 1
    assert main(["check-snapshot", write(tmp_path, snap, "big.json"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert ("I1", [queued]) in [(v["id"], v["blocks"]) for v in doc["violations"]]
    assert all(v["blocks"] == [queued] for v in doc["violations"])  # I5 sees the same stray reference
    gpu["ref_cnt"][queued] = 0

    at = n - 7  # one element out of range deep in a long list: exit 2 naming its path
    old_free, cpu["free_queue"][at] = cpu["free_queue"][at], n
    assert main(["check-snapshot", write(tmp_path, snap, "big.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"cpu_pool.free_queue[{at}]: block id {n} out of range 0..{n - 1}"), err
    cpu["free_queue"][at] = old_free

    snap["engine"]["gpu_data"][n - 3] = 5  # a wrong type at the end of a nullable-string list
    assert main(["check-snapshot", write(tmp_path, snap, "big.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"engine.gpu_data[{n - 3}]: expected a string or null, got 5"), err


def test_check_snapshot_of_1e5_block_pools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _check_big(10**5, tmp_path, capsys)


@pytest.mark.slow
def test_check_snapshot_of_1e6_block_pools(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The scale issue 11 names (10^6-block pools: was ~100 µs per element; ~15-20 s for this
    test, which builds and checks the snapshot four times); no timing is asserted here (measure
    with ``time kvspec check-snapshot``), only correctness at that size. Slow: it runs when the
    marker expression selects it (``pytest -m slow``; the default run deselects it)."""
    _check_big(10**6, tmp_path, capsys)
