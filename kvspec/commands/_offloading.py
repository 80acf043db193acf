"""Helper of ``kvspec fuzz`` and ``kvspec replay``: both for the second manager (``CPUOffloadingManager``).

``fuzz`` and ``replay`` hand over here when the target is one of the second manager's
(``offloading``, ``vllm-offloading``, ``bug:<offloading variant>``) or the trace's header says
``manager: offloading``. Options that only the first manager has (``--refine``, ``--configs``,
``--raw``, ``--resume``, more than one worker, ``--ray``, ``--explain``, ``--html``) are refused
with exit 2 naming the option, rather than ignored. The oracle is the target's claims (O1-O10,
every manager-level invariant, for the model, impl and vLLM; a variant's catalogued ids), ``all``
(the same: O11-O15 need a snapshot of vLLM's scheduler and connector), or a list of O-ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.adapters.targets import get_offloading_factory
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, ConfigError, KVSpecError, TraceError
from kvspec.contract.offloading import POLICIES
from kvspec.drivers import offloading_fuzz as ofz
from kvspec.oracle.catalogue import MANAGER_INVARIANTS, OFFLOADING_CATALOGUE


def oracle_of(spec: str | None, target: str) -> tuple[str, tuple[str, ...]]:
    """(label, ids) of ``--oracle`` for a second-manager target; ``ConfigError`` for ids of the
    first manager or unknown ones."""
    if spec in (None, "claims"):
        if target.startswith("bug:"):
            from kvspec.model.offloading.bugs import OFFLOADING_BUGS

            return f"claims of {target}", OFFLOADING_BUGS[target[4:]].oracle
        return "claims", MANAGER_INVARIANTS
    if spec == "all":
        return "all", MANAGER_INVARIANTS
    ids = tuple(dict.fromkeys(i.strip() for i in spec.split(",") if i.strip()))
    unknown = [i for i in ids if i not in OFFLOADING_CATALOGUE]
    if not ids or unknown:
        raise ConfigError(f"--oracle: {', '.join(unknown[:5]) or 'no ids'} not among the offloading manager's "
                          f"invariants {', '.join(OFFLOADING_CATALOGUE)}")
    return ",".join(ids), ids


def _refuse_first_manager_options(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(args, name, None)
        if name == "workers":
            if value not in (None, 1):
                raise ConfigError("--workers: the offloading manager's fuzzer runs one worker")
        elif value not in (None, False):
            raise ConfigError(f"--{name.replace('_', '-')} is not available for the offloading manager's targets")


def _policy(args: argparse.Namespace, target: str) -> str | None:
    if args.policy is not None and args.policy not in POLICIES:
        raise ConfigError(f"--policy: the offloading manager's policies are {', '.join(POLICIES)}, not {args.policy!r}")
    if target.startswith("bug:"):
        from kvspec.model.offloading.bugs import OFFLOADING_BUGS

        own = OFFLOADING_BUGS[target[4:]].policy
        if own is not None and args.policy is not None and args.policy != own:
            raise ConfigError(f"{target} runs under policy {own!r}, not {args.policy!r}")
        return args.policy or own
    chosen: str | None = args.policy  # None: each trace draws LRU or ARC
    return chosen


def fuzz(args: argparse.Namespace) -> int:
    _refuse_first_manager_options(args, ("refine", "configs", "raw", "resume", "workers", "ray"))
    factory = get_offloading_factory(args.target)
    label, oracle = oracle_of(args.oracle, args.target)
    policy = _policy(args, args.target)
    out = Path(args.out)

    def progress(r: ofz.FuzzResult) -> None:
        if not args.json:
            print(f"  {r.seconds:6.1f} s  {r.traces} traces  {r.ops} operations", file=sys.stderr)

    res = ofz.fuzz(factory, args.budget, args.seed, oracle, policy, progress)
    saved = None
    if res.finding is not None and res.config is not None:
        out.mkdir(parents=True, exist_ok=True)
        body = json.dumps(res.trace, sort_keys=True).encode()
        name = f"{args.target.replace(':', '-')}-{res.config.policy}-{res.finding.invariant or 'crash'}-" \
               f"{hashlib.sha256(body).hexdigest()[:10]}.jsonl"
        saved = out / name
        with saved.open("w") as fh:
            ofz.write_trace(fh, res.config, args.target, oracle, res.finding, res.trace)
    doc: dict[str, Any] = {"manager": "offloading", "target": args.target, "policy": policy or "lru|arc",
                           "oracle": {"name": label, "ids": list(oracle)}, "seed": args.seed,
                           "traces": res.traces, "ops": res.ops, "rejected": res.rejected,
                           "seconds": round(res.seconds, 3),
                           "finding": None if res.finding is None else {
                               **res.finding.to_json(), "trace": str(saved), "ops": len(res.trace),
                               "shrunk_from": res.shrunk_from,
                               "config": None if res.config is None else res.config.to_json()}}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"fuzz {args.target} (offloading manager, policy {doc['policy']}), oracle {label}: "
              f"{res.traces} traces, {res.ops} operations in {res.seconds:.1f} s, {res.rejected} rejected")
        if res.finding is None:
            print("nothing found")
        else:
            print(f"FOUND {res.finding.kind}: {res.finding.message}")
            print(f"  shrunk from {res.shrunk_from} to {len(res.trace)} operations: {saved}")
    return EXIT_FINDING if res.finding is not None else EXIT_CLEAN


def _read_trace(path: str) -> ofz.OffloadingTrace:
    """A second-manager trace file; ``ConfigError`` when it cannot be read, ``TraceError`` when malformed."""
    try:
        with open(path) as fh:
            return ofz.read_trace(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc.strerror or exc}") from None


def replay(args: argparse.Namespace) -> int:
    _refuse_first_manager_options(args, ("raw", "refine", "explain", "html", "against"))
    tr = _read_trace(args.trace)
    target = args.target or tr.target
    factory = get_offloading_factory(target)
    if args.oracle is None:
        unknown = [i for i in tr.oracle if i not in OFFLOADING_CATALOGUE]
        if unknown or not tr.oracle:
            raise TraceError(1, f"oracle: {', '.join(unknown[:3]) or 'empty'} not among the offloading invariants")
        label, oracle = f"recorded ({','.join(tr.oracle)})", tr.oracle
    else:
        label, oracle = oracle_of(args.oracle, target)
    outcome = ofz.run(factory, tr.config, tr.ops, oracle)
    if outcome.rejected:
        raise TraceError(1, f"operation {outcome.ops}: the target refused it (not a call vLLM's connector makes)")
    found = outcome.finding
    recorded = tr.finding
    same = found is not None and recorded is not None and found.kind == recorded.get("kind") and \
        found.invariant == recorded.get("invariant") and found.op_index == recorded.get("op_index")
    doc = {"manager": "offloading", "target": target, "oracle": {"name": label, "ids": list(oracle)},
           "ops": len(tr.ops), "finding": None if found is None else found.to_json(),
           "reproduces_recorded": same if recorded is not None else None}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"replay {args.trace} on {target} (offloading manager), oracle {label}: {len(tr.ops)} operations")
        if found is None:
            print("clean" + (" (the recorded finding did NOT reproduce)" if recorded is not None else ""))
        else:
            print(f"op {found.op_index}: {found.kind}: {found.message}")
            if recorded is not None:
                print("reproduces the recorded finding" if same else "differs from the recorded finding")
    return EXIT_FINDING if found is not None else EXIT_CLEAN


def trace_is_offloading(path: str) -> bool:
    """Whether the file's first line is a second-manager trace header (False if unreadable:
    the first manager's reader then reports the problem)."""
    try:
        with open(path) as fh:
            first = fh.readline(ofz.MAX_LINE)
        return ofz.is_offloading_header(json.loads(first))
    except (OSError, ValueError):
        return False


