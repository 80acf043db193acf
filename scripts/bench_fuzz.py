"""Fuzz throughput: checked operations per second of the fuzzer's loop, the policy's claimed oracle
after every operation; medians of interleaved rounds in one run. Each rate is given per second of
wall time and per second of the process's CPU time (one core's throughput, less disturbed than
wall time when other jobs share the machine).

    python scripts/bench_fuzz.py [--seconds 4] [--rounds 3] [--targets model,impl] [--policy repair] [--threads 1]
    python scripts/bench_fuzz.py --against REV [--seconds 3] [--rounds 3] [--targets ...] [--policy ...]
    python scripts/bench_fuzz.py --floor [--seconds 4] [--rounds 3] [--targets ...] [--policy ...]

Without ``--against``: incremental vs full checking after every operation, in this tree.
With ``--against REV`` (a git revision of this repository): the fuzzer's loop as ``kvspec fuzz``
runs it (incremental checking) in this tree and in REV's, each round a fresh process per tree,
the two trees alternating; printed per target: both medians (per CPU second) and the median of
the per-round ratios (this tree / REV). REV's tree is exported with ``git archive`` into a
temporary directory and imported from there (``kvspec.specs.mutations.installed_layout``), so REV
must have the same loop (``kvspec.drivers.harness.generate``, ``kvspec.drivers.opgen.random_config``,
``kvspec.adapters.claims.resolve``). With ``--floor``: the fuzzer's loop against its floor, the
same generator driving the same engine operations on the same configurations with no checking at
all (no snapshots, no oracle, no plan facts: ``Engine(target, observe=())``); printed per
target: both medians (per CPU second) and the share of the loop's time that checking takes. No
checking can make the loop faster than its floor. ``--threads``: torch intra-op threads (default 1, what
campaign workers use: ``kvspec.drivers.campaign.single_threaded``; 0 leaves torch's own default).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rate(target: str, policy: str, seconds: float, incremental: bool, seed: int) -> tuple[float, float]:
    """Checked operations per second of wall time and per second of this process's CPU time
    (what one core gives when other jobs share the machine), over ``seconds`` of wall time."""
    from kvspec.adapters import claims as claimed
    from kvspec.adapters.targets import get_factory
    from kvspec.drivers.harness import generate
    from kvspec.drivers.opgen import RandomChoices, random_config

    factory, rng, ops = get_factory(target), random.Random(seed), 0
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        cfg = random_config(RandomChoices(rng), policy, False)
        trace, out = generate(cfg, factory, rng, 60, claimed.resolve(None, cfg, None).ids, incremental=incremental)
        ops += len(trace) + out.rejected
    return ops / (time.perf_counter() - start), ops / (time.process_time() - cpu)


def bare_rate(target: str, policy: str, seconds: float, seed: int) -> float:
    """The loop's floor: operations per CPU second of the generator and the engine alone (traces of
    60 operations, each configuration drawn as ``rate`` draws it; a rejected operation counts, as
    the fuzzer counts it), with nothing observed, snapshotted or judged."""
    from kvspec.adapters.targets import get_factory
    from kvspec.contract.errors import KVSpecError
    from kvspec.drivers.engine import Engine
    from kvspec.drivers.opgen import FUZZ_MIX, OpGenerator, RandomChoices, random_config

    factory, rng, ops = get_factory(target), random.Random(seed), 0
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        cfg = random_config(RandomChoices(rng), policy, False)
        engine = Engine(factory(cfg), ())
        gen = OpGenerator(cfg, RandomChoices(rng), FUZZ_MIX)
        for _ in range(60):
            op = gen.next_op(engine)
            try:
                engine.apply(op)
            except KVSpecError:
                pass
            ops += 1
    return ops / (time.process_time() - cpu)


def floor(targets: list[str], policy: str, seconds: float, rounds: int) -> None:
    for target in targets:
        loop, bare = [], []
        for r in range(rounds):
            loop.append(rate(target, policy, seconds, True, r)[1])
            bare.append(bare_rate(target, policy, seconds, r))
        full, low = statistics.median(loop), statistics.median(bare)
        print(f"{target:6s} {policy}: fuzz loop {full:7.0f}, floor (no checking) {low:7.0f} ops per CPU second; "
              f"checking takes {1 - full / low:.0%} of the loop ({rounds} rounds of {seconds:g} s)", flush=True)


def export_tree(rev: str, into: Path) -> Path:
    """REV's files under ``into``, in the installed layout (``installed_layout``), so that
    ``PYTHONPATH=into`` imports REV's kvspec; returns ``into``."""
    from kvspec.specs.mutations import installed_layout

    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--against {rev}: git archive failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        extract_tree(tar, into)
    return installed_layout(into)


