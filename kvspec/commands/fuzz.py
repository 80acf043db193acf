"""``kvspec fuzz``: budgeted random traces against a target; every finding saved as a trace.

The oracle is what the policy claims unless ``--oracle`` says otherwise (``all``, or
ids). A finding is a *violation* (an invariant of the oracle broke) or a *crash* (the
target raised something other than a ``KVSpecError``); operations the target rejects
cleanly are counted, not reported. ``--raw`` (real vLLM targets only) fuzzes ``raw:vllm`` or
``raw:vllm@VERSION``: calls the model would refuse reach vLLM, and what vLLM does with them is
the oracle's to judge (an exception inside vLLM is a crash). The unshrunk trace is written as soon as the finding
is made, the shrunk one when shrinking ends; file names carry target, policy, oracle
and a content hash, so no run overwrites another's finding. Next to each trace is its finding
page (the same name, ``.html``: ``kvspec.report.html``).

Exit codes: 0 nothing found, 1 a finding, 2 bad arguments, 3 internal error, 130
interrupted (statistics so far printed, findings kept).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.adapters.targets import RAW_PREFIX, get_factory, is_offloading_target, raw_target
from kvspec.contract.config import POLICIES
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, EXIT_INTERRUPTED, ConfigError, exit_codes
from kvspec.contract.offloading import POLICIES as OFFLOADING_POLICIES
from kvspec.drivers.campaign import (
    AUTO_WORKERS,
    Distinct,
    JobsInterrupted,
    check_ray,
    check_workers,
    dedupe_key,
    run_workers,
    worker_seeds,
)
from kvspec.drivers.harness import REPLAYS, FuzzResult, _slug, check_writable, finding_name, fuzz, save_trace
from kvspec.drivers.opgen import CONFIG_WORDS, NO_PINS, ConfigPins, parse_pins
from kvspec.drivers.trace import Trace
from kvspec.oracle import oracles
from kvspec.report.html import page_for_trace

NAME = "fuzz"
HELP = "fuzz a target with random engine traces; write each finding as a shrunk trace"
EPILOG = exit_codes("nothing found", "finding")


def budget_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text[:40]!r}")
    return value


def workers_count(text: str) -> int | str:
    """An argparse type for ``--workers``: a whole number (its range is ``check_workers``'s), or
    ``auto``."""
    if text == AUTO_WORKERS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {text[:40]!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--target", default="model",
                   help="model, impl, vllm or bug:<name> (default: model); the offloading manager's: offloading, "
                        "vllm-offloading, bug:<offloading variant>")
    p.add_argument("--policy", default=None, choices=(*POLICIES, *OFFLOADING_POLICIES),
                   help="policy (default: repair; baseline for vllm, raw:vllm and vllm@VERSION; the patch's own "
                        "for vllm+pr47235 (signal-rescan) and vllm+repair (repair); a bug's own policy for "
                        "bug:<name>)")
    p.add_argument("--budget", type=budget_seconds, default=60.0, help="seconds to search (default 60)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed (default 0); with --workers N, worker i runs seed*N+i")
    add_workers_argument(p, "processes, each with its own seed for the whole budget; findings deduplicated "
                            "(same invariant, same shrunk trace up to renaming requests)")
    add_ray_argument(p)
    p.add_argument("--oracle", default=None, metavar="claims|all|ID,ID",
                   help="invariants that judge the run (default: claims, what the policy guarantees; "
                        "for bug:<name>, the catalogue's oracle of that variant)")
    p.add_argument("--refine", action="store_true",
                   help="also check refinement (R1) after every accepted operation: each request's step is one "
                        "the proofs' transitions (kvspec.specs.transitions) admit; a rejection is a finding")
    p.add_argument("--configs", default=None, metavar="WORD,WORD",
                   help="draw only configurations with these features, to aim a campaign at a rare class: "
                        f"{', '.join(CONFIG_WORDS)} (a sliding-window group or none, async or synchronous "
                        "scheduling, speculative decoding or none; default: all drawn, each half the time; with "
                        "--no-swarm a sliding-window group 3 times in 10, synchronous scheduling and speculative "
                        "decoding each 1 time in 4)")
    p.add_argument("--no-swarm", dest="swarm", action="store_false",
                   help="draw every trace from one fixed mix of operations and configuration features (default: "
                        "swarm testing, each trace with its own mix: kvspec.drivers.opgen.swarm_mix)")
    p.add_argument("--raw", action="store_true",
                   help="real vLLM only: calls the model would refuse reach vLLM (target raw:vllm, raw:vllm@VERSION)")
    p.add_argument("--out", default="fuzz-out",
                   help="directory for finding traces and the campaign's state file (default fuzz-out)")
    p.add_argument("--resume", action="store_true",
                   help="go on where the last campaign with the same target, policy, oracle, configs, swarm, "
                        "seed and workers stopped (each worker's generator state, kept in --out); default: start "
                        "afresh")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_workers_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--workers N|auto``, shared by the campaign commands; ``what`` says what the workers do."""
    p.add_argument("--workers", type=workers_count, default=1, metavar="N|auto",
                   help=f"{what}; auto: one per usable core of this machine (default 1)")


def add_ray_argument(p: argparse.ArgumentParser) -> None:
    """``--ray``, shared by the campaign commands."""
    p.add_argument("--ray", default=None, metavar="ADDRESS|auto",
                   help="run the workers as Ray tasks on the cluster at ADDRESS (HOST:PORT), or the one this "
                        "machine belongs to (auto); results gathered here (needs kvspec[ray]; default: local "
                        "processes)")


@dataclass(frozen=True)
class Job:
    """One worker's fuzzing job (picklable: it crosses into the worker process)."""

    target: str
    policy: str
    budget: float
    oracle: str | None
    out: str
    quiet: bool  # no progress or "finding written" lines (--json, more than one worker, or Ray)
    resume: dict[int, list[Any]] = field(default_factory=dict)  # seed -> generator state to go on from
    refine: bool = False  # the refinement check (R1) after every accepted operation
    pins: ConfigPins = NO_PINS  # --configs: features every drawn configuration has
    swarm: bool = True  # swarm testing (--no-swarm: False)


PROGRESS_EVERY_S = 10.0  # progress lines of a run whose stderr is not a terminal


@dataclass
class WorkerResult:
    seed: int
    result: FuzzResult
    saved: dict[str, Path] = field(default_factory=dict)


def fuzz_one(job: Job, seed: int) -> WorkerResult:
    """One worker: ``fuzz`` with ``seed``, every finding saved (with its page) as soon as it exists."""
    factory = get_factory(job.target)
    bug = job.target[4:] if job.target.startswith("bug:") else None
    done = WorkerResult(seed, FuzzResult(False, 0.0, 0, 0))

    def keep(trace: Trace, stage: str) -> None:
        done.saved[stage] = save_finding(job, factory, trace, stage)

    tty = sys.stderr.isatty()
    shown = [-PROGRESS_EVERY_S]  # when the last progress line was printed (not a terminal)

    def progress(traces: int, ops: int, secs: float) -> None:
        """On a terminal, one line rewritten every 20 traces; in a log, a line every
        ``PROGRESS_EVERY_S`` seconds."""
        if job.quiet:
            return
        line = f"{traces} traces, {ops} ops, {secs:.0f}/{job.budget:.0f}s"
        if tty and traces % 20 == 0:
            print(f"\r{line}", end="", file=sys.stderr)
        elif not tty and secs - shown[0] >= PROGRESS_EVERY_S:
            shown[0] = secs
            print(line, file=sys.stderr)

    done.result = fuzz(factory, job.policy, job.budget, seed, job.oracle, job.target, progress=progress,
                       bug=bug, on_finding=keep, refine=job.refine, resume=job.resume.get(seed), pins=job.pins,
                       swarm=job.swarm)
    return done


def save_finding(job: Job, factory: Any, trace: Trace, stage: str) -> Path:
    """Write a finding's trace and its page under ``job.out``; the trace's path."""
    path = save_trace(trace, job.out, finding_name(job.target, job.policy, _oracle_label(job.oracle), trace, stage))
    page = page_for_trace(trace, path, factory)
    if not job.quiet:
        print(f"\n{stage} finding written: {path} (page: {page})", file=sys.stderr)
    return path


def _save_here(job: Job, results: list[WorkerResult]) -> None:
    """Ray workers wrote their findings on their own machines: write them here too (same names)."""
    factory = get_factory(job.target)
    for w in results:
        for stage, trace in (("unshrunk", w.result.unshrunk), ("shrunk", w.result.trace)):
            if trace is not None:
                w.saved[stage] = save_finding(job, factory, trace, stage)


def run(args: argparse.Namespace) -> int:
    if is_offloading_target(args.target):
        from kvspec.commands import _offloading as offloading

        return offloading.fuzz(args)
    if args.policy in OFFLOADING_POLICIES:
        raise ConfigError(f"--policy {args.policy} is the offloading manager's; target {args.target!r} takes "
                          f"{', '.join(POLICIES)}")
    oracles.check_spec(args.oracle)
    pins = parse_pins(args.configs) if args.configs is not None else NO_PINS
    workers = check_workers(args.workers, args.ray)
    if args.raw:
        args.target = raw_target(args.target)
    ray = check_ray(args.ray)
    get_factory(args.target)  # an unknown target is a ConfigError before any work
    bug = args.target[4:] if args.target.startswith("bug:") else None
    policy = _default_policy(args.target, bug)
    if bug is not None and args.policy is not None and args.policy != policy:
        raise ConfigError(f"bug:{bug} runs under policy {policy!r}, not {args.policy!r}")
    policy = args.policy or policy
    check_writable(args.out)
    quiet = args.json or workers > 1 or ray is not None
    state = CampaignState.at(Path(args.out), args.target, policy, _oracle_label(args.oracle), args.seed, workers,
                             pins, args.swarm)
    if args.resume:
        state.load()
    job = Job(args.target, policy, args.budget, args.oracle, str(args.out), quiet, state.states, args.refine, pins,
              args.swarm)
    start = time.monotonic()
    if (workers > 1 or ray is not None) and not args.json:
        where = f" as Ray tasks on {ray}" if ray else ""
        print(f"{workers} workers{where}, seeds {', '.join(map(str, worker_seeds(args.seed, workers)))}",
              file=sys.stderr)
    stopped = False
    try:
        results = run_workers(functools.partial(fuzz_one, job), args.seed, workers, ray)
    except JobsInterrupted as stop:  # Ctrl-C reached this process: the workers stopped with it
        results, stopped = stop.done(), True
        if not results:  # no worker had started its search
            raise KeyboardInterrupt from None
    if ray is not None:
        _save_here(job, results)
    state.save(results)
    report(args, results, policy, time.monotonic() - start, state, pins, interrupted=stopped)
    if stopped or any(w.result.interrupted for w in results):
        return EXIT_INTERRUPTED
    return EXIT_FINDING if any(w.result.found for w in results) else EXIT_CLEAN


def _default_policy(target: str, bug: str | None) -> str:
    if bug is not None:
        from kvspec.model.bugs import BUGS

        return BUGS[bug].policy
    from kvspec.adapters.vllm_patched import PATCHED_TARGETS

    if target in PATCHED_TARGETS:  # a patched vLLM implements one policy: its patch's
        return PATCHED_TARGETS[target][1]
    return "baseline" if target.removeprefix(RAW_PREFIX) == "vllm" or "vllm@" in target else "repair"


def _oracle_label(spec: str | None) -> str:
    return "claims" if spec in (None, "claims") else str(spec)


@dataclass
class CampaignState:
    """Where a campaign stopped: each worker's generator state and the totals so far, kept as JSON
    in the output directory under a name made of target, policy, oracle, the ``--configs`` pins
    (when any), seed and workers."""

    path: Path
    states: dict[int, list[Any]] = field(default_factory=dict)
    traces: int = 0  # before this run
    ops: int = 0

    @classmethod
    def at(cls, out: Path, target: str, policy: str, oracle: str, seed: int, workers: int,
           pins: ConfigPins = NO_PINS, swarm: bool = True) -> CampaignState:
        configs = ["configs-" + "+".join(pins.words())] if pins.words() else []
        configs += [] if swarm else ["noswarm"]  # a fixed-mix campaign's generator states are its own
        name = "-".join(_slug(x) for x in (target, policy, oracle, *configs, f"seed{seed}", f"workers{workers}"))
        return cls(out / f"campaign-{name}.json")

    def load(self) -> None:
        """The saved state, if any (a malformed file is a ``ConfigError`` naming it)."""
        if not self.path.exists():
            return
        try:
            saved = json.loads(self.path.read_text())
            self.states = {int(k): v for k, v in saved["states"].items()}
            self.traces, self.ops = int(saved["traces"]), int(saved["ops"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"--resume: {self.path} is not a campaign state file ({exc})") from None

    def save(self, results: list[WorkerResult]) -> None:
        doc = {"states": {str(w.seed): w.result.rng_state for w in results},
               "traces": self.traces + sum(w.result.traces for w in results),
               "ops": self.ops + sum(w.result.ops for w in results)}
        self.path.write_text(json.dumps(doc))


def report(args: argparse.Namespace, results: list[WorkerResult], policy: str, wall: float,
           state: CampaignState, pins: ConfigPins = NO_PINS, interrupted: bool = False) -> None:
    """The campaign's statistics and its distinct findings, as text or one JSON object."""
    distinct = Distinct()
    for w in results:
        res = w.result
        trace = res.trace or res.unshrunk
        if res.found and trace is not None and res.outcome is not None:
            distinct.add(dedupe_key(res.outcome.signature(), trace.config.to_json(), trace.ops), w)
    firsts: list[WorkerResult] = list(distinct.first.values())
    lead = firsts[0] if firsts else results[0]
    res, saved = lead.result, lead.saved
    ops = sum(w.result.ops for w in results)
    rate = sum(w.result.ops_per_second for w in results)  # the campaign's: each worker's rate, added
    rare = {name: sum(w.result.rare.get(name, 0) for w in results) for name in res.rare}
    rejected = sum(w.result.rejected for w in results)
    replays: dict[str, int] = {}
    for w in results:
        for why, n in w.result.replays.items():
            replays[why] = replays.get(why, 0) + n
    interrupted = interrupted or any(w.result.interrupted for w in results)
    found = any(w.result.found for w in results)
    out: dict[str, Any] = {
        "target": args.target, "policy": policy, "oracle": res.oracle, "configs": pins.words(),
        "swarm": args.swarm, "found": found,
        "kind": res.kind, "interrupted": interrupted, "seconds": round(wall if len(results) > 1 else res.seconds, 3),
        "traces": sum(w.result.traces for w in results), "ops": ops, "ops_per_second": round(rate, 1),
        "rejected": rejected, "rare_paths": rare, "replays": replays,
        "finding": res.outcome.to_json() if res.found and res.outcome else None,
        "trace": str(saved["shrunk"]) if "shrunk" in saved else None,
        "unshrunk_trace": str(saved["unshrunk"]) if "unshrunk" in saved else None,
        "trace_ops": len(res.trace.ops) if res.trace else None,
        "workers": len(results),
        "campaign": {"state": str(state.path), "resumed": bool(state.states),
                     "traces_before": state.traces, "ops_before": state.ops},
        "per_worker": [{"seed": w.seed, "traces": w.result.traces, "ops": w.result.ops,
                        "ops_per_second": round(w.result.ops_per_second, 1), "found": w.result.found}
                       for w in results],
        "findings": [{"kind": w.result.kind, "finding": w.result.outcome.to_json() if w.result.outcome else None,
                      "seed": w.seed, "found_by": n, "trace": str(w.saved.get("shrunk")),
                      "trace_ops": len(w.result.trace.ops) if w.result.trace else None,
                      "unshrunk_trace": str(w.saved.get("unshrunk"))}
                     for w, n in zip(firsts, distinct.count.values(), strict=True)],
    }
    if args.json:
        print(json.dumps(out))
        return
    _print_report(out)


def _print_report(out: dict[str, Any]) -> None:
    print(file=sys.stderr)
    state = " (interrupted)" if out["interrupted"] else ""
    configs = f", configs: {', '.join(out['configs'])}" if out["configs"] else ""
    workers = f" on {out['workers']} workers" if out["workers"] > 1 else ""
    print(f"{out['traces']} traces, {out['ops']} operations in {out['seconds']:.1f}s{workers} "
          f"({out['ops_per_second']:.0f} checked ops/s), target {out['target']}, policy {out['policy']}, "
          f"oracle: {out['oracle']}{configs}{state}")
    if out["campaign"]["resumed"]:
        print(f"  resumed a campaign of {out['campaign']['traces_before']} traces, "
              f"{out['campaign']['ops_before']} operations ({out['campaign']['state']})")
    if out["rejected"]:
        print(f"  operations rejected cleanly by the target: {out['rejected']}")
    for name, n in out["rare_paths"].items():
        print(f"  {name}: {n}")
    for why, n in out["replays"].items():
        print(f"  WARNING: {n} trace(s) replayed ({why}): {REPLAYS[why]}")
    if not out["findings"]:
        print("nothing found")
        return
    for f in out["findings"]:
        by = f" (found by {f['found_by']} workers)" if f["found_by"] > 1 else ""
        print(f"FOUND {f['kind']}: {f['finding']['description'] if f['finding'] else ''}{by}")
        if f["trace_ops"] is not None:
            print(f"shrunk trace ({f['trace_ops']} operations): {f['trace']}")
        print(f"unshrunk trace: {f['unshrunk_trace']}")
