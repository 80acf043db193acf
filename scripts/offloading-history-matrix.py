#!/usr/bin/env python3
"""Replay every kept finding of the second manager's history on every release.

    python scripts/offloading-history-matrix.py [--traces tests/traces/offloading_history]
                                                [--versions 0.23.0,0.29.0,0.31.0,0.33.0] [--json]

For each trace (found by ``kvspec history --manager offloading`` on some release) and each
release whose venv exists (``.vllm-venvs/VERSION``, 0.33.0 also ``.vllm-venv``), runs
``kvspec replay TRACE --target vllm-offloading@VERSION --json`` in that venv and prints which
invariant the trace breaks there, ``clean``, or ``refused`` (the release answered an earlier call
differently, so the trace makes a call it does not allow): where a finding stops reproducing is
where its cause was fixed. A release without a venv is shown as ``no venv``. Exit codes: 0 the matrix was
made, 2 bad arguments, 3 a replay that ended otherwise than clean or finding.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELEASES = "0.23.0,0.29.0,0.31.0,0.33.0"


def venv_python(version: str) -> Path | None:
    for venv in (ROOT / ".vllm-venvs" / version, *([ROOT / ".vllm-venv"] if version == "0.33.0" else [])):
        if (venv / "bin" / "python").exists():
            return venv / "bin" / "python"
    return None


def replay(python: Path, trace: Path, version: str) -> str:
    proc = subprocess.run([str(python), "-m", "kvspec.cli", "replay", str(trace), "--target",
                           f"vllm-offloading@{version}", "--json"], capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and "refused it" in proc.stderr:
        return "refused"  # the release answered differently earlier, so a later call is not one it allows
    if proc.returncode not in (0, 1):
        tail = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        print(f"{trace.name} on {version}: replay exited {proc.returncode}: {tail}", file=sys.stderr)
        sys.exit(3)
    found = json.loads(proc.stdout.strip().splitlines()[-1])["finding"]
    return "clean" if found is None else str(found["invariant"] or "crash")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=str(ROOT / "tests" / "traces" / "offloading_history"))
    p.add_argument("--versions", default=RELEASES)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    traces = sorted(Path(args.traces).rglob("*.jsonl"))
    if not traces:
        print(f"no traces under {args.traces}", file=sys.stderr)
        return 2
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    rows = []
    for trace in traces:
        row = {"trace": str(trace.relative_to(ROOT)) if trace.is_relative_to(ROOT) else str(trace)}
        for v in versions:
            python = venv_python(v)
            row[v] = "no venv" if python is None else replay(python, trace, v)
        rows.append(row)
        if not args.json:
            print(f"{trace.parent.name}/{trace.name[:56]:56} " + " ".join(f"{row[v]:>8}" for v in versions), flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
