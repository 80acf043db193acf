"""Inputs that were accepted though they are wrong (issue 32): each is now refused with exit 2 (or
``KVSpecError`` at the API), one line naming what is wrong, state unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, InvalidOperationError, TraceError
from kvspec.drivers import trace as trace_io
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler
from kvspec.model.bugs import make_bug_target

TRACES = Path(__file__).parent / "traces"
FIXME = TRACES / "vllm-fixme.jsonl"
ADD = {"op": "add", "rid": "r0", "family": 1, "prompt_len": 20, "max_tokens": 2}


def _header(**extra: object) -> str:
    return json.dumps({"kvspec_trace": 3, "config": OffloadConfig(policy="baseline").to_json(), **extra})


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_duplicate_key_in_an_operation_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_header() + '\n{"op": "add", "rid": "a", "rid": "b", "family": 1, "prompt_len": 4}\n')
    code, _, err = _run(["replay", str(path)], capsys)
    assert code == 2 and "line 2" in err and 'duplicate key "rid"' in err


def test_a_duplicate_key_in_the_header_is_refused() -> None:
    text = '{"kvspec_trace": 3, "target": "model", "target": "impl", "config": ' + \
        json.dumps(OffloadConfig(policy="baseline").to_json()) + "}\n"
    with pytest.raises(TraceError, match=r'^line 1: .*duplicate key "target"'):
        trace_io.loads(text)


@pytest.mark.parametrize("index", [2, 1_000_000])
def test_a_finding_past_the_last_operation_is_refused(index: int, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    finding = {"kind": "violation", "op_index": index, "invariant": "C1", "exception": None}
    path = tmp_path / "t.jsonl"
    path.write_text(_header(finding=finding) + "\n" + json.dumps(ADD) + '\n{"op": "step", "admit": ["r0"]}\n')
    code, _, err = _run(["replay", str(path)], capsys)
    assert code == 2 and f"header.finding.op_index is {index}, but the trace has 2 operation(s)" in err
    with pytest.raises(TraceError, match="but the trace has 2"):
        trace_io.read(path)


def test_a_finding_past_the_end_is_refused_when_the_replay_stops_early(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """vllm-fixme's finding is at operation 6 of 7: recorded at 1,000,000, the replay stops at 6 and
    the rest of the file is read to judge the header."""
    lines = FIXME.read_text().splitlines()
    head = json.loads(lines[0])
    head["finding"]["op_index"] = 1_000_000
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    code, _, err = _run(["replay", str(path)], capsys)
    assert code == 2 and "op_index is 1000000" in err


def test_the_recorded_finding_at_the_last_operation_is_fine(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["replay", str(FIXME)], capsys)[0] == 1  # its finding: operation 6 of 7


def test_replay_on_a_bug_of_another_policy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """vllm-fixme was recorded under baseline; bug:self-eviction runs under repair (fuzz refuses
    the same pair)."""
    code, _, err = _run(["replay", str(FIXME), "--target", "bug:self-eviction"], capsys)
    assert code == 2 and "bug:self-eviction runs under policy 'repair'" in err and "'baseline'" in err


def test_a_bug_target_refuses_lazy_offload() -> None:
    with pytest.raises(ConfigError, match="with lazy_offload"):
        make_bug_target("vllm-fixme", OffloadConfig(policy="baseline", lazy_offload=True))
    make_bug_target("vllm-fixme", OffloadConfig(policy="baseline"))  # its own configuration: built


def test_bugs_only_empty_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["bugs", "--only", "", "--budget", "0.01"], capsys)
    assert code == 2 and "--only needs at least one bug name" in err


@pytest.mark.parametrize("rid", ["\x1b[2J", "bell\x07", "\u202eevil"])
def test_already_finished_escapes_the_request_id(rid: str) -> None:
    eng = Engine(make_scheduler(OffloadConfig(policy="repair")))
    eng.apply({**ADD, "rid": rid})
    eng.apply({"op": "finish", "rid": rid})
    before = json.dumps(eng.snapshot())
    with pytest.raises(InvalidOperationError) as exc:
        eng.apply({"op": "finish", "rid": rid})
    text = str(exc.value)
    assert "already finished" in text and rid not in text and repr(rid) in text
    assert json.dumps(eng.snapshot()) == before
