"""``kvspec bench``'s reporting: what is timed for an adapter target, the JSON document, the help.
(No timing is asserted: the clock below is a fake one.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvspec.cli import build_parser, main
from kvspec.commands import bench


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Manager:
    def __init__(self, clock: _FakeClock) -> None:
        self.clock = clock

    def build_connector_meta(self, out: Any) -> str:
        self.clock.now += 2.0  # vLLM's own work
        return "meta"

    def update_connector_output(self, out: Any) -> None:
        self.clock.now += 0.5


class _Adapter:
    """Mirrors its input (3 s), then calls the manager (2 s), then converts the result (1 s)."""

    def __init__(self, clock: _FakeClock) -> None:
        self.clock = clock
        self.manager = _Manager(clock)

    def build_connector_meta(self, out: Any) -> str:
        self.clock.now += 3.0
        meta = self.manager.build_connector_meta(out)
        self.clock.now += 1.0
        return meta


def test_only_the_managers_own_call_is_timed_for_an_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    adapter = _Adapter(clock)
    own = bench.OwnClock(adapter)
    assert own.measure(adapter.build_connector_meta, None) == ("meta", 2.0)
    plain = _Manager(clock)  # a target without a manager: the whole call
    assert bench.OwnClock(plain).measure(plain.build_connector_meta, None) == ("meta", 2.0)
    assert bench.OwnClock(object()).measure(adapter.build_connector_meta, None) == ("meta", 6.0)


def test_json_is_one_document_naming_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--workload", "chat", "--scale", "8,4,64", "--steps", "1", "--policy",
                 "repair", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # one document, nothing else on stdout
    assert doc["policy"] == "repair" and doc["targets"] == ["impl", "model"]
    assert [r["target"] for r in doc["rows"]] == ["impl", "model"]
    assert all(r["policy"] == "repair" for r in doc["rows"]) and "plan_ratio_vs_model" in doc["rows"][0]


def test_text_names_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workload", "decode", "--scale", "8,4,64", "--steps", "1", "--policy",
                 "signal-rescan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("policy signal-rescan;") and all(ln.startswith("signal-rescan") for ln in lines[1:])


def test_help_gives_every_default() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    for action in sub._actions:
        if action.dest != "help":
            assert action.help and "default" in action.help, action.option_strings


@pytest.mark.deep  # exports a tree and measures both in fresh processes
def test_fuzz_throughput_script_compares_two_trees() -> None:
    """``scripts/bench_fuzz.py --against REV`` measures REV's exported tree (it checks where each
    round imported kvspec from) and this one, and prints both rates and their paired ratio. Only
    the report's shape is asserted, never a rate."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: --against needs git archive")
    done = subprocess.run([sys.executable, str(root / "scripts" / "bench_fuzz.py"), "--against", "HEAD",
                           "--seconds", "0.2", "--rounds", "1", "--targets", "model"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^model +repair: this tree +\d+, HEAD +\d+ checked ops per CPU second; "
                     r"median paired ratio \d+\.\d\d \(1 rounds of 0\.2 s\)$", done.stdout, re.M), done.stdout


def test_the_tree_export_works_without_tarfiles_data_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.11.0-3.11.3 (Debian's 3.11.2) have no ``filter=`` for ``extractall``: the export
    checks the members itself there, links inside the tree included, and refuses one that leaves it."""
    import importlib.util
    import io
    import sys
    import tarfile

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("bench_fuzz_script", root / "scripts" / "bench_fuzz.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_fuzz_script", bench)
    spec.loader.exec_module(bench)

    def archive(*members: tuple[str, str | None]) -> tarfile.TarFile:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, link in members:
                info = tarfile.TarInfo(name)
                if link is None:
                    data = b"x = 1\n"
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    info.type, info.linkname = tarfile.SYMTYPE, link
                    tar.addfile(info)
        buf.seek(0)
        return tarfile.open(fileobj=buf)

    real = tarfile.TarFile.extractall

    def old_extractall(self: tarfile.TarFile, path: str = ".", members: object = None, *,
                       numeric_owner: bool = False, **kwargs: object) -> None:
        if kwargs:
            raise TypeError(f"extractall() got an unexpected keyword argument {next(iter(kwargs))!r}")
        real(self, path, members, numeric_owner=numeric_owner)  # type: ignore[arg-type]

    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    into = tmp_path / "tree"
    into.mkdir()
    bench.extract_tree(archive(("kvspec/a.py", None), ("layout/kvspec", "../kvspec")), into)
    assert (into / "kvspec" / "a.py").read_text() == "x = 1\n" and (into / "layout" / "kvspec" / "a.py").exists()
    for bad in (("../evil.py", None), ("ok/link", "../../outside")):
        with pytest.raises(SystemExit, match="refusing to extract"):
            bench.extract_tree(archive(bad), tmp_path / "other")
    # the script's own use: this repository's HEAD, symlinks of .mypy-layout/ included
    head = tmp_path / "head"
    head.mkdir()
    layout = bench.export_tree("HEAD", head)
    assert (layout / "kvspec" / "__init__.py").exists()