def snapshot(args: argparse.Namespace) -> int:
    """``kvspec snapshot`` of a second-manager trace: replay it on the target with the driver
    (``--at N``: after operation N) and write the driver's snapshot (the target's, plus what the
    driver observed), the file ``check-snapshot`` reads as ``offloading-snapshot.schema.json``.
    Refused operations change nothing and are counted; a crash writes nothing (exit 1)."""
    from kvspec.commands._snapshot_out import report_crash, write_snapshot
    from kvspec.drivers.offloading import Driver

    tr = _read_trace(args.trace)
    target = args.target or tr.target
    if args.at is not None and args.at >= len(tr.ops):
        raise ConfigError(f"--at {args.at}: the trace has {len(tr.ops)} operation(s)")
    driver = Driver(get_offloading_factory(target)(tr.config))
    ops = tr.ops if args.at is None else tr.ops[:args.at + 1]
    rejected = 0
    for i, op in enumerate(ops):
        try:
            driver.apply(op)
        except KVSpecError:
            rejected += 1
        except Exception as exc:  # the target's crash: there is no state to show
            return report_crash(target, i, exc)
    return write_snapshot(driver.snapshot(), args.out, f"{target} (offloading manager)", len(ops), rejected)


# -- kvspec history --manager offloading ---------------------------------------------------------

