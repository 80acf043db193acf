"""``kvspec history``: the invariant fuzzer on each real vLLM release, findings side by side.

For each release (``--versions``, default ``kvspec.adapters.vllm_compat.RELEASES``) kvspec runs
itself in that release's venv (``.vllm-venvs/VERSION``, built by
``scripts/setup-vllm-release.sh``) as a worker: random configurations and random engine traces on
target ``vllm@VERSION``, the invariants the baseline claims (plus C1) after every operation as the
only oracle, no model alongside. Each finding is shrunk, saved under ``--out/VERSION/``, reported,
and then taken out of the search (its invariant leaves the oracle, a crash of the same operation
and exception type is not reported again), so a rule broken on every step is reported once and
the search goes on for the others, until ``--budget`` seconds per release are spent.

Three outcomes stay apart: a *violation* (an invariant broke after an accepted operation), a
*crash* (vLLM raised something other than kvspec's own refusal, or handed back what its own types
exclude), and a refusal by kvspec's adapter. The engine model only generates calls the model
accepts, so the adapter refuses one only when vLLM's state already left what the model allows,
and by then the engine may have acted on the same operation: such a refusal is never reported as
one. The trace is run again on the raw target (``raw:vllm@VERSION``: the call reaches vLLM) and
judged there: what vLLM then does is the finding (violation or crash); if the invariants all hold,
the row's kind is *divergence* (the model's rule is stricter than vLLM, not a vLLM bug).
``--raw`` runs the whole search on the raw target.

Each trace draws its own operation mix (swarm testing, ``opgen.swarm_mix``: the weight of each
kind and the chances of preempting, admitting, budgets and whole reports drawn per trace);
``--no-swarm`` uses one mix for all. Once a violation is found, half the traces start from its
shrunk trace and run on (``kvspec.drivers.continuation``): what a bug does after its first
sign (a corrupted free queue walked later) is met without meeting the bug again by chance; a
finding made so names the violation it ran on from (``continued``). ``--no-continue``: every
trace starts fresh.

The table: release x finding, with the seconds of searching (vLLM's import, timed before the
search starts, and shrinking the earlier findings left out) and the operations applied until it
was found (with ``--seeds K``: the medians over K searches with seeds ``seed .. seed+K-1``, a
search that did not make it counting as longer than any that did: ``kvspec.drivers.findtime``),
the shrunk trace's length and the public vLLM issues whose cause, verified in the releases'
code, is in that release and shows as that invariant or exception (``KNOWN``; several are
joined by "or", and ``scripts/vllm-history-matrix.py`` tells them apart by where each kept trace
stops failing). Progress goes to stderr. Exit codes: 0 nothing found, 1 findings, 2 bad
arguments or a missing venv, 3 internal error.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvspec.adapters import vllm_compat as compat
from kvspec.adapters.targets import raw_target
from kvspec.commands.bugs import seed_count
from kvspec.commands.fuzz import add_workers_argument, budget_seconds
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, ConfigError, exit_codes
from kvspec.drivers.campaign import check_workers, single_threaded
from kvspec.drivers.continuation import SHARE, Continuations, Kept
from kvspec.drivers.findtime import Sample, describe, time_to_find

NAME = "history"
HELP = "fuzz each real vLLM release with the invariants as the only oracle; table of findings"
EPILOG = exit_codes("nothing found", "findings", "bad input, usage or a missing venv")


@dataclass(frozen=True)
class Known:
    """A public vLLM issue: the finding it explains, in the releases whose code has the cause."""

    issue: str
    kind: str
    what: str  # invariant id or exception type
    first: str  # first release with the cause
    fixed: str | None  # first release without it (None: still there in 0.33.0)
    why: str


#: Findings matched to public issues, each checked against the releases' sources (``first``: the
#: first release with the cause, ``fixed``: the first checked release without it; releases between
#: the checked ones, 0.20-0.22, 0.24-0.28, 0.30 and 0.32, were not read).
KNOWN = (
    Known("#53498", "violation", "I3", "0.19.0", "0.30.0",
          "store destinations stamped with their hash when the store is planned (manager: "
          "cpu_blk._block_hash = ... in the store preparation), entered in the prefix map only when "
          "the store completes: a CPU block is hashed but not in the map for as long as its store flies"),
    Known("FIXME (0.33.0)", "violation", "C1", "0.19.0", None,
          "the lazy cursor survives an eviction of the block it points at (stale cursor)"),
    Known("#41289", "violation", "I8", "0.19.0", "0.23.0",
          "eager stores dedup GPU blocks within one step only (a local set), so a block whose store "
          "from an earlier step is still in flight (its key not yet in the CPU map) is stored again; "
          "0.23.0 keeps the in-flight set across steps (_in_flight_store_gpu_blocks)"),
    Known("#57816", "violation", "I8", "0.19.0", "0.33.0",
          "a preempted request resumed as a new request (model runner v2: NewRequestData) is not "
          "marked resumed by yield_req_data, so its full new table is appended to the freed ids and "
          "its cursors kept: the scan reads stale ids, now other positions' or requests' blocks"),
    Known("#57816", "violation", "I10", "0.19.0", "0.33.0", "as the I8 row of #57816"),
    Known("#42571", "violation", "I1", "0.19.0", "0.29.0",
          "a sliding-window request lists a reused GPU block at two positions; its store touches and "
          "frees it twice, and free_blocks (decrement all, then keep those at ref 0) appends it twice: "
          "the free count outgrows the queue; 0.29.0 decrements and tests block by block"),
    Known("#42571", "crash", "AssertionError", "0.19.0", "0.29.0",
          "as the I1 row of #42571: the inflated free count later makes popleft_n or get_new_blocks "
          "assert"),
    Known("#42571", "crash", "VllmBrokeContract", "0.19.0", "0.29.0",
          "as the I1 row of #42571: popleft_n walks into the free list's tail sentinel (block id -1)"),
    Known("#41704", "violation", "C8", "0.19.0", "0.30.0",
          "no finish flush: blocks confirmed after the request's last scan are never stored once it "
          "finishes; PR #53532 (with #53498's fix) adds _queue_finished_eager_store"),
    Known("no public issue (read in code)", "violation", "I15", "0.24.0", "0.33.0",
          "reset() leaves the lookup pins (_pending_cpu_hits) in place, so the CPU pool's "
          "reset_prefix_cache() finds blocks in use and refuses; 0.33.0 releases the pins first"),
)


def issue_for(version: str, kind: str, what: str) -> str:
    """The public issues whose cause is in ``version``'s code and shows as this kind and invariant
    (or exception type), joined with " or " (the kept trace of each row names the one it is);
    "no public issue" when none. O(len(KNOWN))."""
    rel = compat.Release(version)
    found = [k.issue for k in KNOWN
             if k.kind == kind and k.what == what and rel.at_least(k.first)
             and not (k.fixed is not None and rel.at_least(k.fixed))]
    return " or ".join(dict.fromkeys(found)) or "no public issue"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--versions", "--releases", dest="versions", default=None,
                   help=f"comma-separated releases (default {','.join(compat.RELEASES)}; with --manager offloading "
                        "0.23.0,0.29.0,0.31.0,0.33.0)")
    p.add_argument("--budget", type=budget_seconds, default=300.0, help="seconds of search per release (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=seed_count, default=1,
                   help="searches per release, seeds SEED..SEED+K-1; the table gives medians (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON row per finding")
    p.add_argument("--out", default="fuzz-out/history",
                   help="directory for the shrunk traces (default fuzz-out/history)")
    p.add_argument("--raw", action="store_true",
                   help="fuzz raw:vllm@VERSION: calls the model would refuse reach vLLM (default: vllm@VERSION)")
    p.add_argument("--no-swarm", dest="swarm", action="store_false",
                   help="one operation mix for every trace (default: swarm testing, each trace its own mix)")
    p.add_argument("--no-continue", dest="continue_", action="store_false",
                   help="every trace starts fresh (default: once a violation is found, half the traces run on "
                        "from its trace)")
    add_workers_argument(p, "releases fuzzed at once, each in its own venv's process")
    p.add_argument("--worker", metavar="VERSION", default=None, help=argparse.SUPPRESS)
    p.add_argument("--manager", choices=("simple", "offloading"), default="simple",
                   help="simple: SimpleCPUOffload (default); offloading: the OffloadingConnector's "
                        "CPUOffloadingManager, LRU and ARC, releases 0.23.0 on (kvspec/commands/_offloading.py)")
    p.add_argument("--connector", choices=("offloading",), default=None,
                   help="offloading: vLLM's scheduler with the real OffloadingConnector, releases "
                        f"{','.join(compat.CONNECTOR_RELEASES)}, judged by O1-O15; findings shrunk, saved and "
                        "replayed on every release (kvspec/commands/_connector_history.py)")
    p.add_argument("--replay", nargs="+", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.connector == "offloading":
        if args.manager != "simple":
            raise ConfigError("--connector offloading and --manager are exclusive (the connector runs its own manager)")
        from kvspec.commands import _connector_history

        return _connector_history.history(args)
    if args.replay is not None:
        raise ConfigError("--replay is the connector worker's option")
    if args.manager == "offloading":
        from kvspec.commands import _offloading

        return _offloading.history(args)
    args.versions = args.versions or ",".join(compat.RELEASES)
    if args.worker is not None:
        return _worker(args)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    for v in versions:
        compat.parse_release(v)
    missing = [v for v in versions if not (compat.venv_for(v) / "bin" / "python").exists()]
    if missing:
        raise ConfigError("no venv for vLLM " + ", ".join(missing) + "; build each with "
                          "scripts/setup-vllm-release.sh VERSION")
    workers = check_workers(args.workers)
    jobs = [(v, args.seed + k) for v in versions for k in range(args.seeds)]
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:  # each thread waits on a process
        runs = list(pool.map(lambda job: _run_release(job[0], job[1], args), jobs))
    rows = aggregate(runs, args.seeds)
    _print(rows, versions, args.json, args.budget)
    return EXIT_FINDING if rows else EXIT_CLEAN


def _run_release(version: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The worker in ``version``'s venv with ``seed``; its JSON rows (progress passes through on stderr)."""
    python = compat.venv_for(version) / "bin" / "python"
    out = str(args.out) if args.seeds == 1 else str(Path(args.out) / f"seed-{seed}")
    cmd = [str(python), "-m", "kvspec.cli", "history", "--worker", version, "--budget", str(args.budget),
           "--seed", str(seed), "--out", out, *(["--raw"] if args.raw else []),
           *([] if args.swarm else ["--no-swarm"]), *([] if args.continue_ else ["--no-continue"])]
    print(f"history: vLLM {version}: fuzzing for {args.budget:.0f}s, seed {seed} ({python})", file=sys.stderr)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.budget * 2 + 300)
    if proc.returncode not in (EXIT_CLEAN, EXIT_FINDING):
        raise ConfigError(f"the vLLM {version} worker exited {proc.returncode} (its message is above)")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def finding_key(row: dict[str, Any]) -> tuple[str, str, str]:
    """What makes two seeds' rows the same finding: release, kind and invariant (or exception)."""
    return row["version"], row["kind"], row["finding"].split(":", 1)[0]


