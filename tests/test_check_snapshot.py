"""``kvspec check-snapshot`` and the snapshot format (schema + kvspec.snapshot_io)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvspec.cli import main
from kvspec.errors import SnapshotFormatError
from kvspec.interfaces import KVGroup, OffloadConfig
from kvspec.model import make_scheduler
from kvspec.model.engine import Engine
from kvspec.snapshot_io import (
    SUPPORTED_KEYWORDS,
    _unsupported_keywords,
    load_schema,
    load_snapshot,
    snapshot_issues,
    validate_snapshot,
)

T2_OPS: list[dict[str, Any]] = [  # docs §8 T2: R's first two blocks are evicted by its own later stores
    {"op": "add", "rid": "R", "family": 1, "prompt_len": 97, "max_tokens": 8},
    {"op": "step", "admit": ["R"], "chunk": 64},
    {"op": "step", "chunk": 64},
    {"op": "report", "event": 0},
    {"op": "step", "chunk": 64},
    {"op": "report", "event": 1},
]

T1_OPS: list[dict[str, Any]] = [  # §8 T1 on a 3-block GPU: R is stored, its GPU copy evicted, R2 loads it
    {"op": "add", "rid": "R", "family": 1, "prompt_len": 33, "max_tokens": 1},
    {"op": "step", "admit": ["R"]}, {"op": "step"}, {"op": "report", "event": 0},
    {"op": "finish", "rid": "R"},
    {"op": "add", "rid": "Q", "family": 2, "prompt_len": 33, "max_tokens": 1},
    {"op": "step", "admit": ["Q"]}, {"op": "finish", "rid": "Q"}, {"op": "step"}, {"op": "report", "event": 1},
    {"op": "add", "rid": "R2", "family": 1, "prompt_len": 33, "max_tokens": 1},
    {"op": "step", "admit": ["R2"]},
]
T1_CONFIG = {"num_gpu_blocks": 4}


def run_engine(policy: str, ops: list[dict[str, Any]], **cfg: Any) -> Engine:
    if ops is T1_OPS or (ops and ops[: len(T1_OPS)] == T1_OPS):
        cfg = {**T1_CONFIG, **cfg}
    eng = Engine(make_scheduler(OffloadConfig(policy=policy, **cfg)))
    for op in ops:
        eng.apply(op)
    return eng


def write(tmp_path: Path, snap: object, name: str = "snap.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(snap), encoding="utf-8")
    return str(p)


# -- the format ------------------------------------------------------------------------------


def test_schema_uses_only_keywords_the_validator_implements() -> None:
    assert not list(_unsupported_keywords(load_schema()))
    assert list(_unsupported_keywords({"type": "object", "uniqueItems": True})) == ["uniqueItems"]
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
    assert main(["check-snapshot", path]) == 1
    lines = capsys.readouterr().out.splitlines()
    c1 = [ln for ln in lines if ln.startswith("C1: ")]
    assert len(c1) == 2 and all("requests R" in ln for ln in c1)
    assert "position 0" in c1[0] and "position 1" in c1[1]
    assert lines[-1].startswith("FAIL: 4 violation(s) of C1, C2")


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, _t2_snapshot())
    assert main(["check-snapshot", path, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert {v["id"] for v in doc["violations"]} == {"C1", "C2"}
    assert doc["violations"][0]["requests"] == ["R"] and doc["violations"][0]["blocks"] == [1]


def test_ids_restrict_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, _t2_snapshot())
    assert main(["check-snapshot", path, "--ids", "I1,I3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"ok": True, "violations": [], "checked": ["I1", "I3"], "skipped": []}
    assert main(["check-snapshot", path, "--ids", "C1"]) == 1
    assert main(["check-snapshot", path, "--ids", "I1,Z9"]) == 2
    assert "unknown invariant id(s) Z9" in capsys.readouterr().err


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
    assert main(["check-snapshot", write(tmp_path, eng.target.snapshot())]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "C1" in out


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
    proc = subprocess.run([sys.executable, "-m", "kvspec.cli", "check-snapshot", path, "--json"],
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

    from kvspec.errors import KVSpecError
    from kvspec.opgen import next_op, random_config_kwargs

    sections: set[str] = set()
    for seed in range(4):
        rng = random.Random(seed)
        cfg = OffloadConfig(policy=policy, **{**random_config_kwargs(rng), **extra})
        eng = Engine(make_scheduler(cfg))
        for _ in range(80):
            try:
                eng.apply(next_op(eng, rng))
            except KVSpecError:
                continue
            snap = json.loads(json.dumps(eng.snapshot()))
            issues = snapshot_issues(snap)
            assert issues == [], (seed, issues[:3])
            sched = snap["scheduler"]
            sections |= {k for k in ("pending_cpu_hits", "reqs_to_load", "store_events", "reqs_to_store",
                                     "abandoned_store_events", "pending_finished_stores") if sched[k]}
    assert {"store_events"} <= sections  # the runs did exercise the bookkeeping


def test_dump_round_trip_and_refusal(tmp_path: Path) -> None:
    from kvspec.snapshot_io import dump_snapshot

    snap = json.loads(json.dumps(run_engine("repair", T1_OPS).snapshot()))
    path = tmp_path / "s.json"
    dump_snapshot(snap, path)
    assert load_snapshot(path) == snap
    snap["cpu_pool"]["ref_cnt"] = "many"
    with pytest.raises(SnapshotFormatError, match=r"^cpu_pool\.ref_cnt: expected a list of integers"):
        dump_snapshot(snap, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()