# Releases whose CPUOffloadingManager has the interface kvspec's adapter speaks (request contexts,
# keys packed with the group): 0.23.0 on. 0.19.x looks blocks up by hash lists without contexts.
OFFLOADING_RELEASES = ("0.23.0", "0.29.0", "0.31.0", "0.33.0")

@dataclass(frozen=True)
class KnownCause:
    """A public vLLM change whose cause, read in the releases' code, shows as these findings: the
    invariants, under these policies, in configurations ``applies`` accepts, in releases before
    ``fixed_in``."""

    text: str
    invariants: frozenset[str]
    policies: frozenset[str]
    fixed_in: str
    applies: Callable[[dict[str, Any]], bool] = lambda config: True


OFFLOADING_KNOWN = (
    KnownCause("PR #55461: ARC's eviction gives up when T2 has no victim left although T1 has evictable "
               "chunks (the fix falls back to T1): a store fails that could have evicted",
               frozenset({"O6"}), frozenset({"arc"}), "0.31.0"),
    KnownCause("store_threshold >= 2: prepare_store protects only the offered keys that passed the threshold, so "
               "an offered key already cached whose count aged out of the tracker can be evicted by the same "
               "store (O9: it is then evicted ahead of the order); fixed where prepare_store (reworked by "
               "PR #51787) partitions the whole offer first", frozenset({"O5", "O9"}), frozenset({"lru", "arc"}),
               "0.31.0", lambda config: config.get("store_threshold", 1) >= 2),
)


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def known_cause(version: str, invariant: str | None, policy: str, config: dict[str, Any]) -> str:
    """The public change that explains a finding in ``version``, or '' when none is known."""
    for cause in OFFLOADING_KNOWN:
        if (invariant in cause.invariants and policy in cause.policies and cause.applies(config)
                and _release_key(version) < _release_key(cause.fixed_in)):
            return cause.text
    return ""


