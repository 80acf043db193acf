"""Replay every kept finding of ``kvspec history`` in every release's venv: where a problem appears
and where it disappears, the evidence that attributes each finding to a public issue.

    .venv/bin/python scripts/vllm-history-matrix.py [--releases 0.19.1,...] [--out FILE]

Each trace under tests/traces/vllm_history/<version>/ is run on target ``vllm@R`` (``raw:vllm@R``
for a raw finding) for every release R, in R's own venv (one process per release: ``--worker R``),
judged by its own finding's invariant only (a crash needs no oracle), so a rule another release
breaks on every step does not hide it. A cell is the invariant or exception type the trace ends in
there, ``n/a`` when the trace does not apply (the release cannot build its configuration, or its
state left what the trace's later operations need, e.g. a report of a store event it never issued), ``-`` when every
operation ran clean. A row's attribution is
the public issue (``kvspec.commands.history.KNOWN``) among those matching the finding in its own
release whose fix release is the first later release where the row runs clean (or that is never
fixed, when it never does); with a single candidate that does not fit so, that candidate and the
release where the trace went clean anyway; ``unverified`` when none fits. Writes the rows as JSON
(default docs/vllm-history-matrix.json) and prints a table. O(traces x releases) replays.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "traces" / "vllm_history"


def _worker(version: str, paths: list[str]) -> None:
    """In ``version``'s venv: one JSON line per trace, its outcome on that release."""
    from kvspec.adapters.targets import get_factory
    from kvspec.drivers import trace as trace_io
    from kvspec.drivers.harness import run_ops

    for path in paths:
        tr = trace_io.read(path)
        target = ("raw:" if tr.target.startswith("raw:") else "") + f"vllm@{version}"
        f = tr.finding or {}
        oracle = (f["invariant"],) if f.get("invariant") else ()  # this rule only; a crash needs no oracle
        out = run_ops(tr.config, tr.ops, get_factory(target), oracle)
        if not out.failed:
            what = "-"
        elif out.op_name == "(setup)":  # the release cannot build this configuration
            what = "n/a"
        else:
            what = out.violation.id if out.violation else out.exception or "n/a"
        print(json.dumps({"trace": path, "release": version, "outcome": what}), flush=True)


def attribute(own: str, kind: str, what: str, cells: dict[str, str], releases: list[str]) -> str:
    """The candidate issue whose fix is where the row first runs clean after its own release."""
    from kvspec.adapters.vllm_compat import Release
    from kvspec.commands.history import KNOWN

    later = [r for r in releases if Release(r).key > Release(own).key]
    clean = next((r for r in later if cells.get(r) == "-"), None)
    for k in KNOWN:
        if k.kind != kind or k.what != what or not Release(own).at_least(k.first):
            continue
        if k.fixed is not None and Release(own).at_least(k.fixed):
            continue
        fixed_at = None if k.fixed is None else next((r for r in later if Release(r).at_least(k.fixed)), None)
        if fixed_at == clean:
            return k.issue
    only = {k.issue for k in KNOWN if k.kind == kind and k.what == what and Release(own).at_least(k.first)
            and not (k.fixed is not None and Release(own).at_least(k.fixed))}
    if len(only) == 1 and clean is not None:  # one cause, but this trace also needs something a later release changed
        return f"{only.pop()} (this trace runs clean from {clean} on, before the cause's fix)"
    return "unverified"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--releases", default="0.19.1,0.23.0,0.29.0,0.31.0,0.33.0")
    p.add_argument("--out", default=str(ROOT / "docs" / "vllm-history-matrix.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.worker, args.paths)
        return 0
    from kvspec.adapters.vllm_compat import venv_for

    releases = args.releases.split(",")
    paths = sorted(str(t.relative_to(ROOT)) for t in TRACES.glob("*/*.jsonl"))
    cells: dict[str, dict[str, str]] = {t: {} for t in paths}
    for r in releases:
        py = venv_for(r, ROOT) / "bin" / "python"
        proc = subprocess.run([str(py), __file__, "--worker", r, *paths], cwd=ROOT, capture_output=True, text=True,
                              check=True)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                cells[row["trace"]][r] = row["outcome"]
    rows: list[dict[str, Any]] = []
    for t in paths:
        header = json.loads((ROOT / t).read_text().splitlines()[0])
        f = header["finding"]
        own = Path(t).parent.name
        what = f["invariant"] or f["exception"]
        rows.append({"trace": t, "release": own, "finding": what, "kind": f["kind"], "cells": cells[t],
                     "issue": attribute(own, f["kind"], what, cells[t], releases)})
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{'found in':<9}{'finding':<18}" + "".join(f"{r:<19}" for r in releases) + "issue")
    for row in rows:
        print(f"{row['release']:<9}{row['finding']:<18}" + "".join(f"{row['cells'].get(r, '?'):<19}" for r in releases)
              + row["issue"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
