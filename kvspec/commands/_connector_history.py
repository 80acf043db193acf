"""``kvspec history --connector offloading``: the OffloadingConnector harness on each release.

For each release (``--versions``/``--releases``, default ``vllm_compat.CONNECTOR_RELEASES``) kvspec
runs itself in that release's venv as a worker: a campaign of
``kvspec.drivers.offloading_connector_fuzz`` (vLLM's real scheduler and connector, the workers
played from outside, O1-O15 after every operation, the four generation profiles in turn) for
``--budget`` seconds of search, each trace under a swarm mix of its own (``--no-swarm``: its
profile's mix). Each new finding (by signature: the violated invariants, or a
crash's exception and innermost vLLM function and statement) is shrunk (its time is not counted
in the budget) and saved as ``--out/VERSION/<n>-<kind>.json``. Then every saved trace, of every
release, is replayed on every release: the matrix says where each finding appears and where it
stops. Known causes (``CONNECTOR_KNOWN``) name the vLLM change read in the releases' code.
``--seeds K`` runs K searches per release (seeds ``seed .. seed+K-1``, traces under
``--out/seed-N/VERSION/``) and gives each finding's time to find as the medians over them
(``kvspec.drivers.findtime``: seconds of search, operations applied); ``--workers N`` runs N
searches at once, each in its own process.
Exit codes: 0 nothing found, 1 findings, 2 bad arguments or a missing venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.adapters import vllm_compat as compat
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, ConfigError
from kvspec.drivers.campaign import check_workers
from kvspec.drivers.findtime import Sample, describe, time_to_find

TRACE_FORMAT = "kvspec-connector-trace/1"


@dataclass(frozen=True)
class KnownCause:
    """A cause read in the releases' code: findings whose signature contains ``marker`` come from
    it in releases from ``first`` up to (not including) ``fixed``."""

    marker: str
    first: str
    fixed: str | None
    text: str


CONNECTOR_KNOWN = (
    KnownCause("assert not req_status.transfer_jobs", "0.23.0", "0.29.0",
               "vLLM #46014: a preempted request is re-admitted with a CPU hit while its flushed stores are "
               "not reported yet; update_state_after_alloc asserts no job is pending. 0.29.0's "
               "get_num_new_matched_tokens returns (None, False) while the request has jobs in flight"),
    KnownCause("assert self._jobs[any_jid].is_store", "0.23.0", "0.29.0",
               "no public issue found (read in code): the connector's reset_cache drops every job (_jobs) "
               "but leaves each request's transfer_jobs, so the next store build (or the request's finish) "
               "looks up a dropped job; 0.29.0's reset_cache clears the requests' transfer_jobs"),
    KnownCause("job_status = self._jobs[job_id]", "0.23.0", "0.29.0",
               "the same reset_cache cause as above, met in request_finished"),
    KnownCause("num_locally_computed_tokens <= num_locally_computed_gpu_blocks", "0.23.0", "0.31.0",
               "no public issue found (read in code): with a sliding-window group, update_state_after_alloc "
               "counts the locally computed blocks from block 0 up to the first non-null unhashed block; a "
               "window block freed and reallocated below the computed boundary ends the count early; "
               "0.31.0 scans from the computed boundary"),
    KnownCause("stuck:head-of-line", "0.23.0", "0.31.0",
               "vLLM #45388 / #45387 (scheduler deadlock under KV-cache pressure with a KV-offloading connector): "
               "schedule() takes skipped_waiting first and stops at the first allocation that fails; a request "
               "parked there (a lookup deferred while its stores were in flight, or promoted after its load) "
               "cannot get blocks that requests behind it hold (for finished loads, or kept by a preempted "
               "request), which are never promoted. "
               "0.31.0 schedules the requests that hold KV blocks first (kv_holding_waiting)"),
    KnownCause("KeyError@offloading/scheduler.py:_remove_pending_job", "0.23.0", None,
               "no public issue found (read in code and in the traces kept): a store job of a request with a "
               "sliding-window group lists one GPU block both among its fenced (sliding-window) blocks and its "
               "deferred fence (full-attention) blocks, a window block left in the request's block list after "
               "it was freed and handed to the same request again (the cause of O14); when the request has "
               "finished, the job's completion removes it from that block's pending set twice: KeyError in "
               "_remove_pending_job (0.23.0: the same two removals, on its sliding-window and other blocks)"),
    KnownCause("violation:O14", "0.23.0", None,
               "no public issue found (read in code and in every O14 trace kept): with a sliding-window group, "
               "a window block that was stored, freed and reallocated to the same request further on stays in "
               "the request's block list (the stale-entry zeroing of PR #42959 covers only positions not yet "
               "stored); the cache reset (PR #41956) rewinds the store progress to chunk 0, so the next store "
               "copies the reallocated block under the key of its old position: stale KV in the CPU cache"),
    KnownCause("assert not self._current_batch_jobs_to_flush", "0.23.0", None,
               "two reset_cache calls with no schedule() between while jobs are in flight: the first queues "
               "every job for flushing, the second asserts the queue is empty (every release here)"),
)


def known_cause(version: str, sig: str) -> str:
    rel = compat.Release(version)
    for cause in CONNECTOR_KNOWN:
        if cause.marker in sig and rel.at_least(cause.first) and not (cause.fixed and rel.at_least(cause.fixed)):
            return cause.text
    return ""


def _python(version: str) -> Path:
    return compat.venv_for(version) / "bin" / "python"


def _versions(args: argparse.Namespace) -> list[str]:
    versions = [v.strip() for v in (args.versions or ",".join(compat.CONNECTOR_RELEASES)).split(",") if v.strip()]
    for v in versions:
        compat.parse_release(v)
        if v not in compat.CONNECTOR_RELEASES:
            raise ConfigError(f"vLLM {v}: the OffloadingConnector harness runs on "
                              f"{', '.join(compat.CONNECTOR_RELEASES)}")
    return versions


def history(args: argparse.Namespace) -> int:
    """Campaign per release, then the replay matrix; the table (or JSON rows) on stdout."""
    if args.raw:
        raise ConfigError("--raw is not available with --connector offloading")
    if not args.continue_:
        raise ConfigError("--no-continue is the first manager's (the connector search keeps no trace to run on from)")
    if args.worker is not None:
        return worker(args)
    versions = _versions(args)
    missing = [v for v in versions if not _python(v).exists()]
    if missing:
        raise ConfigError("no venv for vLLM " + ", ".join(missing) + "; build each with "
                          "scripts/setup-vllm-release.sh VERSION")
    jobs = [(v, seed) for v in versions for seed in range(args.seed, args.seed + args.seeds)]
    with ThreadPoolExecutor(max_workers=max(1, min(check_workers(args.workers), len(jobs)))) as pool:
        done = list(pool.map(lambda job: _campaign(job[0], job[1], args), jobs))
    campaigns = dict(zip(jobs, done, strict=True))
    traces = sorted(str(p) for v, seed in jobs for p in (_out(args, seed) / v).glob("*.json"))
    matrix: dict[str, dict[str, str | None]] = {t: {} for t in traces}
    if traces:
        for v in versions:
            print(f"history: vLLM {v}: replaying {len(traces)} traces", file=sys.stderr)
            for row in _call(v, args, args.seed, Path(args.out), ["--replay", *traces])["replays"]:
                matrix[row["trace"]][v] = row["signature"]
    _report(versions, campaigns, aggregate(versions, campaigns), matrix, args)
    return EXIT_FINDING if any(c["findings"] for c in campaigns.values()) else EXIT_CLEAN


def _out(args: argparse.Namespace, seed: int) -> Path:
    """Where the search with ``seed`` saves its traces: ``--out`` itself for one seed, else
    ``--out/seed-N`` (each release's traces in a folder of its own below)."""
    return Path(args.out) if args.seeds == 1 else Path(args.out) / f"seed-{seed}"


def _campaign(version: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    print(f"history: vLLM {version}: the OffloadingConnector harness for {args.budget:.0f}s, seed {seed}",
          file=sys.stderr)
    return _call(version, args, seed, _out(args, seed), [])


def _call(version: str, args: argparse.Namespace, seed: int, out: Path, extra: list[str]) -> dict[str, Any]:
    cmd = [str(_python(version)), "-m", "kvspec.cli", "history", "--connector", "offloading", "--worker", version,
           "--budget", str(args.budget), "--seed", str(seed), "--out", str(out),
           *([] if args.swarm else ["--no-swarm"]), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.budget * 4 + 900, env=worker_env())
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise ConfigError(f"vLLM {version}: the connector worker exited {proc.returncode}: {tail[0][:300]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def worker_env() -> dict[str, str]:
    """The worker's environment: string hashing fixed (``PYTHONHASHSEED=0``), since vLLM's
    scheduler iterates sets of request ids and a replay must meet them in the same order."""
    return {**os.environ, "PYTHONHASHSEED": "0"}


def aggregate(versions: list[str], campaigns: dict[tuple[str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per release and signature: the first seed's finding (its trace, profile, cause)
    with the time to find over the release's seeds (``kvspec.drivers.findtime``: a search without
    the finding is censored at its end). O(findings x seeds)."""
    rows: list[dict[str, Any]] = []
    for v in versions:
        mine = [(seed, c) for (ver, seed), c in campaigns.items() if ver == v]
        sigs = list(dict.fromkeys(f["signature"] for _, c in mine for f in c["findings"]))
        for sig in sigs:
            samples, first = [], None
            for seed, c in mine:
                f = next((f for f in c["findings"] if f["signature"] == sig), None)
                if f is None:
                    samples.append(Sample(seed, False, c["seconds"], c["search_ops"]))
                    continue
                first = first or {**f, "seed": seed}
                samples.append(Sample(seed, True, f["seconds"], f["search_ops"]))
            assert first is not None
            rows.append({"version": v, **first, **time_to_find(samples).to_json()})
    return rows


def _report(versions: list[str], campaigns: dict[tuple[str, int], dict[str, Any]], rows: list[dict[str, Any]],
            matrix: dict[str, dict[str, str | None]], args: argparse.Namespace) -> None:
    if args.json:
        for (v, seed), c in campaigns.items():
            print(json.dumps({"version": v, "seed": seed, **c}))
        for r in rows:
            print(json.dumps({"time_to_find": True, **r}))
        print(json.dumps({"matrix": matrix}))
        return
    print(f"{'release':8} {'seed':>4} {'traces':>6} {'steps':>7} {'ops':>7} {'search s':>8}  findings")
    for (v, seed), c in campaigns.items():
        print(f"{v:8} {seed:4} {c['traces']:6} {c['steps']:7} {c['search_ops']:7} {c['seconds']:8.1f}  "
              f"{len(c['findings'])}")
    for f in rows:
        secs, ops = describe(time_to_find([Sample(**p) for p in f["per_seed"]]), args.budget)
        print(f"\n{f['version']}  {f['signature']}\n  found by {f['found_seeds']}/{f['seeds']} seeds, median {secs} s, "
              f"{ops} operations (seed {f['seed']}: at {f['seconds']:.1f}s, {f['traces']} traces)")
        mix = f" ({_mix_text(f['mix'])})" if f.get("mix") else ""
        print(f"  profile {f['profile']}{mix}, {len(f['ops'])} ops after shrinking: {f['trace']}" if f["trace"] else
              f"  profile {f['profile']}{mix}, {len(f['ops'])} ops: its replay did not meet it again "
              f"(replay: {f.get('replay') or 'clean'}; not saved)")
        print(f"  {f['known'] or 'cause not known'}")
    if matrix:
        print("\nreplay matrix (trace x release: its finding there, '-' clean)")
        for trace, row in matrix.items():
            cells = "  ".join(f"{v}: {(row.get(v) or '-')[:60]}" for v in versions)
            print(f"{Path(trace).parent.name}/{Path(trace).name}\n    {cells}")


def _mix_text(mix: dict[str, Any]) -> str:
    """A swarm mix in a line: the kinds' weights, the chunks, the prefixes."""
    weights = " ".join(f"{k} {w:g}" for k, w in mix["weights"].items())
    return f"swarm: {weights}; chunks {','.join(map(str, mix['chunks']))}; {mix['prefixes']} prefixes"


# -- the worker, inside one release's venv -----------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    """In the release's venv: the campaign (or, with ``--replay``, the replays); one JSON line."""
    from kvspec.drivers import offloading_connector_fuzz as ocf

    if compat.installed_version() != args.worker:
        raise ConfigError(f"the worker for vLLM {args.worker} runs in vLLM {compat.installed_version()}")
    if args.replay:
        print(json.dumps({"replays": [{"trace": t, "signature": replay_file(Path(t))} for t in args.replay]}))
        return EXIT_CLEAN
    from kvspec.adapters.vllm_offloading_connector import ConnectorConfig, VllmConnectorScheduler
    from kvspec.adapters.vllm_scheduler import SchedulerOptions

    VllmConnectorScheduler(ConnectorConfig(), SchedulerOptions(async_scheduling=False, auto_finish=True),
                           lambda rid, n: 0)  # vLLM's imports happen here, outside the search's time
    out = Path(args.out) / args.worker
    paused = [0.0]

    def clock() -> float:
        return time.monotonic() - paused[0]

    start = clock()
    seen: set[str] = set()
    findings: list[dict[str, Any]] = []
    traces = steps = search_ops = 0
    for r in ocf.campaign(args.budget, args.seed, clock=clock, swarm=args.swarm):
        traces += 1
        steps += r.steps
        ops_before, search_ops = search_ops, search_ops + len(r.ops)
        sig = ocf.signature(r.finding)
        if sig is None or sig in seen:
            continue
        seen.add(sig)
        at = clock() - start
        at_ops = ops_before + min(len(r.ops), r.finding["op_index"] + 1) if r.finding else search_ops
        t0 = time.monotonic()
        config = _config(r.config)
        ops, best = ocf.shrink(config, r.async_scheduling, r.ops, sig, profile=r.profile)
        paused[0] += time.monotonic() - t0
        if ocf.signature(best.finding) != sig:  # the replay does not meet it again: reported, not saved
            findings.append({"signature": sig, "seconds": round(at, 1), "search_ops": at_ops, "traces": traces,
                             "profile": r.profile, "mix": r.mix, "config": r.config,
                             "async_scheduling": r.async_scheduling,
                             "seed": r.seed, "ops": r.ops, "trace": None, "known": known_cause(args.worker, sig),
                             "replay": ocf.signature(best.finding)})
            continue
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{len(findings) + 1:02d}-{r.finding['kind'] if r.finding else 'clean'}.json"
        doc = {"format": TRACE_FORMAT, "release": args.worker, "seed": r.seed, "profile": r.profile, "mix": r.mix,
               "config": r.config, "async_scheduling": r.async_scheduling, "ops": ops,
               "finding": best.finding, "signature": sig}
        path.write_text(json.dumps(doc, indent=1) + "\n")
        findings.append({"signature": sig, "seconds": round(at, 1), "search_ops": at_ops, "traces": traces,
                         "profile": r.profile, "mix": r.mix, "ops": ops, "trace": str(path),
                         "known": known_cause(args.worker, sig)})
    print(json.dumps({"traces": traces, "steps": steps, "search_ops": search_ops, "seconds": round(clock() - start, 1),
                      "findings": findings}))
    return EXIT_CLEAN


def _config(doc: dict[str, Any]) -> Any:
    from kvspec.adapters.vllm_offloading_connector import ConnectorConfig

    return ConnectorConfig(**doc)


def read_trace(path: Path) -> dict[str, Any]:
    """A saved connector trace; ``ConfigError`` when it is not one."""
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read connector trace {path}: {exc}") from None
    if doc.get("format") != TRACE_FORMAT:
        raise ConfigError(f"{path} is not a {TRACE_FORMAT} file")
    return doc


def replay_file(path: Path) -> str | None:
    """The signature of the finding a saved trace makes on the installed release (None: clean)."""
    from kvspec.drivers import offloading_connector_fuzz as ocf

    doc = read_trace(path)
    res = ocf.run_ops(_config(doc["config"]), bool(doc["async_scheduling"]), doc["ops"], doc.get("profile", "mixed"))
    return ocf.signature(res.finding)