def extract_tree(tar: tarfile.TarFile, into: Path) -> None:
    """Extract a ``git archive`` of this repository under ``into``: with the "data" filter where
    ``tarfile`` has one (Python 3.11.4+, 3.12), else (3.11.0-3.11.3, e.g. Debian's 3.11.2) after
    checking the same things it would: every member a file, directory or link, none of them, nor
    a link's target, leaving ``into``."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, filter="data")
        return
    root = into.resolve()

    def inside(path: Path) -> bool:
        return path == root or root in path.parents

    for m in tar.getmembers():
        where = (root / m.name).resolve()
        if m.issym():
            target = (where.parent / m.linkname).resolve()
        elif m.islnk():
            target = (root / m.linkname).resolve()
        else:
            target = where
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()) or not inside(where) or not inside(target):
            raise SystemExit(f"refusing to extract {m.name!r}: not a plain file, directory or link inside {root}")
    tar.extractall(into)


def measure_in(tree: Path | None, target: str, policy: str, seconds: float, seed: int, threads: int) -> float:
    """One round in a fresh process: this tree's (``tree`` None) or the exported one's; returns
    checked operations per CPU second."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", target, policy, str(seconds), str(seed),
           "--threads", str(threads)]
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)  # found before the editable install's finder, which comes last
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"a measurement in {tree or 'this tree'} failed:\n{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(got["kvspec"]).resolve().is_relative_to((tree or ROOT).resolve()):
        raise SystemExit(f"the measurement imported kvspec from {got['kvspec']}, not from {tree or ROOT}")
    return float(got["per_cpu_second"])


def against(rev: str, targets: list[str], policy: str, seconds: float, rounds: int, threads: int) -> None:
    with tempfile.TemporaryDirectory(prefix="kvspec-bench-") as tmp:
        tree = export_tree(rev, Path(tmp))
        for target in targets:
            here, there = [], []
            for r in range(rounds):
                there.append(measure_in(tree, target, policy, seconds, r, threads))
                here.append(measure_in(None, target, policy, seconds, r, threads))
            ratio = statistics.median(h / t for h, t in zip(here, there, strict=True))
            print(f"{target:6s} {policy}: this tree {statistics.median(here):7.0f}, {rev} "
                  f"{statistics.median(there):7.0f} checked ops per CPU second; median paired ratio {ratio:.2f} "
                  f"({rounds} rounds of {seconds:g} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per measurement (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--targets", default="model,impl", help="comma-separated targets (default model,impl)")
    p.add_argument("--policy", default="repair", help="policy (default repair)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, 0: torch's default (default 1)")
    p.add_argument("--against", metavar="REV", help="compare the fuzzer's loop with REV's tree (default: compare "
                                                     "incremental with full checking in this tree)")
    p.add_argument("--floor", action="store_true",
                   help="compare the fuzzer's loop with its floor: the same operations with no checking")
    p.add_argument("--measure", nargs=4, metavar=("TARGET", "POLICY", "SECONDS", "SEED"), help=argparse.SUPPRESS)
    a = p.parse_args()
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.measure:  # one round of --against, in its own process
        target, policy, seconds, seed = a.measure
        wall, cpu = rate(target, policy, float(seconds), True, int(seed))
        import kvspec

        print(json.dumps({"per_wall_second": wall, "per_cpu_second": cpu, "kvspec": kvspec.__file__}))
        return
    if a.floor:
        floor(a.targets.split(","), a.policy, a.seconds, a.rounds)
        return
    if a.against:
        against(a.against, a.targets.split(","), a.policy, a.seconds, a.rounds, a.threads)
        return
    for target in a.targets.split(","):
        got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for r in range(a.rounds):
            for inc in (False, True):
                got[inc].append(rate(target, a.policy, a.seconds, inc, r))
        (full, full_cpu), (inc, inc_cpu) = (
            (statistics.median(w for w, _ in got[m]), statistics.median(c for _, c in got[m])) for m in (False, True))
        print(f"{target:6s} {a.policy} threads {torch.get_num_threads()}: full {full:7.0f} ops/s, "
              f"incremental {inc:7.0f} ops/s, ratio {inc / full:.2f}; per CPU second: full {full_cpu:7.0f}, "
              f"incremental {inc_cpu:7.0f}")


if __name__ == "__main__":
    main()
