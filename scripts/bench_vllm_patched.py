"""Planning cost per step of vLLM 0.33.0, vLLM + pr47235 (and vLLM + repair once built), measured
in vLLM's own code, with a constant number of CPU evictions per step.

    .venv/bin/python scripts/bench_vllm_patched.py [--sizes 1000,10000,100000,1000000] [--evict 8] [--runs 5]

Runs one worker process per venv that exists (``.vllm-venv``, ``.vllm-pr47235-venv``,
``.vllm-repair-venv``) and size, ``--runs`` times over (each run measures every venv at every
size, one after the other). Each worker gives the median wall time of
``SimpleCPUOffloadScheduler.build_connector_meta`` over its steps; each run gives the ratios to
unpatched vLLM of that run. The table prints, per number of stored blocks, the median over the
runs of each time and of each ratio, and the smallest and largest ratio (``--json`` for one JSON
object with every run).

The workload (same in every venv): ``R`` decoding requests hold ``N`` stored blocks in all
(their cursors at the end, every block cached on a full CPU pool), each scheduled for one
token per step; one prefilling request confirms ``--evict`` new blocks per step, whose stores
evict that many cached entries from the CPU LRU head. Stores complete between steps (not
timed). ``--evict 0`` measures the cost with no eviction at all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENVS = {"vllm": ".vllm-venv", "vllm+pr47235": ".vllm-pr47235-venv", "vllm+repair": ".vllm-repair-venv"}
BLOCK = 4
REQUESTS = 64


def _worker(n_stored: int, evict: int, steps: int) -> dict[str, Any]:
    """Time planning steps at ``n_stored`` stored blocks in the running venv's vLLM."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.simple_kv_offload.manager import StoreRequestState

    from kvspec.adapters.vllm import VllmTarget, _import_vllm
    from kvspec.contract.config import OffloadConfig

    v = _import_vllm()
    per_req = max(1, n_stored // REQUESTS)
    new_blocks = evict * (steps + 4)
    gpu_n = per_req * REQUESTS + new_blocks + 2
    cfg = OffloadConfig(block_size=BLOCK, num_gpu_blocks=gpu_n, num_cpu_blocks=per_req * REQUESTS + 1,
                        policy="baseline")
    target = VllmTarget(cfg, v)
    mgr, gpu, cpu = target.manager, target.gpu_pool.pool, target.manager.cpu_block_pool

    def request(rid: str, n_blocks: int, computed_blocks: int) -> Any:
        hashes = [f"{rid}-{i}".encode().ljust(16, b"\0") for i in range(n_blocks)]
        return SimpleNamespace(request_id=rid, block_hashes=hashes, num_computed_tokens=computed_blocks * BLOCK + 1,
                               num_output_placeholders=0, lora_request=None, all_token_ids=[])

    def hashed_gpu_blocks(req: Any) -> list[int]:
        blocks = gpu.get_new_blocks(len(req.block_hashes))
        for h, b in zip(req.block_hashes, blocks, strict=True):
            gpu._insert_block_hash(make_block_hash_with_group_id(h, 0), b, num_tokens=None)
        return [b.block_id for b in blocks]

    rids = [f"r{k}" for k in range(REQUESTS)]
    for rid in rids:
        req = request(rid, per_req, per_req)
        ids = hashed_gpu_blocks(req)
        cpu_blocks = cpu.get_new_blocks(per_req)
        for h, c in zip(req.block_hashes, cpu_blocks, strict=True):
            cpu._insert_block_hash(make_block_hash_with_group_id(h, 0), c, num_tokens=None)
        cpu.free_blocks(cpu_blocks)
        mgr._reqs_to_store[rid] = StoreRequestState(req, (ids,), [per_req])
    prefill = request("p", new_blocks, 0)
    mgr._reqs_to_store["p"] = StoreRequestState(prefill, (hashed_gpu_blocks(prefill),), [0])
    if hasattr(cpu, "consume_eviction_signal"):
        cpu.consume_eviction_signal()

    names = [*rids, "p"]
    times: list[float] = []
    stored_blocks: list[int] = []
    for step in range(steps + 2):
        prefill.num_computed_tokens = evict * (step + 1) * BLOCK
        out = v.SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=v.CachedRequestData(
                req_ids=names, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                new_block_ids=[None] * len(names), num_computed_tokens=[0] * len(names),
                num_output_tokens=[0] * len(names)),
            num_scheduled_tokens={rid: 1 for rid in names}, total_num_scheduled_tokens=len(names),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
            free_encoder_mm_hashes=[], preempted_req_ids=set())
        start = time.perf_counter()
        meta = mgr.build_connector_meta(out)
        elapsed = time.perf_counter() - start
        stored_blocks.append(len(meta.store_gpu_blocks))
        if step >= 2:  # the first steps warm up
            times.append(elapsed)
        if meta.store_event >= 0:
            mgr.update_connector_output(v.KVConnectorOutput(
                finished_recving=set(),
                kv_connector_worker_meta=v.SimpleCPUOffloadWorkerMetadata(
                    completed_store_events={meta.store_event: 1})))
    return {"stored": per_req * REQUESTS, "median_s": statistics.median(times),
            "copies_per_step": statistics.median(stored_blocks[2:])}


def _run(venv: str, n: int, evict: int, steps: int) -> dict[str, Any]:
    py = ROOT / venv / "bin" / "python"
    cmd = [str(py), __file__, "--worker", str(n), "--evict", str(evict), "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{venv} at {n}: {done.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000,1000000")
    ap.add_argument("--evict", type=int, default=8, help="CPU evictions per step (0: none)")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per size (the median is reported)")
    ap.add_argument("--runs", type=int, default=1, help="runs of every venv at every size (medians over them)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(_worker(args.worker, args.evict, args.steps)))
        return 0
    targets = [t for t, d in VENVS.items() if (ROOT / d / "bin" / "python").exists()]
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = [{n: {t: _run(VENVS[t], n, args.evict, args.steps) for t in targets} for n in sizes}
            for _ in range(args.runs)]
    if args.json:
        print(json.dumps({"evictions_per_step": args.evict, "targets": targets, "runs": runs}))
        return 0
    print(f"planning per step: median over {args.runs} run(s) of the median of {args.steps} steps; "
          f"{args.evict} CPU evictions per step, {REQUESTS} decoding requests; ratios [min-max over runs]")
    head = f"{'stored blocks':>14} | " + " | ".join(f"{t + ' ms/step':>22}" for t in targets)
    print(head + "".join(f" | {t + ' / vllm':>26}" for t in targets[1:]))
    for n in sizes:
        per_run = [run[n] for run in runs]
        cells = [f"{statistics.median(r[t]['median_s'] for r in per_run) * 1e3:>14.3f} "
                 f"({statistics.median(r[t]['copies_per_step'] for r in per_run):>4.0f} cp)" for t in targets]
        ratios = []
        for t in targets[1:]:
            rs = [r[t]["median_s"] / r["vllm"]["median_s"] for r in per_run]
            ratios.append(f"{statistics.median(rs):>10.2f} [{min(rs):.2f}-{max(rs):.2f}]".rjust(26))
        print(f"{per_run[0]['vllm']['stored']:>14} | " + " | ".join(cells) + "".join(f" | {c}" for c in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
