"""Every outcome as documented (issue 32): a reader that goes away keeps the verdict's exit code,
an I/O error of the user's environment is exit 2 (not 3, an internal error), and every
``--help`` lists every exit code, 130 included."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.cli import build_parser, main

TRACES = Path(__file__).parent / "traces"
FIXME = str(TRACES / "vllm-fixme.jsonl")


class ShortPipe:
    """A stdout whose reader reads ``lines`` writes and then goes away (EPIPE)."""

    def __init__(self, lines: int) -> None:
        self.left = lines
        self.got: list[str] = []

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        self.left -= 1
        self.got.append(text)
        return len(text)

    def flush(self) -> None:
        if self.left <= 0:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")


class FullDisk:
    """A stdout on a full disk: every write fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_reader_that_goes_away_keeps_the_finding(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``kvspec replay TRACE_WITH_FINDING --explain | head -1``: still exit 1, not 0."""
    pipe = ShortPipe(1)
    monkeypatch.setattr(sys, "stdout", pipe)
    assert main(["replay", FIXME, "--explain"]) == 1
    assert len(pipe.got) == 1 and "Traceback" not in capsys.readouterr().err


def test_a_reader_that_goes_away_keeps_a_clean_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", ShortPipe(0))
    assert main(["prove", "--list"]) == 0


def test_output_to_a_full_disk_is_an_error_of_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdout", FullDisk())
    assert main(["replay", FIXME]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "internal error" not in err and err.count("\n") == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
def test_dev_full_exits_2_in_one_line() -> None:
    """The real thing: ``kvspec replay TRACE > /dev/full`` (the error shows at the final flush)."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "kvspec.cli", "replay", FIXME], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "No space left on device" in proc.stderr and proc.stderr.count("\n") == 1
    assert "internal error" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_an_unwritable_output_file_is_an_error_of_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """An I/O error raised while a command writes its files (here: the disk fills while
    ``prove --traces`` writes) is exit 2, naming the error, not exit 3."""
    import kvspec.commands.prove as prove

    def full(args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", "out/trace.jsonl")

    monkeypatch.setattr(prove, "run", full)
    assert main(["prove"]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "out/trace.jsonl" in err and "internal error" not in err


def test_a_bug_of_kvspec_is_still_exit_3(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvspec.commands.prove as prove

    def bug(args: object) -> int:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "kvspec/some/resource")

    monkeypatch.setattr(prove, "run", bug)
    assert main(["prove"]) == 3 and "internal error" in capsys.readouterr().err


def _subcommands() -> dict[str, str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    return {name: p.format_help() for name, p in sub.choices.items()}


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_help_lists_every_exit_code(command: str) -> None:
    text = " ".join(_subcommands()[command].split())
    for code in ("0 ", "1 ", "2 ", "3 internal error", "130 interrupted"):
        assert f"{code}" in text.partition("exit codes:")[2], (command, code)
    assert "I/O error of the environment" in text


# -- Ray: a cluster that is not there is bad input (exit 2), found out in bounded time ------------



def test_an_unreachable_ray_address_is_exit_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Port 1 of the loopback: nothing listens, the connection is refused at once (it used to hang
    in ``ray.init``)."""
    pytest.importorskip("ray")
    code = main(["fuzz", "--budget", "2", "--workers", "2", "--ray", "127.0.0.1:1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--ray 127.0.0.1:1: no Ray cluster reachable there" in err and err.count("\n") == 1


@pytest.mark.parametrize("command", [["fuzz", "--budget", "2", "--workers", "2"], ["bugs", "--budget", "1"]])
def test_ray_auto_without_a_cluster_is_exit_2_saying_how_to_start_one(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where Ray looks for this machine's cluster: none
    out = ["--out", str(tmp_path / "out")]
    code = main([*command, "--ray", "auto", *out])
    err = capsys.readouterr().err
    assert code == 2 and "no running Ray cluster found" in err and "ray start --head" in err
