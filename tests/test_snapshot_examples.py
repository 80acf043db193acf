"""The shipped example snapshots (examples/snapshots/, issue 32) are what ``kvspec snapshot``
writes today and check as their README says; the snapshot format's version, size cap and the
one-block-once rule of the prefix map."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.contract.errors import SnapshotFormatError
from kvspec.contract.snapshot_io import FORMAT_VERSION, load_snapshot, parse_snapshot

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "snapshots"
TRACES = ROOT / "tests" / "traces"

# file -> (the `kvspec snapshot` arguments that wrote it, [(check-snapshot options, exit code)])
SHIPPED = {
    "model-baseline-fixme.json": (["vllm-fixme.jsonl", "--target", "model"], [([], 0), (["--oracle", "C1"], 1)]),
    "impl-repair-self-eviction.json": (["self-eviction.jsonl", "--target", "impl"], [([], 0)]),
    "model-repair-async-drafts.json": (["window-on-drafts.jsonl", "--target", "model"], [([], 0)]),
    "bug-pin-leak.json": (["pin-leak.jsonl"], [([], 1)]),
    "offloading-lru-model.json": (["offloading/lru-evicts-newest.jsonl", "--target", "offloading"], [([], 0)]),
    "offloading-arc-impl.json": (["offloading/arc-untrimmed-ghosts.jsonl", "--target", "offloading-impl"],
                                 [([], 0)]),
    "offloading-bug-evict-pinned.json": (["offloading/offloading-evict-pinned.jsonl"],
                                         [([], 1), (["--oracle", "O5"], 1), (["--oracle", "O9,O10"], 0)]),
}


def test_every_shipped_example_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.json")) == sorted(SHIPPED)
    readme = (EXAMPLES / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_an_example_is_what_the_documented_command_writes(name: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace, *opts = SHIPPED[name][0]
    out = tmp_path / name
    assert main(["snapshot", str(TRACES / trace), *opts, "--out", str(out)]) == 0
    assert out.read_text() == (EXAMPLES / name).read_text()
    assert json.loads(out.read_text())["format_version"] == FORMAT_VERSION


@pytest.mark.parametrize(("name", "options", "code"),
                         [(n, o, c) for n, (_, checks) in sorted(SHIPPED.items()) for o, c in checks])
def test_an_example_checks_as_documented(name: str, options: list[str], code: int,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-snapshot", str(EXAMPLES / name), *options]) == code, capsys.readouterr()


def test_snapshot_at_an_operation_and_past_the_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    assert main(["snapshot", str(TRACES / "vllm-fixme.jsonl"), "--at", "0", "--out", str(out)]) == 0
    assert "after 1 operation(s)" in capsys.readouterr().out
    assert main(["snapshot", str(TRACES / "vllm-fixme.jsonl"), "--at", "99", "--out", str(tmp_path / "t.json")]) == 2
    assert "has 7 operation(s)" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


# -- the format's version --------------------------------------------------------------------

def _example() -> dict[str, object]:
    return dict(json.loads((EXAMPLES / "model-baseline-fixme.json").read_text()))


def test_a_snapshot_without_a_version_is_read_as_version_1() -> None:
    snap = _example()
    del snap["format_version"]
    assert parse_snapshot(json.dumps(snap)) == snap


@pytest.mark.parametrize("version", [2, 0, 99])
def test_an_unknown_version_is_refused_by_name(version: int, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    snap = {**_example(), "format_version": version}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(snap))
    assert main(["check-snapshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"format_version: snapshot format version {version} is" in err and "version 1" in err


def test_a_field_of_the_draft_before_version_1_is_named() -> None:
    """``engine.last_finish`` (replaced by ``engine.finishes``): refused by name, not as an unknown
    field of a 'malformed' snapshot."""
    snap = _example()
    del snap["format_version"]
    engine = dict(snap["engine"])  # type: ignore[call-overload]
    engine["last_finish"] = engine.pop("finishes")
    snap["engine"] = engine
    with pytest.raises(SnapshotFormatError, match=r"^engine\.last_finish: a field of the unversioned draft "
                                                  r"before snapshot format version 1.*engine\.finishes"):
        parse_snapshot(json.dumps(snap))


def test_a_version_that_is_not_an_integer_is_refused() -> None:
    with pytest.raises(SnapshotFormatError, match=r"^format_version: must be an integer"):
        parse_snapshot(json.dumps({**_example(), "format_version": "1"}))


# -- size cap ----------------------------------------------------------------------------------

@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero here")
def test_an_endless_file_is_refused_after_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """``check-snapshot /dev/zero`` used to read until memory ran out (exit 3)."""
    assert main(["check-snapshot", "/dev/zero", "--max-mb", "1"]) == 2
    err = capsys.readouterr().err
    assert "larger than 1,048,576 bytes" in err and err.count("\n") == 1


def test_a_large_regular_file_is_refused_by_its_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.truncate(3 << 20)  # a sparse 3 MB file
    assert main(["check-snapshot", str(path), "--max-mb", "2"]) == 2
    assert "larger than 2,097,152 bytes" in capsys.readouterr().err
    assert load_snapshot(EXAMPLES / "bug-pin-leak.json", 1 << 20)["format_version"] == 1  # under the cap: read


@pytest.mark.parametrize("bad", ["0", "-1", "x", str((1 << 20) + 1)])
def test_max_mb_must_be_a_positive_whole_number(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check-snapshot", str(EXAMPLES / "bug-pin-leak.json"), "--max-mb", bad])
    assert exc.value.code == 2


# -- the prefix map lists a block once ----------------------------------------------------------

@pytest.mark.parametrize("oracle", [[], ["--oracle", "all"], ["--oracle", "I3"]])
def test_a_block_listed_twice_under_a_key_breaks_i3(oracle: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    snap = copy.deepcopy(_example())
    cached = snap["gpu_pool"]["cached"]  # type: ignore[index]
    key = next(iter(cached))
    cached[key] = cached[key] + cached[key][:1]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(snap))
    assert main(["check-snapshot", str(path), *oracle]) == 1
    assert f"I3: gpu: map lists block {cached[key][0]} 2 times under {key}" in capsys.readouterr().out
