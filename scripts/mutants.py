"""Run the mutation table: each mutation of ``kvspec.specs.mutations`` on a scratch copy, through the layers.

For every mutation (or those named with ``--only``), the repository is copied to a temporary
directory, the mutation applied, and the layers run there in ``LAYERS`` order (``--layers``
picks some) until one fails: that layer caught it. ``--all-layers`` runs every layer whatever
happens. A mutation no layer catches is a *survivor* (exit 1). ``--clean`` first checks that
the unmutated copy passes every layer selected (else a "catch" would mean nothing). Prints one
Markdown table row per mutation (the table kept in specs/PROOFS.md) and, with ``--json FILE``,
writes the results. Cost: one scratch copy and up to one run of each layer per mutation
(layers take 20-90 s each on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvspec.specs.mutations import LAYERS, MUTATIONS, Mutation, apply, by_name, scratch_copy, scratch_env

REPO = Path(__file__).resolve().parent.parent
LAYER_TIMEOUT = 900


def run_layer(root: Path, layer: str) -> tuple[bool, float, str]:
    """(passed, seconds, the output's last lines) of one layer on the copy at ``root``."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *LAYERS[layer]], cwd=root, env=scratch_env(root), capture_output=True,
                              text=True, timeout=LAYER_TIMEOUT)
        ok, out = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        ok, out = False, f"timed out after {LAYER_TIMEOUT} s"
    tail = "\n".join(out.strip().splitlines()[-3:])
    return ok, time.monotonic() - t0, tail


def run_mutation(m: Mutation | None, layers: list[str], all_layers: bool) -> dict[str, object]:
    """Apply ``m`` (None: no mutation) to a fresh copy and run ``layers``; which failed."""
    with tempfile.TemporaryDirectory(prefix="kvspec-mutant-") as tmp:
        root = scratch_copy(REPO, Path(tmp))
        if m is not None:
            apply(root, m)
        caught: list[str] = []
        seconds: dict[str, float] = {}
        for layer in layers:
            ok, secs, tail = run_layer(root, layer)
            seconds[layer] = round(secs, 1)
            print(f"  {m.name if m else '(clean)'}: {layer} {'passed' if ok else 'FAILED'} in {secs:.0f}s"
                  + ("" if ok else f"\n    {tail.replace(chr(10), chr(10) + '    ')}"), file=sys.stderr, flush=True)
            if not ok:
                caught.append(layer)
                if not all_layers:
                    break
    return {"name": m.name if m else None, "caught_by": caught, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated mutation names")
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"layers in order (default {','.join(LAYERS)})")
    ap.add_argument("--all-layers", action="store_true", help="run every layer even after one caught it")
    ap.add_argument("--clean", action="store_true", help="first check the unmutated copy passes every layer")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    args = ap.parse_args(argv)
    layers = [x for x in args.layers.split(",") if x]
    unknown = [x for x in layers if x not in LAYERS]
    if unknown:
        ap.error(f"unknown layers: {unknown}")
    muts = [by_name(n) for n in args.only.split(",")] if args.only else list(MUTATIONS)
    results: list[dict[str, object]] = []
    if args.clean:
        clean = run_mutation(None, layers, True)
        if clean["caught_by"]:
            print(f"the unmutated copy fails {clean['caught_by']}: no verdict", file=sys.stderr)
            return 2
    print("| mutation | file | what | caught by |\n|---|---|---|---|")
    for m in muts:
        res = run_mutation(m, layers, args.all_layers)
        results.append(res)
        caught = ", ".join(res["caught_by"]) or "**survives**"  # type: ignore[arg-type]
        print(f"| `{m.name}` | {m.path} | {m.what} | {caught} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    survivors = [r["name"] for r in results if not r["caught_by"]]
    if survivors:
        print(f"survivors: {survivors}", file=sys.stderr)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