def aggregate(runs: list[list[dict[str, Any]]], seeds: int) -> list[dict[str, Any]]:
    """One row per release and finding over ``runs`` (each search's rows; a release's ``seeds``
    searches next to each other, every search ending with its ``_end`` row): the first row that
    made the finding, with the medians over the release's searches (``kvspec.drivers.findtime``;
    a search without the finding is censored at its end). O(rows x seeds)."""
    out: list[dict[str, Any]] = []
    for i in range(0, len(runs), seeds):
        release = runs[i:i + seeds]
        ends = [next(r for r in run if "_end" in r) for run in release]
        keys = list(dict.fromkeys(finding_key(r) for run in release for r in run if "_end" not in r))
        for key in keys:
            samples, first = [], None
            for run, end in zip(release, ends, strict=True):
                row = next((r for r in run if "_end" not in r and finding_key(r) == key), None)
                if row is None:
                    samples.append(Sample(end["seed"], False, end["seconds"], end["ops"]))
                    continue
                first = first or row
                samples.append(Sample(row["seed"], True, row["seconds"], row["ops"]))
            assert first is not None
            out.append({**first, **time_to_find(samples).to_json()})
    return out


def _print(rows: list[dict[str, Any]], versions: list[str], as_json: bool, budget: float) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'release':<8} {'kind':<10} {'finding':<34} {'seeds':>5} {'median s':>8} {'median ops':>10} "
          f"{'ops':>4}  issue")
    for v in versions:
        mine = [r for r in rows if r["version"] == v]
        if not mine:
            print(f"{v:<8} {'-':<10} {'nothing found':<34}")
        for r in mine:
            secs, ops = describe(time_to_find([Sample(**p) for p in r["per_seed"]]), budget)
            print(f"{v:<8} {r['kind']:<10} {r['finding'][:34]:<34} {r['found_seeds']:>2}/{r['seeds']:<2} "
                  f"{secs:>8} {ops:>10} {r['trace_ops']:>4}  {r['issue']}")


