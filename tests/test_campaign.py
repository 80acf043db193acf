"""Campaigns on several processes (kvspec.drivers.campaign, ``kvspec fuzz --workers``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.contract.errors import ConfigError
from kvspec.drivers.campaign import canonical_ops, check_workers, dedupe_key, worker_seeds


def test_worker_seeds_are_distinct_and_one_worker_keeps_the_seed() -> None:
    assert worker_seeds(5, 1) == [5]
    seeds = [s for seed in range(4) for s in worker_seeds(seed, 3)]
    assert len(set(seeds)) == len(seeds)


def test_findings_equal_up_to_renaming_requests_are_one() -> None:
    a = [{"op": "add", "rid": "x7", "family": 0, "prompt_len": 9}, {"op": "step", "admit": ["x7"]},
         {"op": "finish", "rid": "x7"}]
    b = [{"op": "add", "rid": "q", "family": 0, "prompt_len": 9}, {"op": "step", "admit": ["q"]},
         {"op": "finish", "rid": "q"}]
    c = [*b[:2], {"op": "step"}]
    sig = ("violation", "C1")
    assert canonical_ops(a) == canonical_ops(b)
    assert dedupe_key(sig, {"k": 1}, a) == dedupe_key(sig, {"k": 1}, b)
    assert dedupe_key(sig, {"k": 1}, a) != dedupe_key(sig, {"k": 1}, c)
    assert dedupe_key(sig, {"k": 1}, a) != dedupe_key(("violation", "C2"), {"k": 1}, a)
    assert dedupe_key(sig, {"k": 1}, a) != dedupe_key(sig, {"k": 2}, a)


@pytest.mark.parametrize("bad", [0, -1, 10**6, True, "2"])
def test_bad_worker_counts_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError):
        check_workers(bad)


def test_two_workers_find_a_known_bug_and_report_it_once_per_distinct_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fuzz", "--target", "bug:stale-cursor", "--budget", "20", "--workers", "2", "--out", str(tmp_path),
            "--json"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == 2 and [w["seed"] for w in out["per_worker"]] == [0, 1]
    assert out["found"] and out["findings"]
    assert sum(f["found_by"] for f in out["findings"]) == sum(w["found"] for w in out["per_worker"])
    for f in out["findings"]:
        assert f["finding"]["violation"]["id"] == "C2" and Path(f["trace"]).exists()
    assert out["ops"] == sum(w["ops"] for w in out["per_worker"])
