"""Torch operations per planning step of the implementation, and what one costs inside a step.

    python scripts/bench_impl_ops.py [--workload decode] [--scale 1024,64,100000] [--policy baseline] [--runs 5]

Drives ``kvspec bench``'s workload (``kvspec.commands.bench.Driver``) on ``impl`` with one torch
thread. Per run (a fresh target, one warm-up step, then 8 steps as ``kvspec bench`` measures
them): the median planning time per step (``build_connector_meta``); then the same steps once
more on a fresh target with every aten operation counted (a ``TorchDispatchMode``, outside any
timed region). Printed: the medians over runs of the step time, of the operations per step and
of their quotient, the step time per operation (Python between the operations included), next
to the time one small indexing operation takes when repeated in a tight loop. The quotient is
what a design with fewer operations would save per operation left out.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import timeit
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvspec.commands.bench import WORKLOADS, Driver, Scale, _config, _factory, _parse_scale


class CountOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def steps(workload: str, scale: Scale, policy: str, counter: CountOps | None) -> list[float]:
    target = _factory("impl", "cpu")(_config(workload, scale, policy))
    d = Driver(target, workload, scale)
    d.setup()
    d.step()  # warm-up
    if counter is not None:
        build = target.build_connector_meta

        def counted(out: Any) -> Any:
            with counter:
                return build(out)
        target.build_connector_meta = counted
        d.clock = type(d.clock)(target)
    gc.disable()
    try:
        return [d.step()[0] for _ in range(8)]
    finally:
        gc.enable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="decode", choices=WORKLOADS, help="workload (default decode)")
    p.add_argument("--scale", default="1024,64,100000", help="R,BPR,CPU (default 1024,64,100000)")
    p.add_argument("--policy", default="baseline", help="policy (default baseline)")
    p.add_argument("--runs", type=int, default=5, help="runs (default 5)")
    a = p.parse_args()
    torch.set_num_threads(1)
    scale = Scale(*_parse_scale(a.scale))
    times, counts = [], []
    last = CountOps()
    for _ in range(a.runs):
        times.append(statistics.median(steps(a.workload, scale, a.policy, None)))
        last = CountOps()
        steps(a.workload, scale, a.policy, last)
        counts.append(sum(last.ops.values()) / 8)
    x, idx = torch.arange(100_000), torch.arange(64) * 3
    tight = timeit.timeit(lambda: x[idx], number=20_000) / 20_000
    step, ops = statistics.median(times), statistics.median(counts)
    print(f"impl {a.policy} {a.workload} {a.scale}: {1e3 * step:.3f} ms per planning step, {ops:.0f} torch "
          f"operations per step, {1e6 * step / ops:.1f} us of step per operation (one small gather in a tight "
          f"loop: {1e6 * tight:.1f} us); medians of {a.runs} runs")
    print("most frequent (last run, per step): " + ", ".join(
        f"{name.replace('aten.', '')} {n / 8:g}" for name, n in last.ops.most_common(8)))


if __name__ == "__main__":
    main()
