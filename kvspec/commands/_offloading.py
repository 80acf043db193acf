"""Helper of ``kvspec fuzz`` and ``kvspec replay``: both for the second manager (``CPUOffloadingManager``).

``fuzz`` and ``replay`` hand over here when the target is one of the second manager's
(``offloading``, ``vllm-offloading``, ``bug:<offloading variant>``) or the trace's header says
``manager: offloading``. Options that only the first manager has (``--refine``, ``--configs``,
``--raw``, ``--resume``, more than one worker, ``--ray``, ``--explain``, ``--html``) are refused
with exit 2 naming the option, rather than ignored. The oracle is the target's claims (every
O-invariant for the model and vLLM; a variant's catalogued ids), ``all``, or a list of O-ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from kvspec.adapters.targets import get_offloading_factory
from kvspec.contract.errors import EXIT_CLEAN, EXIT_FINDING, ConfigError, TraceError
from kvspec.contract.offloading import POLICIES
from kvspec.drivers import offloading_fuzz as ofz
from kvspec.oracle.catalogue import OFFLOADING_CATALOGUE


def oracle_of(spec: str | None, target: str) -> tuple[str, tuple[str, ...]]:
    """(label, ids) of ``--oracle`` for a second-manager target; ``ConfigError`` for ids of the
    first manager or unknown ones."""
    if spec in (None, "claims"):
        if target.startswith("bug:"):
            from kvspec.model.offloading.bugs import OFFLOADING_BUGS

            return f"claims of {target}", OFFLOADING_BUGS[target[4:]].oracle
        return "claims", tuple(OFFLOADING_CATALOGUE)
    if spec == "all":
        return "all", tuple(OFFLOADING_CATALOGUE)
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
                               "shrunk_from": res.shrunk_from}}
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


def replay(args: argparse.Namespace) -> int:
    _refuse_first_manager_options(args, ("raw", "refine", "explain", "html", "against"))
    try:
        with open(args.trace) as fh:
            tr = ofz.read_trace(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {args.trace!r}: {exc.strerror or exc}") from None
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

