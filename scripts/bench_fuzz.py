"""Fuzz throughput: checked operations per second with incremental vs full checking after every
operation, per target, the policy's claimed oracle; medians of interleaved rounds in one run. Each
rate is given per second of wall time and per second of the process's CPU time (one core's
throughput, less disturbed than wall time when other jobs share the machine).

    python scripts/bench_fuzz.py [--seconds 4] [--rounds 3] [--targets model,impl] [--policy repair] [--threads 1]

``--threads``: torch intra-op threads (default 1, what campaign workers use:
``kvspec.drivers.campaign.single_threaded``; 0 leaves torch's own default, one per core).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvspec.adapters import claims as claimed
from kvspec.adapters.targets import get_factory
from kvspec.drivers.harness import generate
from kvspec.drivers.opgen import RandomChoices, random_config


def rate(target: str, policy: str, seconds: float, incremental: bool, seed: int) -> tuple[float, float]:
    """Checked operations per second of wall time and per second of this process's CPU time
    (what one core gives when other jobs share the machine), over ``seconds`` of wall time."""
    factory, rng, ops = get_factory(target), random.Random(seed), 0
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        cfg = random_config(RandomChoices(rng), policy, False)
        trace, out = generate(cfg, factory, rng, 60, claimed.resolve(None, cfg, None).ids, incremental=incremental)
        ops += len(trace) + out.rejected
    return ops / (time.perf_counter() - start), ops / (time.process_time() - cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per measurement (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--targets", default="model,impl", help="comma-separated targets (default model,impl)")
    p.add_argument("--policy", default="repair", help="policy (default repair)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, 0: torch's default (default 1)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
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