def _search(python: Path, version: str, policy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fuzz one release and policy for ``--budget`` seconds in its venv; each finding's invariant
    then leaves the oracle and the search goes on with the rest (a crash ends it)."""
    oracle = list(MANAGER_INVARIANTS)
    rows: list[dict[str, Any]] = []
    spent = 0.0
    while oracle and spent < args.budget:
        cmd = [str(python), "-m", "kvspec.cli", "fuzz", "--target", f"vllm-offloading@{version}", "--policy", policy,
               "--budget", f"{args.budget - spent:.1f}", "--seed", str(args.seed), "--oracle", ",".join(oracle),
               "--out", str(Path(args.out) / version), "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=args.budget * 2 + 300)
        if proc.returncode not in (EXIT_CLEAN, EXIT_FINDING):
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no message)"]
            raise ConfigError(f"vLLM {version} ({policy}): kvspec fuzz exited {proc.returncode}: {tail[0][:300]}")
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        found = doc["finding"]
        if found is None:
            break
        rows.append({"version": version, "policy": policy, "kind": found["kind"], "invariant": found["invariant"],
                     "message": found["message"], "seconds": round(spent + doc["seconds"], 1), "ops": found["ops"],
                     "trace": found["trace"], "config": found["config"],
                     "known": known_cause(version, found["invariant"], policy, found["config"] or {})})
        spent += doc["seconds"]
        if found["invariant"] is None:
            break
        oracle.remove(found["invariant"])
    return rows


def history(args: argparse.Namespace) -> int:
    """``kvspec history --manager offloading``: per release and policy, ``vllm-offloading@VERSION``
    fuzzed in that release's venv with the O-invariants as the only oracle."""
    from kvspec.adapters import vllm_compat as compat

    if args.raw or args.worker is not None:
        raise ConfigError("--raw is not available with --manager offloading")
    if args.workers not in (None, 1):
        raise ConfigError("--workers: history --manager offloading fuzzes the releases one after another")
    unused = [flag for flag, used in (("--seeds", args.seeds != 1), ("--no-swarm", not args.swarm),
                                      ("--no-continue", not args.continue_)) if used]
    if unused:
        raise ConfigError(f"history --manager offloading has no {' or '.join(unused)} (one search per release "
                          "and policy, each a kvspec fuzz with its own defaults)")
    versions = [v.strip() for v in (args.versions or ",".join(OFFLOADING_RELEASES)).split(",") if v.strip()]
    for v in versions:
        compat.parse_release(v)
        if _release_key(v) < _release_key(OFFLOADING_RELEASES[0]):
            raise ConfigError(f"vLLM {v}: its CPUOffloadingManager predates request contexts; "
                              f"--manager offloading covers {OFFLOADING_RELEASES[0]} on")
    missing = [v for v in versions if not (compat.venv_for(v) / "bin" / "python").exists()]
    if missing:
        raise ConfigError("no venv for vLLM " + ", ".join(missing) + "; build each with "
                          "scripts/setup-vllm-release.sh VERSION")
    rows: list[dict[str, Any]] = []
    for v in versions:
        for policy in POLICIES:
            print(f"history: vLLM {v} ({policy}): fuzzing the offloading manager for {args.budget:.0f}s",
                  file=sys.stderr)
            rows += _search(compat.venv_for(v) / "bin" / "python", v, policy, args)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"{'release':8} {'policy':6} {'finding':10} {'at s':>6} {'ops':>4}  known cause")
        for v in versions:
            for policy in POLICIES:
                found = [r for r in rows if r["version"] == v and r["policy"] == policy]
                for r in found:
                    print(f"{v:8} {policy:6} {r['invariant'] or 'crash':10} {r['seconds']:6.1f} {r['ops']:4}  "
                          f"{r['known'] or '(none known)'}")
                if not found:
                    print(f"{v:8} {policy:6} {'-':10} {'':6} {'':4}  nothing found in {args.budget:.0f}s")
    return EXIT_FINDING if rows else EXIT_CLEAN


# -- kvspec bugs --manager offloading ------------------------------------------------------------


def hunt_bugs(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The second manager's known-bug variants, each hunted with its own oracle on seeds
    ``seed..seed+K-1``: one row per variant with the time to find (``kvspec.drivers.findtime``),
    the first seed's shrunk trace written under ``--out``."""
    from kvspec.drivers.findtime import Sample, time_to_find
    from kvspec.model.offloading.bugs import OFFLOADING_BUGS

    if args.workers not in (None, 1) or args.ray is not None:
        raise ConfigError("--workers/--ray: bugs --manager offloading hunts its variants one after another")
    names = args.only.split(",") if args.only is not None else list(OFFLOADING_BUGS)
    if not any(names):
        raise ConfigError("--only needs at least one bug name (comma-separated); leave it out for every bug")
    unknown = [n for n in names if n not in OFFLOADING_BUGS]
    if unknown:
        raise ConfigError(f"unknown offloading bug {unknown[0][:60]!r}; known: {', '.join(OFFLOADING_BUGS)}")
    rows = []
    for name in names:
        bug = OFFLOADING_BUGS[name]
        samples, first = [], None
        for k in range(args.seeds):
            res = ofz.fuzz(bug.manager, args.budget, args.seed + k, bug.oracle, bug.policy)
            found = res.finding is not None and res.finding.kind == "violation"
            samples.append(Sample(args.seed + k, found, res.seconds, res.ops))
            first = first or res
        assert first is not None
        f = first.finding
        if args.out is not None and f is not None and first.config is not None:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            with (out / f"bug-{name}-{f.invariant or 'crash'}.jsonl").open("w") as fh:
                ofz.write_trace(fh, first.config, f"bug:{name}", bug.oracle, f, first.trace)
        t = time_to_find(samples)
        rows.append({"bug": name, "manager": "offloading", "kind": None if f is None else f.kind,
                     "invariant": None if f is None else f.invariant, "exception": None,
                     "trace_ops": len(first.trace) if f is not None else None, **t.to_json(),
                     "found": all(s.found for s in samples)})
    return rows, names
