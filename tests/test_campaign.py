"""Campaigns on several processes (kvspec.drivers.campaign, ``--workers``) and on a Ray cluster
(``--ray``, against a one-node cluster the test starts inside a network namespace whose only
interface is loopback; skipped, with the reason, when Ray is not installed or no such namespace
can be made)."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvspec.cli import main
from kvspec.contract.errors import ConfigError
from kvspec.drivers.campaign import canonical_ops, check_ray, check_workers, dedupe_key, usable_cores, worker_seeds


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


def test_auto_workers_are_the_usable_cores(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--workers auto``: one worker per core this process may run on; refused with ``--ray`` (the
    cluster is not this machine), and any other word is a usage error."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert check_workers("auto") == usable_cores() == min(cores or 1, 256)
    with pytest.raises(ConfigError, match="with --ray give the number"):
        check_workers("auto", "auto")
    assert main(["fuzz", "--target", "model", "--budget", "1", "--workers", "auto", "--out", str(tmp_path),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == usable_cores() == len(out["per_worker"])
    with pytest.raises(SystemExit) as stop:
        main(["fuzz", "--workers", "many"])
    assert stop.value.code == 2 and "expected a whole number or auto, got 'many'" in capsys.readouterr().err


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


def test_ray_addresses_are_checked_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_ray(None) is None
    for bad in ("", "nohost", "host:", "host:99999", ":6379", 7):
        with pytest.raises(ConfigError, match="--ray"):
            check_ray(bad)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ConfigError, match=r"kvspec\[ray\]"):
        check_ray("auto")


@pytest.mark.deep  # two hunts of two bugs, the second in two spawned workers
def test_bug_hunt_rows_do_not_depend_on_the_number_of_workers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bugs", "--only", "stale-cursor,pin-leak", "--budget", "10", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, "--workers", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    keep = ("bug", "found", "kind", "invariant", "op_index", "trace_ops")
    assert [{k: r[k] for k in keep} for r in one] == [{k: r[k] for k in keep} for r in two]
    assert [r["bug"] for r in two] == ["stale-cursor", "pin-leak"] and all(r["found"] for r in two)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


NETNS_ENV = "KVSPEC_RAY_NETNS"  # set by the confining test for the run it starts inside the namespace


@pytest.mark.deep  # starts a Ray cluster inside a new network namespace
def test_the_ray_tests_run_confined_to_loopback() -> None:
    """The tests that need a Ray cluster, run by a pytest started in a new network namespace (a
    user namespace maps this user to root in it) whose only interface, loopback, is brought up
    first: Ray's processes can listen on no other address. Both must pass there."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'kvspec[ray]' runs this test")
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare is None or ip is None:
        pytest.skip("needs unshare(1) and ip(8) to make a loopback-only network namespace")
    if subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine does not allow a new network namespace (unshare -rn failed)")
    inner = (f'{ip} link set lo up && exec "$0" -m pytest -q -p no:cacheprovider '
             f'-k runs_as_ray_tasks {__file__}')
    res = subprocess.run([unshare, "-rn", "sh", "-c", inner, sys.executable], env={**os.environ, NETNS_ENV: "1"},
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "1 passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-2000:]


@pytest.fixture
def ray_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A one-node Ray cluster of this test's own (2 CPUs, token authentication with a fresh token,
    its own temp dir), stopped by signalling the process group it started; its address."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # before Ray is imported: it reads them once
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    if os.environ.get(NETNS_ENV) != "1":
        pytest.skip("runs inside a loopback-only network namespace, which "
                    "test_the_ray_tests_run_confined_to_loopback makes (Ray's runtime-env agent listens on "
                    "the node's own address even with --node-ip-address=127.0.0.1)")
    assert [name for _, name in socket.if_nameindex()] == ["lo"], "the namespace has an interface besides loopback"
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'kvspec[ray]' runs this test")
    ray_bin = Path(sys.executable).with_name("ray")
    port = _free_port()
    temp = Path(tempfile.mkdtemp(prefix="kvray", dir="/tmp"))  # short: Ray's socket paths must stay short
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
        stdout=(tmp_path / "ray.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:

        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while subprocess.run([str(ray_bin), "status", f"--address={address}"], capture_output=True).returncode:
            assert head.poll() is None, (tmp_path / "ray.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the Ray head did not come up within 60 s"
            time.sleep(1)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_campaign_runs_as_ray_tasks_and_reports_on_the_driver(
        ray_cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "found"
    argv = ["fuzz", "--target", "bug:stale-cursor", "--budget", "20", "--workers", "2", "--ray", ray_cluster,
            "--out", str(out_dir), "--json"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == 2 and [w["seed"] for w in out["per_worker"]] == [0, 1]
    assert out["found"] and all(w["found"] for w in out["per_worker"])
    for f in out["findings"]:
        assert f["finding"]["violation"]["id"] == "C2"
        assert Path(f["trace"]).parent == out_dir and Path(f["trace"]).exists()  # written by the driver
    assert main(["bugs", "--only", "stale-cursor,pin-leak", "--budget", "10", "--ray", ray_cluster, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["bug"] for r in rows] == ["stale-cursor", "pin-leak"] and all(r["found"] for r in rows)


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.deep)])
def test_a_resumed_campaign_goes_on_where_it_stopped(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     workers: str) -> None:
    """Two resumed runs draw the traces one run twice as long would: the second one's traces are new,
    not the first one's again (each worker's generator state is kept in --out). One worker in the
    default run, two (spawned processes) in the deep one."""
    from kvspec.drivers.harness import fuzz
    from kvspec.model import make_scheduler

    argv = ["fuzz", "--target", "model", "--budget", "1", "--workers", workers, "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert not first["campaign"]["resumed"] and Path(first["campaign"]["state"]).exists()
    assert main([*argv, "--resume"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["campaign"]["resumed"] and second["campaign"]["traces_before"] == first["traces"]
    # a worker starts from its saved generator state, not from its seed's (no time to draw a trace here)
    saved = json.loads(Path(first["campaign"]["state"]).read_text())["states"]["0"]
    start = random.Random(0).getstate()
    assert saved != [start[0], list(start[1]), start[2]]
    assert fuzz(make_scheduler, "repair", 1e-9, 0, resume=saved).rng_state == saved
    assert fuzz(make_scheduler, "repair", 1e-9, 0).rng_state == [start[0], list(start[1]), start[2]]
    assert main([*argv[:-1], "--resume"]) == 0  # the text report says so
    assert "resumed a campaign of" in capsys.readouterr().out
    Path(first["campaign"]["state"]).write_text("{not json")
    assert main([*argv, "--resume"]) == 2


def test_configs_pins_every_drawn_configuration_and_leaves_the_rest_drawn() -> None:
    """``random_config`` with ``ConfigPins``: a pinned feature holds in every configuration, and
    without pins the draws are the usual ones (same configurations for the same seed)."""
    from kvspec.drivers.opgen import ConfigPins, RandomChoices, parse_pins, random_config

    def draws(pins: ConfigPins, seed: int = 3) -> list[Any]:
        rng = random.Random(seed)
        return [random_config(RandomChoices(rng), "repair", pins=pins) for _ in range(200)]

    plain = draws(ConfigPins())
    assert plain == [random_config(RandomChoices(r), "repair") for r in [random.Random(3)] for _ in range(200)]
    # the draws alone give every feature both ways, so each pin below changes something
    assert {len(c.groups) for c in plain} == {1, 2} and {c.async_scheduling for c in plain} == {True, False}
    assert {c.num_speculative_tokens > 0 for c in plain} == {True, False}
    for words, holds in [
        ("sliding", lambda c: len(c.groups) == 2 and c.groups[1].kind == "sliding"),
        ("full", lambda c: len(c.groups) == 1),
        ("sync", lambda c: not c.async_scheduling),
        ("async,spec", lambda c: c.async_scheduling and 1 <= c.num_speculative_tokens <= 3),
        ("no-spec,sliding,sync", lambda c: c.num_speculative_tokens == 0 and len(c.groups) == 2
         and not c.async_scheduling),
    ]:
        pins = parse_pins(words)
        assert sorted(pins.words()) == sorted(words.split(","))
        pinned = draws(pins)
        assert all(holds(c) for c in pinned), words
        assert len({c.num_gpu_blocks for c in pinned}) > 1  # the sizes are still drawn
    for bad, why in [("slidng", "unknown word 'slidng'"), ("", "unknown word ''"),
                     ("sync,async", "'async' and 'sync' contradict"), ("spec,no-spec", "contradict")]:
        with pytest.raises(ConfigError, match=why):
            parse_pins(bad)


def test_a_campaign_with_configs_fuzzes_only_those_configurations(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvspec fuzz --configs``: every configuration the campaign runs has the pinned features, the
    report names them, and the campaign state (``--resume``) is kept apart from the unpinned one."""
    from kvspec.drivers import harness

    seen: list[Any] = []
    real = harness.generate

    def generate(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(cfg)
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(harness, "generate", generate)
    argv = ["fuzz", "--budget", "1", "--out", str(tmp_path), "--json", "--configs", "sliding,sync,spec"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["configs"] == ["sliding", "sync", "spec"] and out["traces"] == len(seen) > 0
    assert all(len(c.groups) == 2 and not c.async_scheduling and c.num_speculative_tokens for c in seen)
    assert "configs-sliding+sync+spec" in out["campaign"]["state"]
    assert main(argv[:-2]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["configs"] == [] and plain["campaign"]["state"] != out["campaign"]["state"]
    assert main([*argv, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["campaign"]["traces_before"] == out["traces"]
