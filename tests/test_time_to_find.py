"""Time to find: the medians over seeds (``kvspec.drivers.findtime``), ``kvspec bugs --seeds K`` and
the code path of ``kvspec history --seeds K`` (its search run on the model, whose ``baseline`` has
the FIXME that breaks C1, and its aggregation of several searches). No timing is asserted: the
operation counts are deterministic in the seed, the seconds are only checked for shape."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvspec.cli import main
from kvspec.commands import history
from kvspec.drivers.findtime import Sample, describe, time_to_find
from kvspec.model import make_scheduler


def test_the_median_counts_a_search_that_found_nothing_as_longer_than_any_that_did() -> None:
    found = [Sample(1, True, 3.0, 300), Sample(2, True, 1.0, 100), Sample(3, False, 9.0, 900)]
    t = time_to_find(found)
    assert (t.median_seconds, t.median_ops, t.found_seeds, t.seeds) == (3.0, 300.0, 2, 3)
    # the censored search's own 9 s would not move a plain median, but 2 censored of 3 leave none
    t = time_to_find([Sample(1, True, 1.0, 100), Sample(2, False, 0.5, 50), Sample(3, False, 0.5, 50)])
    assert t.median_seconds is None and t.median_ops is None
    assert describe(t, 20.0) == (">20", "-")
    # an even count: the mean of the two middle samples, none when one of them is censored
    t = time_to_find([Sample(1, True, 1.0, 10), Sample(2, True, 2.0, 30), Sample(3, True, 4.0, 50),
                      Sample(4, False, 0.1, 1)])
    assert (t.median_seconds, t.median_ops) == (3.0, 40.0)
    assert describe(t, 5.0) == ("3.00", "40")
    assert time_to_find([Sample(1, True, 1.0, 10), Sample(2, False, 1.0, 10)]).median_seconds is None
    with pytest.raises(ValueError):
        time_to_find([])


def test_bugs_with_seeds_report_the_medians_of_every_seed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bugs", "--only", "vllm-fixme,stamped-unregistered", "--budget", "10", "--seeds", "3", "--seed", "4"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["bug"] for r in rows] == ["vllm-fixme", "stamped-unregistered"]
    for r in rows:
        assert r["found"] and r["seeds"] == 3 and r["found_seeds"] == 3
        assert [p["seed"] for p in r["per_seed"]] == [4, 5, 6] and all(p["found"] for p in r["per_seed"])
        assert r["median_ops"] == statistics.median(p["ops"] for p in r["per_seed"])
        assert r["median_seconds"] == pytest.approx(statistics.median(p["seconds"] for p in r["per_seed"]), abs=2e-3)
        assert all(p["ops"] > 0 for p in r["per_seed"])
        # the row is the first seed's: its shrunk trace, its operations to the finding
        assert r["seed"] == 4 and r["per_seed"][0]["ops"] == r["search_ops"] and r["trace_ops"] >= 1
    # the operation counts do not depend on the clock: one seed alone gives its own count again
    assert main(["bugs", "--only", "stamped-unregistered", "--budget", "10", "--seed", "5", "--json"]) == 0
    (alone,) = json.loads(capsys.readouterr().out)
    assert alone["search_ops"] == rows[1]["per_seed"][1]["ops"] and alone["seeds"] == 1
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "median s" in table and "median ops" in table and " 3/3 " in table


def _args(tmp_path: Path, seed: int, budget: float, swarm: bool = True) -> argparse.Namespace:
    return argparse.Namespace(seed=seed, budget=budget, out=str(tmp_path), raw=False, swarm=swarm, continue_=True)


def test_the_history_search_reports_operations_to_each_finding(tmp_path: Path) -> None:
    """``history``'s worker search, on the model's baseline (the FIXME: C1): each finding's row
    says how far into the search it was made, and the search ends with its totals."""
    rows = list(history.search("0.33.0", make_scheduler, _args(tmp_path, 0, 3.0)))
    end = rows[-1]
    assert end["_end"] and end["seed"] == 0 and end["ops"] > 0 and end["traces"] > 0
    found = rows[:-1]
    assert any(r["invariant"] == "C1" for r in found), found
    for r in found:
        assert r["seed"] == 0 and 0 < r["ops"] <= end["ops"] and 0 <= r["seconds"] <= end["seconds"] + 1e-3
        assert Path(r["trace"]).exists()
    assert [r["ops"] for r in found] == sorted(r["ops"] for r in found)
    # deterministic in the seed: the first finding is met after the same operations again
    again = next(history.search("0.33.0", make_scheduler, _args(tmp_path, 0, 3.0)))
    assert (again["finding"], again["ops"]) == (found[0]["finding"], found[0]["ops"])
    # one mix for every trace (--no-swarm) searches other traces and finds the FIXME too
    plain = list(history.search("0.33.0", make_scheduler, _args(tmp_path, 0, 3.0, swarm=False)))
    assert any(r.get("invariant") == "C1" for r in plain[:-1]) and plain[0]["ops"] != found[0]["ops"]


def _row(version: str, seed: int, what: str, seconds: float, ops: int) -> dict[str, Any]:
    return {"version": version, "kind": "violation", "finding": f"{what}: text", "seconds": seconds, "ops": ops,
            "seed": seed, "trace_ops": 5, "issue": "x"}


def _end(version: str, seed: int, seconds: float, ops: int) -> dict[str, Any]:
    return {"_end": True, "version": version, "seed": seed, "seconds": seconds, "ops": ops, "traces": 1}


def test_history_aggregates_each_finding_over_the_seeds_of_its_release(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [
        [_row("0.19.1", 0, "C1", 1.0, 10), _row("0.19.1", 0, "I8", 50.0, 500), _end("0.19.1", 0, 100.0, 1000)],
        [_row("0.19.1", 1, "C1", 3.0, 30), _end("0.19.1", 1, 100.0, 900)],
        [_row("0.19.1", 2, "I8", 20.0, 200), _row("0.19.1", 2, "C1", 2.0, 20), _end("0.19.1", 2, 100.0, 800)],
        [_end("0.23.0", 0, 100.0, 1000)], [_end("0.23.0", 1, 100.0, 1000)], [_end("0.23.0", 2, 100.0, 1000)],
    ]
    rows = history.aggregate(runs, 3)
    assert [(r["version"], r["finding"].split(":")[0]) for r in rows] == [("0.19.1", "C1"), ("0.19.1", "I8")]
    c1, i8 = rows
    assert (c1["median_seconds"], c1["median_ops"], c1["found_seeds"], c1["seed"]) == (2.0, 20.0, 3, 0)
    assert (i8["median_seconds"], i8["median_ops"], i8["found_seeds"]) == (50.0, 500.0, 2)
    assert [p["found"] for p in i8["per_seed"]] == [True, False, True]
    assert i8["per_seed"][1] == {"seed": 1, "found": False, "seconds": 100.0, "ops": 900}
    history._print(rows, ["0.19.1", "0.23.0"], False, 100.0)
    out = capsys.readouterr().out
    assert "median ops" in out and " 3/3 " in out and " 2/3 " in out and "nothing found" in out
    only_one = history.aggregate([runs[1], runs[3]], 1)
    assert [(r["finding"].split(":")[0], r["median_seconds"]) for r in only_one] == [("C1", 3.0)]


def test_the_script_prints_the_table_the_readme_quotes(tmp_path: Path) -> None:
    """``scripts/time_to_find.py`` hunts in a fresh process of this tree and prints one row per bug."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "time_to_find.py"
    out = tmp_path / "ttf.json"
    done = subprocess.run([sys.executable, str(script), "--seeds", "2", "--budget", "10", "--only",
                           "stamped-unregistered,unconfirmed-store", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].split()[:4] == ["bug", "found", "median", "s"]
    assert [ln.split()[0] for ln in lines[1:3]] == ["stamped-unregistered", "unconfirmed-store"]
    assert all(ln.split()[1] == "2/2" for ln in lines[1:3]) and lines[-1].startswith("slowest median")
    medians = json.loads(out.read_text())["medians"]
    assert medians["stamped-unregistered"]["found_seeds"] == 2
    assert [p["seed"] for p in medians["stamped-unregistered"]["per_seed"]] == [1, 2]


def test_connector_history_gives_each_signature_its_median_over_the_seeds() -> None:
    """``kvspec history --connector offloading --seeds K``: per release and signature, the first
    seed's finding with the medians over the release's searches; a search without it is censored
    at its own end (seconds and operations of the whole search)."""
    from kvspec.commands._connector_history import aggregate

    def finding(sig: str, seconds: float, ops: int) -> dict[str, Any]:
        return {"signature": sig, "seconds": seconds, "search_ops": ops, "traces": 3, "profile": "mixed",
                "ops": [{"op": "step"}], "trace": f"{sig}.json", "known": ""}

    campaigns = {
        ("0.23.0", 0): {"seconds": 60.0, "search_ops": 9000, "findings": [finding("crash:A", 5.0, 500)]},
        ("0.23.0", 1): {"seconds": 60.0, "search_ops": 8000,
                        "findings": [finding("violation:O14", 1.0, 90), finding("crash:A", 9.0, 700)]},
        ("0.23.0", 2): {"seconds": 60.0, "search_ops": 7000, "findings": []},
        ("0.33.0", 0): {"seconds": 60.0, "search_ops": 5000, "findings": [finding("violation:O14", 2.0, 100)]},
    }
    rows = aggregate(["0.23.0", "0.33.0"], campaigns)
    assert [(r["version"], r["signature"]) for r in rows] == [
        ("0.23.0", "crash:A"), ("0.23.0", "violation:O14"), ("0.33.0", "violation:O14")]
    crash, o14, later = rows
    assert (crash["seed"], crash["found_seeds"], crash["seeds"]) == (0, 2, 3)
    assert (crash["median_seconds"], crash["median_ops"]) == (9.0, 700.0)  # 5, 9 and a censored 60
    assert o14["seed"] == 1 and o14["found_seeds"] == 1 and o14["median_seconds"] is None
    assert [p["found"] for p in o14["per_seed"]] == [False, True, False]
    assert o14["per_seed"][0] == {"seed": 0, "found": False, "seconds": 60.0, "ops": 9000}
    assert (later["seeds"], later["median_seconds"], later["median_ops"]) == (1, 2.0, 100.0)
