"""``kvspec history --connector offloading``: the saved findings of the OffloadingConnector harness
(tests/traces/offloading_connector_history/VERSION/*.json) replayed on their release, and on the
releases that fix them (kvspec/commands/_connector_history.py). A trace of the installed release
replays in this process; one of another release in that release's venv (skipped, with the
reason, where the venv is missing: the CI has only 0.33.0)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvspec.adapters import vllm_compat as compat
from kvspec.adapters.vllm_offloading_connector import connector_driver_available
from kvspec.commands._connector_history import CONNECTOR_KNOWN, known_cause, read_trace
from kvspec.contract.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
VLLM_OK, VLLM_WHY = connector_driver_available()
VLLM_HERE = pytest.mark.skipif(not VLLM_OK, reason=f"no connector harness in this Python: {VLLM_WHY}")
TRACES = sorted((ROOT / "tests" / "traces" / "offloading_connector_history").glob("*/*.json"))


_REPLAYS: dict[str, dict[str, str | None]] = {}


def _replay(path: Path, release: str) -> str | None:
    """The signature ``path`` makes on ``release``: every saved trace replayed once per release,
    in that release's venv with ``PYTHONHASHSEED=0`` as the campaigns ran them."""
    from kvspec.commands._connector_history import worker_env

    if release not in _REPLAYS:
        python = compat.venv_for(release, ROOT) / "bin" / "python"
        if not python.exists():
            pytest.skip(f"no venv for vLLM {release} here ({python}); build it with scripts/setup-vllm-release.sh")
        proc = subprocess.run([str(python), "-m", "kvspec.cli", "history", "--connector", "offloading", "--worker",
                               release, "--replay", *map(str, TRACES)], capture_output=True, text=True,
                              timeout=900, cwd=ROOT, env=worker_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        _REPLAYS[release] = {Path(r["trace"]).resolve().as_posix(): r["signature"] for r in doc["replays"]}
    return _REPLAYS[release][path.resolve().as_posix()]


def _fixed_in(signature: str) -> str | None:
    causes = [c for c in CONNECTOR_KNOWN if c.marker in signature]
    return causes[0].fixed if causes else None


@pytest.mark.vllm
@VLLM_HERE
@pytest.mark.parametrize("path", TRACES, ids=[f"{p.parent.name}/{p.name}" for p in TRACES])
def test_saved_finding_reproduces_on_its_release(path: Path) -> None:
    doc = read_trace(path)
    assert _replay(path, doc["release"]) == doc["signature"]


FIXED = [(p, r) for p in TRACES for r in compat.CONNECTOR_RELEASES
         if (f := _fixed_in(read_trace(p)["signature"])) is not None and compat.Release(r).at_least(f)]


@pytest.mark.vllm
@VLLM_HERE
@pytest.mark.parametrize(("path", "release"), FIXED, ids=[f"{p.parent.name}/{p.name}@{r}" for p, r in FIXED])
def test_saved_finding_disappears_where_its_cause_is_fixed(path: Path, release: str) -> None:
    doc = read_trace(path)
    assert _replay(path, release) != doc["signature"]


def test_the_saved_traces_exist_for_every_release_that_had_findings() -> None:
    assert TRACES, "tests/traces/offloading_connector_history holds no trace"
    for path in TRACES:
        doc = read_trace(path)
        assert doc["release"] == path.parent.name and doc["ops"] and doc["signature"]


def test_known_causes_apply_from_first_to_fix() -> None:
    sig = "crash:AssertionError@offloading/scheduler.py:update_state_after_alloc: assert not req_status.transfer_jobs"
    assert "#46014" in known_cause("0.23.0", sig)
    assert known_cause("0.29.0", sig) == ""
    assert "reset" in known_cause("0.33.0", "violation:O14")
    assert "#45388" in known_cause("0.29.0", "stuck:head-of-line")
    assert known_cause("0.31.0", "stuck:head-of-line") == "" and known_cause("0.23.0", "stuck:drain") == ""
    removal = "crash:KeyError@offloading/scheduler.py:_remove_pending_job: pending.remove(job_id)"
    assert "twice" in known_cause("0.23.0", removal) and "twice" in known_cause("0.33.0", removal)
    assert known_cause("0.33.0", "crash:AssertionError@offloading/scheduler.py:_remove_pending_job: x") == ""


def test_release_shapes_of_the_connector() -> None:
    old = SimpleNamespace(transfer_spec=("src", "dst"))
    new = SimpleNamespace(src_spec="s", dst_spec="d")
    assert compat.job_specs(old) == ("src", "dst") and compat.job_specs(new) == ("s", "d")
    assert compat.blocks_per_chunk(SimpleNamespace(block_size_factor=2)) == 2
    assert compat.blocks_per_chunk(SimpleNamespace(blocks_per_chunk=3, block_size_factor=9)) == 3
    assert compat.num_chunks(SimpleNamespace(_num_blocks=5)) == 5
    assert compat.num_chunks(SimpleNamespace(_num_chunks=7, _num_blocks=1)) == 7


def test_a_release_without_the_harness_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        read_trace(tmp_path / "missing.json")
    from kvspec.cli import main

    assert main(["history", "--connector", "offloading", "--releases", "0.19.1", "--budget", "1"]) == 2
    assert main(["history", "--connector", "offloading", "--raw", "--budget", "1"]) == 2


@pytest.mark.vllm
@VLLM_HERE
def test_seeds_give_each_finding_its_median(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--seeds 2 --workers 2`` on 0.33.0: two searches side by side, each saving under its own
    ``seed-N`` folder; per signature, the medians over both and the swarm mix of the trace that
    found it (the double reset crash comes within seconds in every release: CONNECTOR_KNOWN)."""
    from kvspec.cli import main

    if not (compat.venv_for("0.33.0", ROOT) / "bin" / "python").exists():
        pytest.skip("no venv for vLLM 0.33.0 here")
    code = main(["history", "--connector", "offloading", "--versions", "0.33.0", "--budget", "8", "--seeds", "2",
                 "--workers", "2", "--json", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    campaigns = [r for r in rows if "traces" in r and "findings" in r]
    ttf = [r for r in rows if r.get("time_to_find")]
    assert sorted(c["seed"] for c in campaigns) == [0, 1] and all(c["search_ops"] > 0 for c in campaigns)
    assert code == (1 if ttf else 0)
    for r in ttf:
        assert r["seeds"] == 2 and [p["seed"] for p in r["per_seed"]] == [0, 1]
        assert set(r["mix"]["weights"]) == {"add", "step", "work", "abort", "reset"}  # swarm testing, the default
        assert r["trace"] is None or Path(r["trace"]).parent == tmp_path / f"seed-{r['seed']}" / "0.33.0"
        found = sorted(p["seconds"] for p in r["per_seed"] if p["found"])
        assert r["found_seeds"] == len(found) and (r["median_seconds"] is None) == (len(found) < 2)
    assert "matrix" in rows[-1]
