"""``kvspec check-snapshot`` and ``kvspec snapshot`` for the second manager (vLLM's
CPUOffloadingManager): its snapshot format (``offloading-snapshot.schema.json``), the same
catalogue code judging a snapshot file as judges a replayed trace, malformed files refused by
field, and the oracle matched to the snapshot's manager."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from offloading_kit import generated_snapshots

from kvspec.adapters.targets import get_offloading_factory
from kvspec.cli import main
from kvspec.contract.snapshot_io import parse_snapshot, snapshot_issues
from kvspec.drivers import offloading_fuzz as ofz

ROOT = Path(__file__).resolve().parent.parent
TRACES = sorted((ROOT / "tests" / "traces" / "offloading").glob("*.jsonl"))


def _run(tmp_path: Path, trace: Path, *options: str, name: str = "s.json") -> Path:
    out = tmp_path / name
    assert main(["snapshot", str(trace), *options, "--out", str(out)]) == 0
    return out


def _check(capsys: pytest.CaptureFixture[str], path: Path, *options: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()  # what ran before (e.g. kvspec snapshot's line)
    code = main(["check-snapshot", str(path), "--json", *options])
    out = capsys.readouterr().out
    return code, json.loads(out.splitlines()[0])


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_a_snapshot_file_shows_the_finding_its_trace_records(trace: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The snapshot after the recorded operation, written to a file and read back by
    check-snapshot, violates the recorded invariant; the model at the same point violates nothing."""
    with trace.open() as fh:
        tr = ofz.read_trace(fh)
    assert tr.finding is not None and tr.finding["kind"] == "violation"
    at = str(tr.finding["op_index"])
    code, doc = _check(capsys, _run(tmp_path, trace, "--at", at), "--oracle", ",".join(tr.oracle))
    assert code == 1 and tr.finding["invariant"] in {v["id"] for v in doc["violations"]}
    code, doc = _check(capsys, _run(tmp_path, trace, "--at", at, "--target", "offloading", name="m.json"),
                       "--oracle", "all")
    assert code == 0 and doc["skipped"] == [] and len(doc["checked"]) == 10


@pytest.mark.parametrize("target", ["offloading", "offloading-impl"])
def test_every_snapshot_the_targets_write_follows_the_format(target: str) -> None:
    """Random connector-shaped traces, both policies, thresholds: after every operation the
    driver's snapshot (target state and observations) has no format issue."""
    seen_ops: set[str] = set()
    for seed, op, snap in generated_snapshots(get_offloading_factory(target), range(24)):
        seen_ops.add(snap["observed"]["last"].get("op", ""))
        assert snapshot_issues(snap) == [], (seed, op)
        assert snapshot_issues({k: v for k, v in snap.items() if k != "observed"}) == []
    assert {"lookup", "load", "store", "store_done", "new", "positions"} <= seen_ops


def _good() -> dict[str, Any]:
    with (ROOT / "examples" / "snapshots" / "offloading-lru-model.json").open() as fh:
        snap: dict[str, Any] = json.load(fh)
    return snap


