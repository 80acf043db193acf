"""Bad snapshot files and bad arguments to ``kvspec check-snapshot`` (issue 11).

Every case goes through the command line and must be *refused cleanly*: exit 2 (bad input or
usage), nothing on stdout, one line on stderr that names the field path (or the option, or the
file and position) and what is wrong, bounded in length whatever the size of the input (a 5 MB
request id is never echoed whole), never a traceback. With ``--json`` the same message is the
``error`` of ``{"ok": false, ...}`` on stdout.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from scenario_kit import SYNC, T1_CONFIG, T1_OPS

from kvspec.cli import main
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import EXIT_BAD_INPUT
from kvspec.contract.snapshot_io import MAX_DEPTH
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler

MESSAGE_LIMIT = 300  # characters of the one-line message, file name excluded
BIG = 5_000_000  # a 5 MB string

LIVE_OPS: list[dict[str, Any]] = [  # R is running with live store state and a store event in flight
    {"op": "add", "rid": "R", "family": 1, "prompt_len": 97, "max_tokens": 8},
    {"op": "step", "admit": ["R"], "chunk": 64}, {"op": "step", "chunk": 64},
]


def _engine(policy: str, ops: list[dict[str, Any]], **cfg: Any) -> Engine:
    eng = Engine(make_scheduler(OffloadConfig(policy=policy, **{**SYNC, **cfg})))
    for op in ops:
        eng.apply(op)
    return eng


_BASES: dict[str, dict[str, Any]] = {}


def base(kind: str = "engine") -> dict[str, Any]:
    """A deep copy of a real, valid snapshot: ``engine`` (repair after T1, with the engine
    section), ``target`` (the same without it: the target's own snapshot), ``live`` (repair
    with R's store state and store event 0 live)."""
    if kind not in _BASES:
        if kind == "live":
            _BASES[kind] = json.loads(json.dumps(_engine("repair", LIVE_OPS).snapshot()))
        else:
            eng = _engine("repair", T1_OPS, **T1_CONFIG)
            _BASES["engine"] = json.loads(json.dumps(eng.snapshot()))
            _BASES["target"] = json.loads(json.dumps(eng.target.snapshot()))
    return copy.deepcopy(_BASES[kind])


def nested(depth: int, leaf: Any = 0) -> Any:
    value: Any = leaf
    for _ in range(depth):
        value = [value]
    return value


def mutated(kind: str, change: Callable[[dict[str, Any]], Any]) -> str:
    snap = base(kind)
    change(snap)
    return json.dumps(snap)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(snap: dict[str, Any]) -> None:
        node = snap
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return change


def _deep_text() -> str:
    text = json.dumps(base("target"))
    return text[:-1] + ', "x-deep": ' + "[" * 1000 + "]" * 1000 + "}"


# (id, file content: str, bytes, or a callable giving one, extra arguments, needle in the message)
CASES: list[tuple[str, Any, list[str], str]] = [
    ("nesting-1000-deep", _deep_text, [], f"x-deep{'[0]' * 10}"),
    ("nesting-1000-deep-reason", _deep_text, [], f"nesting too deep (more than {MAX_DEPTH} levels"),
    ("nesting-100-deep-parsed", lambda: mutated("engine", _set(("engine", "last_result"), nested(100))), [],
     "engine.last_result[0][0][0]"),
    ("nesting-deep-among-small-lists",
     lambda: mutated("target", _set(("x-many",), [[i] for i in range(50)] + [[nested(MAX_DEPTH)]])), [],
     "x-many[50][0][0][0]"),
    ("nesting-100000-deep-top-level", "[" * 100_000 + "]" * 100_000, [], "[0][0][0]"),
    ("policy-yolo", lambda: mutated("target", _set(("scheduler", "policy"), "yolo")), [],
     'scheduler.policy: expected one of "baseline", "signal-rescan", "repair", got "yolo"'),
    ("engine-policy-yolo", lambda: mutated("engine", _set(("engine", "config", "policy"), "yolo")), [],
     "engine.config.policy: expected one of"),
    ("engine-policy-disagrees", lambda: mutated("engine", _set(("scheduler", "policy"), "baseline")), [],
     'engine.config.policy: is "repair" but scheduler.policy is "baseline"'),
    ("engine-config-invalid", lambda: mutated("engine", _set(("engine", "config", "lazy_offload"), True)), [],
     "engine.config: not a valid configuration"),
    ("ids-I5-without-engine", lambda: json.dumps(base("target")), ["--ids", "I5"],
     "--ids: I5 need(s) the engine section"),
    ("oracle-C1-I12-without-engine", lambda: json.dumps(base("target")), ["--oracle", "I1,C1,I12"],
     "--oracle: C1, I12 need(s) the engine section"),
    ("oracle-C99", lambda: json.dumps(base("engine")), ["--oracle", "C99"], "--oracle: unknown invariant id(s) 'C99'"),
    ("oracle-empty", lambda: json.dumps(base("engine")), ["--oracle", ""], "--oracle: no ids given"),
    ("oracle-commas", lambda: json.dumps(base("engine")), ["--oracle", " , ,"], "--oracle: no ids given"),
    ("ids-all-is-not-an-id", lambda: json.dumps(base("engine")), ["--ids", "all"],
     "--ids: unknown invariant id(s) 'all'"),
    ("ids-and-oracle", lambda: json.dumps(base("engine")), ["--ids", "I1", "--oracle", "all"],
     "--ids and --oracle: give one of them"),
    ("oracle-5MB-id", lambda: json.dumps(base("engine")), ["--oracle", "I" * BIG], "--oracle: unknown invariant id(s)"),
    ("missing-file", None, [], "cannot read: No such file or directory"),
    ("directory", "DIR", [], "cannot read: Is a directory"),
    ("non-utf8", b'{"gpu_pool": "\xff\xfe"}', [], "not UTF-8 text (invalid start byte at byte 14)"),
    ("invalid-json", '{"gpu_pool": {"num_blocks": 2,}}', [], "not valid JSON: line 1 column 31"),
    ("empty-file", "", [], "not valid JSON: line 1 column 1: Expecting value"),
    ("utf8-bom", "\ufeff{}", [], "not valid JSON: line 1 column 1: Unexpected UTF-8 BOM"),
    ("top-level-array", "[]", [], "(root): expected an object, got []"),
    ("top-level-number", "42", [], "(root): expected an object, got 42"),
    ("top-level-null", "null", [], "(root): expected an object, got null"),
    ("duplicate-key", '{"gpu_pool": 1, "gpu_pool": 2}', [], 'duplicate key "gpu_pool"'),
    ("nan", '{"gpu_pool": NaN}', [], "NaN is not a JSON number"),
    ("integer-of-5000-digits", '{"gpu_pool": {"num_blocks": ' + "7" * 5000 + "}}", [],
     "line 1 column 29: an integer of 5000 digits"),
    ("missing-section", lambda: mutated("engine", lambda s: s.pop("scheduler")), [],
     "scheduler: required field is missing"),
    ("unknown-top-level-field", lambda: mutated("engine", _set(("extra",), 1)), [],
     "extra: unknown field"),
    ("num-blocks-string", lambda: mutated("engine", _set(("gpu_pool", "num_blocks"), "4")), [],
     'gpu_pool.num_blocks: expected an integer >= 1, got "4"'),
    ("lazy-string-false", lambda: mutated("engine", _set(("scheduler", "lazy"), "false")), [],
     'scheduler.lazy: expected a boolean, got "false"'),
    ("ref-cnt-float", lambda: mutated("engine", _set(("cpu_pool", "ref_cnt", 2), 1.5)), [],
     "cpu_pool.ref_cnt[2]: expected an integer, got 1.5"),
    ("free-queue-bool", lambda: mutated("engine", _set(("cpu_pool", "free_queue", 0), True)), [],
     "cpu_pool.free_queue[0]: expected a block id (integer), got true"),
    ("request-status", lambda: mutated("engine", _set(("engine", "requests", "R2", "status"), 3)), [],
     "engine.requests.R2.status: expected one of"),
    ("store-cursor-string",
     lambda: mutated("live", _set(("scheduler", "reqs_to_store", "R", "num_stored_blocks"), "x")), [],
     'scheduler.reqs_to_store.R.num_stored_blocks: expected a list of integers, got "x"'),
    ("event-id-word",
     lambda: mutated("live", lambda s: s["scheduler"]["store_events"].__setitem__("first", {"gpu": [], "cpu": []})),
     [], 'scheduler.store_events.first: invalid key "first": expected an event id'),
    ("last-plan-wrong-type", lambda: mutated("engine", _set(("engine", "last_plan"), {"copies": -1})), [],
     "engine.last_plan: expected null or an object"),
    ("free-queue-out-of-range", lambda: mutated("engine", lambda s: s["cpu_pool"]["free_queue"].append(99)), [],
     "cpu_pool.free_queue[2]: block id 99 out of range 0..4"),
    ("in-flight-negative", lambda: mutated("live", _set(("scheduler", "in_flight"), [-1])), [],
     "scheduler.in_flight[0]: block id -1 out of range 0..15"),
    ("store-event-cpu-out-of-range",
     lambda: mutated("live", lambda s: s["scheduler"]["store_events"]["0"]["cpu"].__setitem__(0, 10**9)), [],
     "scheduler.store_events.0.cpu[0]: block id 1000000000 out of range 0..4"),
    ("lazy-cursor-out-of-range", lambda: mutated("engine", _set(("scheduler", "lazy_cursor"), 4)), [],
     "scheduler.lazy_cursor: block id 4 out of range 0..3"),
    ("table-out-of-range",
     lambda: mutated("engine", lambda s: s["engine"]["requests"]["R2"]["table"][0].__setitem__(0, 7)), [],
     "engine.requests.R2.table[0][0]: block id 7 out of range 0..3"),
    ("key-group-10-digits",
     lambda: mutated("engine", lambda s: s["cpu_pool"]["cached"].__setitem__("abc:1234567890", [1])), [],
     'cpu_pool.cached["abc:1234567890"]: invalid key "abc:1234567890": expected a cache key'),
    ("5MB-request-id",
     lambda: mutated("live", lambda s: s["scheduler"]["reqs_to_store"].__setitem__(
         "r" * BIG, {**s["scheduler"]["reqs_to_store"]["R"], "finished": "no"})), [],
     f'scheduler.reqs_to_store["rrrrrrrrrrrrrrrrrrrrrrrrrrrr"… ({BIG} chars)].finished: expected a boolean'),
    ("5MB-request-id-in-lost-record",
     lambda: mutated("engine", _set(("scheduler", "policy_state", "lost"), [["q" * BIG, 0, 0]])), [],
     "scheduler.policy_state.lost[0][0]: lost record names request \"qqqq"),
    ("5MB-key-string", lambda: mutated("engine", _set(("cpu_pool", "block_hash", 1), "k" * BIG)), [],
     'cpu_pool.block_hash[1]: expected a cache key "<hash>:<group>" or null, got "kkkk'),
    ("5MB-key-in-prefix-map",
     lambda: mutated("engine", lambda s: s["cpu_pool"]["cached"].__setitem__("h" * BIG, [1])), [],
     f'cpu_pool.cached["hhhhhhhhhhhhhhhhhhhhhhhhhhhh"… ({BIG} chars)]: invalid key "hhhh'),
]


def _write(tmp_path: Path, content: Any) -> str:
    if content is None:
        return str(tmp_path / "absent.json")
    if content == "DIR":
        (tmp_path / "adir").mkdir()
        return str(tmp_path / "adir")
    if callable(content):
        content = content()
    p = tmp_path / "bad.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return str(p)


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 20
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("content", "args", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_one_bounded_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    content: Any, args: list[str], needle: str) -> None:
    path = _write(tmp_path, content)
    assert main(["check-snapshot", path, *args]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.endswith("\n") and err.count("\n") == 1, err[:500]
    assert "Traceback" not in err
    assert err.startswith("kvspec check-snapshot: ")
    message = err.strip().replace(path, "FILE")
    assert needle in message, message
    assert len(message) < MESSAGE_LIMIT, message

    assert main(["check-snapshot", path, "--json", *args]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["ok"] is False and needle in doc["error"] and len(doc["error"].replace(path, "FILE")) < MESSAGE_LIMIT


def test_a_long_file_name_is_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = str(tmp_path / ("d" * 250) / "snap.json")
    assert main(["check-snapshot", name]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "cannot read" in err and len(err) < MESSAGE_LIMIT


def test_a_good_snapshot_with_a_5mb_request_id_is_accepted(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Long ids are not malformed; they are only never echoed whole."""
    snap = base("engine")
    snap["engine"]["loads_in_flight"] = []
    snap["x-owner"] = "o" * BIG
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(snap), encoding="utf-8")
    assert main(["check-snapshot", str(p)]) == 0
    assert len(capsys.readouterr().out) < MESSAGE_LIMIT + len(str(p))


@pytest.mark.parametrize("depth", [MAX_DEPTH - 2, MAX_DEPTH - 1])
def test_nesting_up_to_the_bound_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             depth: int) -> None:
    snap = base("target")
    snap["x-deep"] = nested(depth)  # the root object is level 1, x-deep level 2
    p = tmp_path / "deep.json"
    p.write_text(json.dumps(snap), encoding="utf-8")
    assert main(["check-snapshot", str(p)]) == 0, capsys.readouterr().err


def test_nesting_one_past_the_bound_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = base("target")
    snap["x-deep"] = nested(MAX_DEPTH)
    p = tmp_path / "deep.json"
    p.write_text(json.dumps(snap), encoding="utf-8")
    assert main(["check-snapshot", str(p)]) == EXIT_BAD_INPUT
    assert "x-deep[0][0]" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["nesting-1000-deep", "5MB-request-id"])
def test_bad_input_in_a_subprocess(tmp_path: Path, case: str) -> None:
    """The installed entry point, end to end: exit 2, one line, no traceback."""
    content = next(c[1] for c in CASES if c[0] == case)
    needle = next(c[3] for c in CASES if c[0] == case)
    path = _write(tmp_path, content)
    proc = subprocess.run([sys.executable, "-m", "kvspec.cli", "check-snapshot", path],
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr
    assert len(proc.stderr) < MESSAGE_LIMIT + len(path)
