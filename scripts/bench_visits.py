#!/usr/bin/env python3
"""Block visits per planning step for ``signal-rescan`` and ``repair`` as stored blocks grow.

Workload, per size N (through the engine model, as vLLM would drive the manager):
long-lived requests (four, or more of at most 4,000 blocks each) whose N full blocks
are all stored (the CPU pool holds
exactly N blocks, so it is full), decoding one token per step; every step a new
2-block request is admitted, stored and finished, so each step's store evicts
2 CPU entries (a constant number of evictions per step, all from the LRU head,
i.e. entries of the long-lived requests).

Both policies count ``visits_last_plan`` (positions and records looked at in one
``build_connector_meta``): signal-rescan rescans ``[0, cursor)`` of every scheduled
request whenever the eviction flag is set; repair looks at new positions, pending
lost records and the victims it considers. The table shows, per size, the mean and
maximum visits over the measured steps and the mean wall time of the planning call
(a benchmark, not a test: timings vary with the machine).

    scripts/bench_visits.py                      # sizes 1e3 1e4 1e5 1e6
    scripts/bench_visits.py --sizes 1000 10000 --steps 8 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler

MAX_BLOCKS_PER_REQUEST = 4000  # the engine model caps a prompt at 65,536 tokens
CHURN_BLOCKS = 2


def _drain(e: Engine) -> None:
    for ev in sorted(e.reports_left):
        e.op_report(ev, e.reports_left[ev])
    for rid in sorted(e.loads_shipped):
        e.op_load_done(rid)


def measure(policy: str, stored: int, steps: int) -> dict[str, Any]:
    n_req = max(4, -(-stored // MAX_BLOCKS_PER_REQUEST))
    per = stored // n_req
    n = per * n_req
    cfg = OffloadConfig(policy=policy, num_cpu_blocks=n + 1, num_gpu_blocks=n + 4 * n_req + 64,
                        max_num_batched_tokens=1 << 16)
    e = Engine(make_scheduler(cfg))
    target = e.target
    times: list[float] = []
    plan = target.build_connector_meta

    def timed(out: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return plan(out)
        finally:
            times.append(time.perf_counter() - t0)

    target.build_connector_meta = timed  # type: ignore[method-assign]
    rids = [f"L{i}" for i in range(n_req)]
    for i, rid in enumerate(rids):
        e.op_add(rid, family=10 + i, prompt_len=per * 16 + 1, max_tokens=1 << 15)
    e.op_step(admit=rids, chunk=per * 16 + 1)
    e.op_step()  # confirmed now: all n blocks stored
    _drain(e)
    assert target.cpu_pool.get_num_free_blocks() == n and len(target.cpu_pool.cached) == n
    visits: list[int] = []
    copies: list[int] = []
    plan_s: list[float] = []
    warmup = 3
    for k in range(warmup + steps):
        rid = f"C{k}"
        e.op_add(rid, family=1000 + k, prompt_len=CHURN_BLOCKS * 16 + 1, max_tokens=1)
        times.clear()
        m1 = e.op_step(admit=[rid])
        v1 = int(target.policy.visits_last_plan)
        e.op_finish(rid)  # the finish flush allocates 2 CPU blocks now: 2 evictions
        m2 = e.op_step()  # the first planning step after those evictions
        v2 = int(target.policy.visits_last_plan)
        _drain(e)
        if k >= warmup:
            visits += [v1, v2]
            copies.append(len(m1.store_cpu_blocks) + len(m2.store_cpu_blocks))
            plan_s += times
    return {
        "policy": policy,
        "stored_blocks": n,
        "long_requests": n_req,
        "planning_steps": len(visits),
        "visits_mean": statistics.fmean(visits),
        "visits_max": max(visits),
        "plan_ms_mean": 1000 * statistics.fmean(plan_s),
        "copies_per_step_mean": statistics.fmean(copies) / 2,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--steps", type=int, default=6, help="measured planning steps per size")
    ap.add_argument("--policies", nargs="+", default=["signal-rescan", "repair"],
                    choices=["signal-rescan", "repair"], help="policies that count visits_last_plan")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    rows = []
    for size in args.sizes:
        for policy in args.policies:
            t0 = time.perf_counter()
            row = measure(policy, size, args.steps)
            rows.append(row)
            if not args.json:
                print(f"  measured {policy} at {size} stored blocks in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    head = f"{'stored blocks':>13}  {'policy':<14}{'visits/step mean':>17}{'max':>9}{'plan ms':>10}{'copies/step':>13}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['stored_blocks']:>13}  {r['policy']:<14}{r['visits_mean']:>17.1f}{r['visits_max']:>9}"
              f"{r['plan_ms_mean']:>10.2f}{r['copies_per_step_mean']:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