def _store_last(s: dict[str, Any]) -> dict[str, Any]:
    last = {"op": "store", "offered": ["f2b1:0"], "pre_chunks": {}, "pre_order": [], "failed": False,
            "stored": ["f2b1:0"], "chunk_ids": [1], "evicted": []}
    s["observed"]["last"] = last
    return last


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(s: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = s
        for p in parents:
            node = node[p]
        node[leaf] = value
    return edit


MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown manager", _set("manager", "tiered"), r"manager: unknown manager \"tiered\"; known: simple"),
    ("policy of the other kind", _set("policy", {"arc": {"t1": [], "t2": [], "b1": [], "b2": [],
                                                        "target_t1_size": 0.0}}),
     r"policy: must hold exactly the configured policy's state \('lru'\)"),
    ("no policy state", _set("policy", {}), r"policy: must hold exactly the configured policy's state"),
    ("unknown policy", _set("config.policy", "fifo"), r"config.policy"),
    ("unranked LRU key", lambda s: s["policy"]["lru"]["ranks"].pop(s["policy"]["lru"]["order"][0]),
     r"policy.lru.order: key 'f2b0:0' has no entry in policy.lru.ranks"),
    ("ref count below the storing mark", _set("chunks.f2b0:0", {"chunk": 0, "ref_cnt": -2}), r"chunks"),
    ("a slot that is not an integer", _set("free_list", ["x"]), r"free_list\[0\]"),
    ("a key without a group", lambda s: s["chunks"].update({"nogroup": {"chunk": 2, "ref_cnt": 0}}), r"chunks"),
    ("connector section", _set("connector", {}), r"connector: a section of the OffloadingConnector harness"),
    ("unknown field", _set("extra", 1), r"extra"),
    ("a load count of 0", _set("observed.loads", {"f2b0:0": 0}), r"observed.loads"),
    ("an unknown last call", _set("observed.last", {"op": "evict"}), r"observed.last.op"),
    ("a store without its outputs", lambda s: _store_last(s).pop("stored"), r"observed.last.*stored"),
    ("a lookup answer that is not one", _set("observed.last", {"op": "lookup", "results": {"f2b0:0": "YES"}}),
     r"observed.last.results"),
    ("a negative slot", _set("num_allocated", -1), r"num_allocated"),
]


@pytest.mark.parametrize(("name", "edit", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_offloading_snapshot_is_refused_by_field(name: str, edit: Callable[[dict[str, Any]], None],
                                                             message: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    snap = _good()
    edit(snap)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(snap))
    assert main(["check-snapshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err), err


def test_the_good_example_parses_and_each_edit_is_a_real_change() -> None:
    parse_snapshot(json.dumps(_good()))
    for name, edit, _ in MALFORMED:
        snap = _good()
        edit(snap)
        assert snap != _good(), name


def test_the_oracle_is_the_snapshots_managers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_good()))
    assert main(["check-snapshot", str(path), "--oracle", "O1,I3"]) == 2
    assert "I3 belong(s) to the other manager's catalogue, not the offloading manager's" in capsys.readouterr().err
    assert main(["check-snapshot", str(path), "--oracle", "O11"]) == 2
    assert "O11 judge the OffloadingConnector harness's connector section" in capsys.readouterr().err
    code, doc = _check(capsys, path, "--ids", "O1,O9")
    assert code == 0 and doc["checked"] == ["O1", "O9"]
    bare = {k: v for k, v in _good().items() if k != "observed"}
    path.write_text(json.dumps(bare))
    assert main(["check-snapshot", str(path), "--oracle", "O2"]) == 2
    assert "O2 need(s) the observed section" in capsys.readouterr().err
    code, doc = _check(capsys, path)
    assert code == 0 and doc["skipped"] == ["O2", "O3", "O4", "O5", "O6", "O8"]
    assert doc["checked"] == ["O1", "O7", "O9", "O10"]
    assert main(["check-snapshot", str(ROOT / "examples" / "snapshots" / "model-baseline-fixme.json"),
                 "--oracle", "O1"]) == 2
    assert "O1 belong(s) to the other manager's catalogue, not the simple manager's" in capsys.readouterr().err


def test_an_unprotected_store_is_a_violation_in_a_file_as_in_a_replay(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A snapshot edited by hand into a state a correct manager never reaches: the key a store
    in flight writes has no chunk. check-snapshot measures it (O3), as the fuzzer would."""
    snap = _good()
    snap["observed"]["stores"] = ["f9b9:0"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(snap))
    code, doc = _check(capsys, path)
    assert code == 1 and [v["id"] for v in doc["violations"]] == ["O3"]


def test_snapshot_of_an_offloading_trace_refuses_a_bad_at(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = ROOT / "tests" / "traces" / "offloading" / "lru-evicts-newest.jsonl"
    assert main(["snapshot", str(trace), "--at", "99", "--out", str(tmp_path / "s.json")]) == 2
    assert "has 5 operation(s)" in capsys.readouterr().err and not (tmp_path / "s.json").exists()
    assert main(["snapshot", str(trace), "--target", "offloading", "--at", "0",
                 "--out", str(tmp_path / "s.json")]) == 0
    assert "after 1 operation(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["manager"] == "offloading"