# -- the worker, inside one release's venv -----------------------------------------------------


#: The smallest sliding window drawn. With a 1-token window vLLM 0.33.0 caches no sliding-window
#: block (``SlidingWindowManager.reachable_block_mask``: a hit needs no contiguous block, so none
#: is marked reachable), while the engine model caches them as for any window; the engine and
#: vLLM's scheduler differ from the first step (docs/vllm-history.md), so such traces would judge
#: calls vLLM's scheduler never makes.
MIN_WINDOW = 2


def _config(rng: random.Random) -> OffloadConfig:
    block = rng.choice((1, 4, 16))
    groups: tuple[KVGroup, ...] = (KVGroup(),)
    if rng.random() < 0.35:
        groups = (KVGroup(), KVGroup("sliding", sliding_window=max(MIN_WINDOW, block * rng.choice((1, 2, 3)))))
    elif rng.random() < 0.15:
        groups = (KVGroup(), KVGroup())
    return OffloadConfig(block_size=block, num_gpu_blocks=rng.choice((12, 16, 24, 32)),
                         num_cpu_blocks=rng.choice((4, 5, 6, 8, 12)), world_size=rng.choice((1, 1, 2)),
                         groups=groups, policy="baseline", lazy_offload=rng.random() < 0.3)


def _worker(args: argparse.Namespace) -> int:
    """Search ``vllm@VERSION`` for ``args.budget`` seconds; one JSON row per distinct finding, then
    an ``_end`` row (the search's seconds and operations)."""
    from kvspec.adapters.targets import get_factory

    single_threaded()
    target = f"{compat.TARGET_PREFIX}{args.worker}"
    factory = get_factory(raw_target(target) if args.raw else target)
    t0 = time.monotonic()
    factory(OffloadConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, policy="baseline"))
    print(f"history: vLLM {args.worker}: imported and built in {time.monotonic() - t0:.1f}s (before the search's "
          "clock starts: not counted)", file=sys.stderr)
    found = False
    for row in search(args.worker, factory, args):
        print(json.dumps(row), flush=True)
        found = found or "_end" not in row
    return EXIT_FINDING if found else EXIT_CLEAN


