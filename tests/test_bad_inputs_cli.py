"""Bad input to the fuzz, replay, bugs and verify commands and to ``Engine.apply``: one line, the
right exit code, a bounded message, never a traceback; and the three outcomes kept apart.

Exit codes (README, ``--help``): 0 clean, 1 finding, 2 bad input or usage, 3 internal error,
130 interrupted.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from scenario_kit import SYNC

import kvspec.drivers.harness as harness
from kvspec.cli import main
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import InvalidOperationError, KVSpecError, UnknownEventError, UnknownRequestError
from kvspec.drivers.engine import Engine
from kvspec.drivers.harness import CRASH, VIOLATION, fuzz
from kvspec.drivers.trace import Trace
from kvspec.model import make_scheduler

TRACES = Path(__file__).parent / "traces"
FIXME = str(TRACES / "vllm-fixme.jsonl")
HUGE = "r" * 5_000_000


def header(**extra: Any) -> str:
    return json.dumps({"kvspec_trace": 2, "config": OffloadConfig(policy="baseline").to_json(), **extra})


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses bad usage itself, with exit 2
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def not_a_dir(tmp_path: Path) -> str:
    f = tmp_path / "file"
    f.write_text("x")
    return str(f / "sub")


# -- usage errors: exit 2, one line naming the option ----------------------------------------

USAGE = [
    (["fuzz", "--oracle", "C9", "--budget", "1"], "C9"),
    (["fuzz", "--oracle", "", "--budget", "1"], "--oracle"),
    (["fuzz", "--oracle", "I1,,C99", "--budget", "1"], "C99"),
    (["fuzz", "--budget", "-5"], "--budget"),
    (["fuzz", "--budget", "nan"], "--budget"),
    (["fuzz", "--budget", "0"], "--budget"),
    (["fuzz", "--budget", "inf"], "--budget"),
    (["fuzz", "--budget", "soon"], "--budget"),
    (["fuzz", "--target", "nonsense", "--budget", "1"], "unknown target"),
    (["fuzz", "--target", "bug:nope", "--budget", "1"], "unknown bug"),
    (["fuzz", "--target", "bug:thrash", "--policy", "baseline", "--budget", "1"], "runs under policy"),
    (["fuzz", "--policy", "magic"], "--policy"),
    (["fuzz", "--seed", "x"], "--seed"),
    (["fuzz", "--target", "model", "--oracle", "C" + "9" * 5000, "--budget", "1"], "unknown invariant"),
    (["replay", FIXME, "--target", "nonsense"], "unknown target"),
    (["replay", FIXME, "--oracle", "C9"], "C9"),
    (["replay", FIXME, "--against", "nonsense"], "unknown target"),
    (["replay", FIXME, "--oracle", ","], "--oracle"),
    (["bugs", "--only", "nope"], "unknown bug"),
    (["bugs", "--budget", "0"], "--budget"),
    (["bugs", "--budget", "-1"], "--budget"),
    (["bugs", "--seeds", "0"], "--seeds"),
    (["bugs", "--seeds", "x"], "--seeds"),
    (["bugs", "--seeds", "1001"], "--seeds"),
    (["history", "--seeds", "-2"], "--seeds"),
    (["verify", "--budget", "-1"], "--budget"),
    (["verify", "--bug-budget", "nan"], "--bug-budget"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
]


@pytest.mark.parametrize(("argv", "words"), USAGE)
def test_usage_errors_exit_2(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert words in err and "Traceback" not in err
    assert len(err) < 2000


def test_unwritable_out_is_refused_before_the_search(not_a_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["fuzz", "--budget", "30", "--out", not_a_dir], capsys)
    assert code == 2 and "--out" in err and "not a writable directory" in err
    assert "traces" not in out  # nothing was searched
    code, _, err = run_cli(["bugs", "--budget", "1", "--out", not_a_dir], capsys)
    assert code == 2 and "--out" in err


def test_vllm_target_absent_here_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    if "vllm" in sys.modules:
        pytest.skip("vLLM is importable here")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    code, _, err = run_cli(["fuzz", "--target", "vllm", "--budget", "1"], capsys)
    assert code == 2 and "vLLM" in err


# -- bad traces: exit 2 naming the line --------------------------------------------------------

BAD_TRACES = [
    (header(target="nonsense") + "\n", "names target", 0),
    (header(target="x" * 300) + "\n", "target", 1),
    (header(oracle=["C99"]) + "\n", "C99", 0),
    (header(oracle=["Z1"]) + "\n", "oracle", 1),
    (header() + '\n{"op": []}\n', "line 2", 2),
    (header() + "\n" + "[" * 1000 + "]" * 1000 + "\n", "line 2", 2),
    (header() + '\n{"op": "finish", "rid": "ghost"}\n', "line 2", 2),
    (header() + '\n{"op": "add", "rid": "a", "family": 0, "prompt_len": 16}\n{"op": "report", "event": 9}\n',
     "line 3", 3),
    (json.dumps({"kvspec_trace": 0, "config": OffloadConfig().to_json()}) + "\n", "version", 1),
    (json.dumps({"kvspec_trace": -3, "config": OffloadConfig().to_json()}) + "\n", "version", 1),
    (header() + '\n{"op": "add", "rid": "' + "r" * 300_000 + '", "family": 0, "prompt_len": 16}\n', "line 2", 2),
    (header() + '\n{"op": "add", "rid": "' + HUGE + '", "family": 0, "prompt_len": 16}\n', "line 2", 2),
]


@pytest.mark.parametrize(("text", "words", "line"), BAD_TRACES)
def test_bad_traces_exit_2(tmp_path: Path, text: str, words: str, line: int,
                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    code, out, err = run_cli(["replay", str(path)], capsys)
    assert code == 2, (out, err[:300])
    assert words in err and "Traceback" not in err
    assert len(err) < 600, "a huge input is never echoed whole"
    if line:
        assert f"line {line}" in err


def test_replay_of_a_directory_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["replay", str(tmp_path)], capsys)
    assert code == 2 and "cannot read" in err


# -- expectations in a trace -------------------------------------------------------------------


def test_expected_rejection_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(header() + '\n{"op": "finish", "rid": "ghost", "expect": "error"}\n')
    code, out, _ = run_cli(["replay", str(path)], capsys)
    assert code == 0 and "1 rejected cleanly" in out


def test_unexpected_acceptance_is_a_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(header() + '\n{"op": "add", "rid": "a", "family": 0, "prompt_len": 16, "expect": "error"}\n')
    code, out, _ = run_cli(["replay", str(path), "--json"], capsys)
    assert code == 1 and json.loads(out)["kind"] == "expectation"


def test_header_target_harness_runs_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(header(target="harness") + '\n{"op": "add", "rid": "a", "family": 0, "prompt_len": 16}\n')
    code, out, _ = run_cli(["replay", str(path)], capsys)
    assert code == 0 and out.startswith("model ")


def test_every_report_names_its_oracle(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run_cli(["replay", FIXME, "--oracle", "all", "--json"], capsys)
    assert code == 1 and json.loads(out)["oracle"]["name"] == "all"
    code, out, _ = run_cli(["fuzz", "--budget", "1", "--out", str(tmp_path), "--json"], capsys)
    assert code == 0 and json.loads(out)["oracle"] == "claims of repair"
    assert json.loads(out)["ops_per_second"] > 0
    assert json.loads(out)["replays"] == {}  # no trace of the model needed a fresh replay


# -- the Python API of the engine ----------------------------------------------------------------


def _busy_engine() -> Engine:
    e = Engine(make_scheduler(OffloadConfig(policy="repair", num_cpu_blocks=6, **SYNC)))
    e.apply({"op": "add", "rid": "a", "family": 0, "prompt_len": 40})
    e.apply({"op": "step", "admit": ["a"]})
    e.apply({"op": "step"})
    return e


ENGINE_BAD: list[tuple[Any, type[KVSpecError]]] = [
    ("step", InvalidOperationError),
    (None, InvalidOperationError),
    ({"op": []}, InvalidOperationError),
    ({"op": {"nested": 1}}, InvalidOperationError),
    ({"op": "step", "admit": 5}, InvalidOperationError),
    ({"op": "step", "admit": [1]}, InvalidOperationError),
    ({"op": "step", "preempt": "a"}, InvalidOperationError),
    ({"op": "step", "resume": ["mrv1"]}, InvalidOperationError),
    ({"op": "step", "bogus": 1}, InvalidOperationError),
    ({"op": "report", "event": [1]}, UnknownEventError),
    ({"op": "report", "event": True}, UnknownEventError),
    ({"op": "load_done", "rid": ["a"]}, UnknownRequestError),
    ({"op": "finish", "rid": {"a": 1}}, UnknownRequestError),
    ({"op": "finish", "rid": HUGE}, UnknownRequestError),
    ({"op": "add", "rid": HUGE, "family": 0, "prompt_len": 16}, InvalidOperationError),
    ({"op": "add", "rid": "b", "family": 0}, InvalidOperationError),
    ({"op": "add", "rid": "b", "family": 0.5, "prompt_len": 16}, KVSpecError),
    ({"op": "reset", "now": True}, InvalidOperationError),
]


@pytest.mark.parametrize(("op", "error"), ENGINE_BAD)
def test_engine_rejects_bad_operations_cleanly(op: Any, error: type[KVSpecError]) -> None:
    e = _busy_engine()
    before = copy.deepcopy(e.snapshot())
    with pytest.raises(error) as exc:
        e.apply(op)
    assert len(str(exc.value)) < 400
    assert e.snapshot() == before


def test_a_type_error_inside_a_target_is_a_crash_not_a_rejection() -> None:
    class Broken(type(make_scheduler(OffloadConfig()))):  # type: ignore[misc]
        def build_connector_meta(self, scheduler_output: Any) -> Any:
            raise TypeError("'int' object is not iterable")

    out = harness.run_ops(OffloadConfig(**SYNC), [{"op": "add", "rid": "a", "family": 0, "prompt_len": 16},
                                            {"op": "step", "admit": ["a"]}],
                          lambda cfg: Broken(cfg, make_scheduler(cfg).gpu_pool))
    assert out.kind == CRASH and out.exception == "TypeError" and out.op_index == 1
    assert "not iterable" in out.describe()


# -- outcomes, files, interrupts -------------------------------------------------------------------


def test_a_crash_is_shrunk_and_saved_but_is_not_a_find(tmp_path: Path) -> None:
    base = type(make_scheduler(OffloadConfig()))

    class CrashesOnReport(base):  # type: ignore[misc, valid-type]
        def update_connector_output(self, connector_output: Any) -> None:
            if connector_output.completed_store_events:
                raise KeyError("event")
            super().update_connector_output(connector_output)

    saved: list[str] = []
    res = fuzz(lambda cfg: CrashesOnReport(cfg, make_scheduler(cfg).gpu_pool), "repair", 10.0, 3,
               on_finding=lambda tr, stage: saved.append(stage))
    assert res.found and res.kind == CRASH and res.outcome is not None and res.outcome.exception == "KeyError"
    assert saved == ["unshrunk", "shrunk"]
    assert res.trace is not None and res.trace.finding is not None and res.trace.finding["kind"] == CRASH
    assert len(res.trace.ops) <= len(res.unshrunk.ops) if res.unshrunk else False
    assert res.trace.ops[-1]["op"] == "report"


def test_finding_files_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fuzz", "--target", "bug:stale-cursor", "--budget", "10", "--out", str(tmp_path), "--json"]
    code, out, _ = run_cli([*argv, "--seed", "1"], capsys)
    first = json.loads(out)
    assert code == 1 and first["kind"] == VIOLATION
    names = sorted(p.name for p in tmp_path.glob("*.jsonl"))  # each beside its finding page (.html)
    assert len(names) == 2 and any("unshrunk" in n for n in names)
    assert all(n.startswith("bug-stale-cursor-repair-claims-") for n in names)
    code, out, _ = run_cli([*argv, "--seed", "1"], capsys)  # the same finding: the same files, untouched
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == names
    code, out, _ = run_cli([*argv, "--seed", "2", "--oracle", "C2"], capsys)
    assert code == 1 and len(list(tmp_path.glob("*.jsonl"))) == 4 and "C2" in json.loads(out)["trace"]
    # a different file that happens to carry the name is kept; the new one gets a suffix
    tr = Trace(OffloadConfig(), [], "model")
    (tmp_path / "same.jsonl").write_text("something else\n")
    assert harness.save_trace(tr, tmp_path, "same.jsonl").name == "same-2.jsonl"
    assert (tmp_path / "same.jsonl").read_text() == "something else\n"


def test_the_unshrunk_finding_is_on_disk_before_shrinking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted_shrink(*args: Any, **kwargs: Any) -> Any:
        assert any("unshrunk" in p.name for p in tmp_path.iterdir()), "unshrunk trace not yet written"
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "run_ops", interrupted_shrink)
    code, out, _ = run_cli(["fuzz", "--target", "bug:stale-cursor", "--budget", "10", "--out", str(tmp_path)],
                           capsys)
    assert code == 130
    assert "interrupted" in out and "FOUND violation" in out and "operations in" in out
    files = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert len(files) == 2  # the unshrunk trace, and the smallest one reached (here: the same ops)


def test_an_interrupted_search_prints_statistics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    calls = {"n": 0}
    real = harness.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "generate", generate)
    code, out, _ = run_cli(["fuzz", "--budget", "60", "--out", str(tmp_path), "--json"], capsys)
    res = json.loads(out)
    assert code == 130 and res["interrupted"] and res["traces"] == 4 and not res["found"]


def test_internal_errors_exit_3_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import kvspec.commands.replay as replay_cmd

    def boom(args: Any) -> int:
        raise RuntimeError("a bug in kvspec")

    monkeypatch.setattr(replay_cmd, "run", boom)
    code, _, err = run_cli(["replay", FIXME], capsys)
    assert code == 3 and "internal error" in err and "Traceback" not in err and err.count("\n") == 1


def test_a_closed_stdout_is_not_an_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    r, w = os.pipe()

    class ClosedPipe:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            return w

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    try:
        assert main(["prove", "--list"]) == 0
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize(("target", "policy"), [
    ("model", "repair"), ("impl", "repair"), ("vllm", "baseline"), ("raw:vllm", "baseline"),
    ("vllm@0.19.0", "baseline"), ("raw:vllm@0.19.0", "baseline"), ("vllm+pr47235", "signal-rescan"),
    ("vllm+repair", "repair"), ("bug:vllm-fixme", None), ("bug:self-eviction", None),
])
def test_fuzz_default_policy_follows_the_target(target: str, policy: str | None) -> None:
    """Without ``--policy`` a target that implements one policy is fuzzed under it (a patched vLLM
    under its patch's, a bug variant under its own); the others under repair."""
    from kvspec.adapters.vllm_patched import PATCHED_TARGETS
    from kvspec.commands.fuzz import _default_policy
    from kvspec.model.bugs import BUGS

    bug = target[4:] if target.startswith("bug:") else None
    want = BUGS[bug].policy if bug is not None else policy
    assert _default_policy(target, bug) == want
    if target in PATCHED_TARGETS:
        assert PATCHED_TARGETS[target][1] == want
