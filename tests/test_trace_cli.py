"""Trace files and the fuzz/replay/bugs commands: good traces replay, bad ones give one clear
line with the line number and exit code 2, never a traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import TraceError
from kvspec.drivers import trace as trace_io

TRACES = Path(__file__).parent / "traces"
HEADER = json.dumps({"kvspec_trace": 1, "config": OffloadConfig(policy="baseline").to_json(), "seed": 0})


def write(tmp_path, text, name="t.jsonl"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_round_trip(tmp_path):
    tr = trace_io.read(TRACES / "vllm-fixme.jsonl")
    again = trace_io.loads(tr.dumps())
    assert again.ops == tr.ops and again.config == tr.config and again.seed == tr.seed


@pytest.mark.parametrize("text, line, words", [
    (HEADER + "\n{\"op\": \"add\", \"rid\": \"a\"\n", 2, "invalid JSON"),
    (HEADER + "\n{\"op\": \"explode\"}\n", 2, "unknown operation"),
    (HEADER + "\n{\"op\": \"add\", \"rid\": \"a\", \"family\": \"x\", \"prompt_len\": 16}\n", 2, "must be an integer"),
    (HEADER + "\n{\"op\": \"add\", \"rid\": \"a\", \"family\": 0, \"prompt_len\": 99999999999}\n", 2, "outside"),
    (HEADER + "\n{\"op\": \"step\", \"admit\": [1, 2]}\n", 2, "list of request ids"),
    (HEADER + "\n{\"op\": \"report\"}\n", 2, "needs argument 'event'"),
    (HEADER + "\n{\"op\": \"reset\", \"force\": true}\n", 2, "no argument 'force'"),
    (json.dumps({"kvspec_trace": 7, "config": {}}) + "\n", 1, "newer"),
    (json.dumps({"config": {}}) + "\n", 1, "header"),
    (json.dumps({"kvspec_trace": 1, "config": {"block_size": 16, "num_gpu_blocks": 10 ** 12,
                                               "num_cpu_blocks": 5}}) + "\n", 1, "outside"),
    (json.dumps({"kvspec_trace": 1, "config": {"block_size": 16, "num_gpu_blocks": 16,
                                               "num_cpu_blocks": 5, "policy": "magic"}}) + "\n", 1, "unknown policy"),
    ("", 1, "empty"),
    (HEADER + "\n[1, 2]\n", 2, "JSON object"),
])
def test_bad_traces_name_the_line(tmp_path, text, line, words, capsys):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as err:
        trace_io.read(path)
    assert err.value.line == line and words in str(err.value)
    assert main(["replay", path]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and f"line {line}" in out.err and "Traceback" not in out.err


def test_truncated_trace(tmp_path):
    text = (TRACES / "vllm-fixme.jsonl").read_text()
    path = write(tmp_path, text[: len(text) - 20])
    with pytest.raises(TraceError) as err:
        trace_io.read(path)
    assert err.value.line == len(text.splitlines()) and "JSON" in str(err.value)


def test_missing_file_exit_2(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_replay_reports_first_violation(capsys):
    assert main(["replay", str(TRACES / "vllm-fixme.jsonl"), "--target", "model", "--oracle", "C1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    tr = trace_io.read(TRACES / "vllm-fixme.jsonl")
    assert out["failed"] and out["op_index"] == len(tr.ops) - 1 and out["violation"]["id"] == "C1"
    assert out["violation"]["requests"]


def test_replay_clean_trace_exit_0(tmp_path, capsys):
    tr = trace_io.read(TRACES / "vllm-fixme.jsonl")
    path = write(tmp_path, tr.dumps())
    assert main(["replay", path, "--oracle", "I1,I3,I4"]) == 0
    assert "no finding" in capsys.readouterr().out


def test_replay_against_reference_detects_divergence(capsys):
    path = str(TRACES / "stale-cursor.jsonl")
    assert main(["replay", path, "--target", "bug:stale-cursor", "--against", "model", "--oracle", "I1",
                 "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["divergence"] and "policy_state" in out["divergence"]


def test_fuzz_finds_the_fixme_and_writes_a_replayable_trace(tmp_path, capsys):
    rc = main(["fuzz", "--policy", "baseline", "--oracle", "C1", "--budget", "30", "--seed", "1",
               "--out", str(tmp_path), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 1 and res["found"] and res["kind"] == "violation" and res["finding"]["violation"]["id"] == "C1"
    assert res["oracle"] == "C1" and res["unshrunk_trace"] and Path(res["unshrunk_trace"]).exists()
    assert main(["replay", res["trace"], "--oracle", "C1"]) == 1


def test_fuzz_correct_policy_exit_0(tmp_path, capsys):
    assert main(["fuzz", "--policy", "baseline", "--budget", "3", "--seed", "7", "--oracle",
                 "I1,I2,I3,I4,I5,I6,I7,I9,I13", "--out", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert not res["found"] and res["traces"] > 0


def test_bugs_json_keys(capsys):
    assert main(["bugs", "--only", "stamped-unregistered,final-step-lost", "--budget", "10", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["bug"] for r in rows] == ["stamped-unregistered", "final-step-lost"]
    for r in rows:
        assert set(r) >= {"bug", "found", "kind", "oracle", "seconds", "invariant", "trace_ops"} and r["found"]
        assert r["kind"] == "violation"
    assert [r["invariant"] for r in rows] == ["I3", "C7"]


def test_unknown_target_exit_2(capsys):
    assert main(["fuzz", "--target", "nonsense", "--budget", "1"]) == 2
    assert "unknown target" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "kvspec.cli", "replay", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "TRACE" in out.stdout