def search(version: str, factory: Any, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The worker's search of ``factory``'s targets (``vllm@VERSION`` in the worker; any target in a
    test) for ``args.budget`` seconds with ``args.seed``: each distinct finding's row as it is
    made (``seconds`` and ``ops``: into the search when the finding's trace was drawn and applied
    up to it), then the ``_end`` row (``continued``: the traces that ran on from a kept one)."""
    from kvspec.adapters.vllm import baseline_oracle
    from kvspec.drivers.harness import REPLAYS

    rng = random.Random(args.seed)
    runs_on = Continuations(SHARE if args.continue_ else 0.0)
    start = time.monotonic()
    seen: set[tuple[str | None, str | None]] = set()
    found_ids: set[str] = set()
    traces = ops = continued = 0
    paused = 0.0  # seconds spent shrinking and judging findings: not searching
    replays: dict[str, int] = {}  # traces generate judged by a fresh, full replay, by cause
    while time.monotonic() - start < args.budget:
        start_from = runs_on.draw(rng)
        continued += start_from is not None
        cfg = start_from.config if start_from else _config(rng)
        skip = found_ids | set(compat.unclaimed(compat.Release(version)))
        oracle = tuple(i for i in baseline_oracle(cfg) if i not in skip)
        row = _one_trace(version, cfg, factory, oracle, rng, seen, start + paused, ops, args, start_from, runs_on)
        traces += 1
        ops += row.pop("_ops") if row else 0
        paused += row.pop("_paused", 0.0)
        why = row.pop("_replayed", None)
        if why is not None:
            replays[why] = replays.get(why, 0) + 1
        if row and "finding" in row:
            if row["kind"] == "violation":
                found_ids.add(row["invariant"])
            yield row
            print(f"history: vLLM {version}: {row['kind']} {row['finding']} at {row['seconds']:.1f}s "
                  f"({row['trace_ops']} ops shrunk)", file=sys.stderr)
        if traces % 10 == 0:
            print(f"history: vLLM {version}: {traces} traces, {time.monotonic() - start:.0f}/{args.budget:.0f}s",
                  file=sys.stderr)
    print(f"history: vLLM {version}: done, {traces} traces in {time.monotonic() - start:.0f}s", file=sys.stderr)
    for why, n in replays.items():
        print(f"history: vLLM {version}: WARNING: {n} trace(s) replayed ({why}): {REPLAYS[why]}", file=sys.stderr)
    yield {"_end": True, "version": version, "seed": args.seed, "seconds": round(time.monotonic() - start - paused, 3),
           "ops": ops, "traces": traces, "continued": continued}


def _one_trace(version: str, cfg: OffloadConfig, factory: Any, oracle: tuple[str, ...], rng: random.Random,
               seen: set[tuple[str | None, str | None]], start: float, ops_before: int,
               args: argparse.Namespace, start_from: Kept | None, runs_on: Continuations) -> dict[str, Any]:
    """One random trace, from a fresh start or running on from ``start_from``; a new finding,
    shrunk and saved, as a row (``_ops``: operations run; ``ops``: ``ops_before`` and this trace's
    up to the finding), a new violation's shrunk trace kept in ``runs_on``. A refusal by kvspec's
    adapter is judged again on the raw target (``_judged_raw``)."""
    from kvspec.drivers.harness import _finding_trace, finding_name, generate, save_trace, shrink
    from kvspec.drivers.opgen import OpMix, RandomChoices, swarm_mix
    from kvspec.oracle.oracles import Oracle

    mix = (replace(swarm_mix(RandomChoices(rng)), readmit_preempted=True) if args.swarm
           else OpMix(num_families=rng.choice([1, 2, 3]), readmit_preempted=True))
    prefix = start_from.ops if start_from else ()
    trace_ops, out = generate(cfg, factory, rng, len(prefix) + 120, oracle, mix=mix, strict=True, prefix=prefix)
    row: dict[str, Any] = {"_ops": len(trace_ops), "_replayed": out.replayed}
    if not out.failed:
        return row
    if out.op_name == "(setup)":  # the release cannot build this configuration: not a finding
        print(f"history: vLLM {version}: configuration not supported: {out.crash}", file=sys.stderr)
        return row
    target = f"{compat.TARGET_PREFIX}{version}"
    raw = args.raw
    if _refused(out) and not raw:
        factory, out, raw = _judged_raw(cfg, trace_ops, factory, oracle, out, target)
    if out.kind == "expectation" and out.input_error:  # kvspec's generator or replay, not vLLM, is at fault
        raise RuntimeError(f"history: kvspec's engine refused an operation of its own trace: {out.describe()}")
    sig = out.signature()
    if sig in seen:
        return row
    seen.add(sig)
    seconds = time.monotonic() - start
    row["_paused"] = -time.monotonic()
    small, small_out = shrink(cfg, trace_ops, factory, oracle, out, time.monotonic() + 60.0)
    kind = _kind(small_out, raw)
    what = small_out.violation.id if small_out.violation else (small_out.exception or "rejected")
    name = raw_target(target) if raw else target
    trace = _finding_trace(cfg, small, name, args.seed, Oracle("claims of baseline", oracle), small_out)
    path = save_trace(trace, Path(args.out) / version, finding_name(name, "baseline", what, trace))
    text = str(small_out.violation) if small_out.violation else small_out.describe()
    if kind == "divergence":
        text = f"{text}; on {raw_target(target)} vLLM accepts it and the invariants still searched for hold"
    row.update(version=version, finding=f"{what}: {text}"[:300], kind=kind,
               invariant=small_out.violation.id if small_out.violation else None, seconds=round(seconds, 3),
               trace_ops=len(small), trace=str(path), raw=raw, issue=issue_for(version, kind, what),
               seed=args.seed, ops=ops_before + len(trace_ops))
    if start_from is not None:
        row["continued"] = start_from.finding
        if row["issue"] == "no public issue":  # say what state it was met in, without claiming a cause
            row["issue"] += (f"; met running on from {start_from.finding} "
                             f"({issue_for(version, 'violation', start_from.finding)})")
    if kind == "violation" and raw == args.raw:  # a trace judged on the raw target would be refused again
        runs_on.keep(cfg, small, str(what))
    row["_paused"] += time.monotonic()
    return row


def _judged_raw(cfg: OffloadConfig, ops: list[dict[str, Any]], factory: Any, oracle: tuple[str, ...], refusal: Any,
                target: str) -> tuple[Any, Any, bool]:
    """A refusal of ``ops``' last operation by kvspec's adapter, judged on ``raw:<target>``, where
    the call reaches vLLM: (factory, outcome, raw). What vLLM then does (a violation or a crash) is
    the finding, on the raw target; when the oracle's invariants (those not yet found) hold, the
    refusal stays (on ``target``) and is reported as a divergence."""
    from kvspec.adapters.targets import get_factory
    from kvspec.drivers.harness import run_ops

    raw_factory = get_factory(raw_target(target))
    judged = run_ops(cfg, ops, raw_factory, oracle)
    if judged.failed:
        return raw_factory, judged, True
    return factory, refusal, False


def _refused(out: Any) -> bool:
    """A ``KVSpecError`` from the target stopped the trace (cleanly, or after the engine had acted
    on the same operation), not the engine refusing its own generated input."""
    return bool((out.kind == "expectation" and not out.input_error)
                or (out.kind == "crash" and out.exception in _KVSPEC_ERRORS))


def _kind(out: Any, raw: bool) -> str:
    """violation or crash as the harness says; a refusal: a *divergence* (the model's rule, with vLLM
    judged clean on the raw target), or on the raw target itself a *rejection* (the adapter could
    not build vLLM's arguments: a gap of kvspec)."""
    if out.kind == "expectation" or (out.kind == "crash" and out.exception in _KVSPEC_ERRORS):
        return "rejection" if raw else "divergence"
    return str(out.kind)


def _error_names() -> frozenset[str]:
    from kvspec.contract import errors

    return frozenset(n for n, c in vars(errors).items() if isinstance(c, type) and issubclass(c, errors.KVSpecError))


_KVSPEC_ERRORS = _error_names()
