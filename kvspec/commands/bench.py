"""``kvspec bench``: planning and completion time of the implementation against the model.

Three workloads, each driven straight through the target interface (no engine model,
so that only the offload manager's own work is timed):

* ``chat``: shared-prefix chat. Requests come in families of 8 that share the first
  half of their prompt (the same GPU blocks, as a GPU prefix-cache hit gives them);
  chunked prefill confirms one block per request per step.
* ``decode``: long-context decode. Prompts are computed and already stored; every
  request decodes one token per step, at staggered offsets, so about
  ``requests / block_size`` blocks become storable per step.
* ``storm``: eviction storm. The CPU pool starts full of cached entries and is smaller
  than the working set, so every block stored evicts one (entries of running requests
  included: the ``repair`` policy then re-stores, ``signal-rescan`` rescans).

Per (workload, scale, target) it reports the median over runs (fresh target each run)
of the median per-step time of ``build_connector_meta`` (plan) and
``update_connector_output`` (complete, the previous step's store event reported
done), and bookkeeping memory per block. The targets run in the same process,
interleaved run by run, and each ratio is the median over runs of that run's ratio
(paired, so both sides of a ratio saw the same machine load). For ``vllm`` only vLLM's
own calls are timed (``OwnClock``): the adapter's input checks and its mirroring of
requests and scheduler outputs into vLLM objects run outside the timed region. Timings
are measurements, not assertions. Progress goes to stderr; ``--json`` prints one JSON
document (``{"policy", "targets", "rows"}``) at the end.

A payload micro-benchmark (``--payload``) compares the implementation's batched block
copy with one plain ``copy_`` of the same bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass, replace
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, echo
from kvspec.contract.types import BlockIds, CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput

NAME = "bench"
HELP = "time planning (build_connector_meta) and completion (update_connector_output): impl vs model"

WORKLOADS = ("chat", "decode", "storm")
# (requests, blocks per request, CPU blocks)
GRID = [(64, 16, 1_000), (256, 64, 10_000), (1024, 64, 100_000), (1024, 256, 1_000_000)]
STORM_GRID = [(256, 16, 10_000), (256, 16, 1_000_000), (1024, 64, 100_000)]
QUICK_GRID = [(64, 16, 1_000), (256, 16, 10_000)]
BLOCK_SIZE = 16
TARGETS = ("impl", "model", "vllm")
MAX_THREADS = 1024


def _grid_text(grid: list[tuple[int, int, int]]) -> str:
    return " ".join(f"{r},{b},{c}" for r, b, c in grid)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON document at the end: {policy, targets, rows} (default: a text table)")
    p.add_argument("--quick", action="store_true",
                   help=f"small grid ({_grid_text(QUICK_GRID)}) and at most 4 steps, for CI and verify (default off)")
    p.add_argument("--workload", action="append", choices=WORKLOADS,
                   help=f"only this workload (repeatable; default: {', '.join(WORKLOADS)})")
    p.add_argument("--policy", default="baseline", choices=["baseline", "signal-rescan", "repair"],
                   help="the re-store policy of impl and model (default baseline; vllm has only baseline)")
    p.add_argument("--target", action="append", default=None,
                   help="impl, model or vllm (repeatable; default: impl and model)")
    p.add_argument("--runs", type=int, default=5,
                   help="runs per point, >= 1 (default 5; fewer than 5 are raised to 5)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per run, >= 1 (default 8)")
    p.add_argument("--scale", action="append", default=None, metavar="R,BPR,CPU",
                   help="only this scale: requests >= 1, blocks per request >= 1, CPU blocks >= 2, "
                        f"e.g. 1024,64,100000 (repeatable; default chat and decode: {_grid_text(GRID)}; "
                        f"storm: {_grid_text(STORM_GRID)})")
    p.add_argument("--payload", action="store_true",
                   help="also run the payload copy micro-benchmark (default off)")
    p.add_argument("--device", default="cpu",
                   help="device for the implementation: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--threads", type=int, default=1, help=f"torch intra-op threads, 1..{MAX_THREADS} (default 1)")


# -- requests and the driver -------------------------------------------------------------------------


class BenchRequest:
    """The ``RequestView`` the manager reads."""

    __slots__ = ("block_hashes", "num_computed_tokens", "num_output_placeholders", "request_id",
                 "skip_reading_prefix_cache", "total")

    def __init__(self, rid: str, hashes: list[str], total: int) -> None:
        self.request_id = rid
        self.block_hashes = hashes
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.skip_reading_prefix_cache = False
        self.total = total

    @property
    def num_tokens(self) -> int:
        return self.total


@dataclass
class Scale:
    requests: int
    blocks_per_request: int
    cpu_blocks: int


def _register(pool: Any, keys: list[tuple[str, int]], blocks: list[int]) -> None:
    """Give GPU/CPU blocks their keys; in one batch where the pool offers it."""
    if hasattr(pool, "register_many") and hasattr(pool, "keys"):
        import torch

        kids = torch.tensor([pool.keys.key_id(k) for k in keys], dtype=torch.int64, device=pool.device)
        pool.register_many(kids, torch.tensor(blocks, dtype=torch.int64, device=pool.device))
    else:
        for k, b in zip(keys, blocks, strict=True):
            pool.insert_block_hash(k, b)


def _hex(tag: int, i: int) -> str:
    """A distinct 16-hex-digit block hash per (tag, position) (vLLM's adapter wants hex text)."""
    return f"{tag:08x}{i:08x}"


class OwnClock:
    """The time a step's call spent in the target's own code. For vLLM's adapter (a target with
    a ``manager``: vLLM's ``SimpleCPUOffloadScheduler``) that is the time inside vLLM's
    ``build_connector_meta`` and ``update_connector_output`` (the pool operations they make
    included), measured by wrapping the manager's two methods; the adapter's checks and its
    mirroring of requests and outputs into vLLM objects are left out. For any other target,
    the whole call."""

    def __init__(self, target: Any) -> None:
        self.inner: float | None = None
        manager = getattr(target, "manager", None)
        if manager is not None:
            for name in ("build_connector_meta", "update_connector_output"):
                setattr(manager, name, self._timed(getattr(manager, name)))

    def _timed(self, call: Any) -> Any:
        def timed(arg: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(arg)
            finally:
                self.inner = (self.inner or 0.0) + time.perf_counter() - t0
        return timed

    def measure(self, call: Any, arg: Any) -> tuple[Any, float]:
        """``call(arg)`` and the seconds it spent in the target's own code."""
        self.inner = None
        t0 = time.perf_counter()
        got = call(arg)
        outer = time.perf_counter() - t0
        return got, outer if self.inner is None else self.inner


class Driver:
    """Builds a workload's requests, then runs steps and times the two manager calls."""

    def __init__(self, target: Any, workload: str, scale: Scale) -> None:
        self.t = target
        self.clock = OwnClock(target)
        self.w = workload
        self.s = scale
        self.B = target.config.block_size
        self.reqs: list[BenchRequest] = []
        self.tables: list[list[int]] = []
        self.last_event = -1
        self.step_no = 0
        self.extra_blocks: list[int] = []

    def setup(self) -> None:
        s, B, gpu = self.s, self.B, self.t.gpu_pool
        if self.w == "storm":
            self._fill_cpu()
        R, P = s.requests, s.blocks_per_request
        grow = 2 if self.w == "decode" else 0
        shared: dict[int, list[int]] = {}
        keys: list[tuple[str, int]] = []
        kblocks: list[int] = []
        for r in range(R):
            fam = r // 8
            if self.w == "chat":
                half = P // 2
                hashes = [_hex(0x80000000 | fam, i) for i in range(half)] + [_hex(r, i) for i in range(half, P)]
            else:
                hashes = [_hex(r, i) for i in range(P)]
            extra = r % B if self.w == "decode" else 0
            total = P * B + extra + (grow * B if self.w == "decode" else 0)
            req = BenchRequest(f"req{r}", hashes[:], total)
            half = P // 2 if self.w == "chat" else 0
            if half and fam in shared:  # a GPU prefix-cache hit on the family's first request
                prefix = shared[fam]
                gpu.touch(prefix)
                table = prefix + gpu.get_new_blocks(P - half + grow)
                own = range(half, P)
            else:
                table = gpu.get_new_blocks(P + grow)
                shared[fam] = table[:half]
                own = range(P)
            keys += [(hashes[i], 0) for i in own]
            kblocks += [table[i] for i in own]
            req.num_computed_tokens = P * B + extra if self.w == "decode" else 0
            self.reqs.append(req)
            self.tables.append(table)
        _register(gpu, keys, kblocks)
        for req, table in zip(self.reqs, self.tables, strict=True):
            self.t.update_state_after_alloc(req, (list(table),), 0)
        out = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(r.request_id, (list(t),)) for r, t in
                                zip(self.reqs, self.tables, strict=True)],
            num_scheduled_tokens={r.request_id: 1 for r in self.reqs},
        )
        if self.w == "decode":  # the prompt is computed: store it all now (untimed)
            self._settle(self.t.build_connector_meta(out))
        else:
            self.t.build_connector_meta(out)
        payload = getattr(self.t, "payload", None)
        if payload is not None:
            payload.flush()

    def _fill_cpu(self) -> None:
        """Fill the CPU pool with cached filler entries (free, hashed), as finished requests leave it."""
        cpu = self.t.cpu_pool
        n = cpu.get_num_free_blocks()
        blocks = cpu.get_new_blocks(n)
        _register(cpu, [(_hex(0xFFFFFFFF, i), 0) for i in range(n)], blocks)
        cpu.free_blocks(blocks)

    def _settle(self, meta: Any) -> None:
        if meta.store_event >= 0:
            self.t.update_connector_output(KVConnectorOutput(
                completed_store_events={meta.store_event: self.t.config.world_size}))

    def step(self) -> tuple[float, float]:
        """One step: plan (timed), advance tokens, report the previous store event (timed)."""
        B = self.B
        ids: list[str] = []
        new_ids: list[BlockIds | None] = []
        sched: dict[str, int] = {}
        if self.w == "decode":
            for r in self.reqs:
                ids.append(r.request_id)
                new_ids.append(None)
                sched[r.request_id] = 1
        else:
            for r in self.reqs:
                if r.num_computed_tokens < r.total:
                    ids.append(r.request_id)
                    new_ids.append(None)
                    sched[r.request_id] = B
        out = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(ids, new_ids), num_scheduled_tokens=sched)
        meta, plan = self.clock.measure(self.t.build_connector_meta, out)
        for r in self.reqs:
            n = sched.get(r.request_id, 0)
            r.num_computed_tokens = min(r.total, r.num_computed_tokens + n)
            if self.w == "decode" and r.num_computed_tokens % B == 0:
                p = r.num_computed_tokens // B - 1
                if p >= len(r.block_hashes):
                    h = _hex(int(r.request_id[3:]), p)
                    r.block_hashes.append(h)
                    table = self.tables[int(r.request_id[3:])]
                    if p < len(table):
                        self.t.gpu_pool.insert_block_hash((h, 0), table[p])
        done = {}
        if self.last_event >= 0:
            done = {self.last_event: self.t.config.world_size}
        _, complete = self.clock.measure(self.t.update_connector_output, KVConnectorOutput(completed_store_events=done))
        self.last_event = meta.store_event
        self.step_no += 1
        return plan, complete


def _config(workload: str, scale: Scale, policy: str) -> OffloadConfig:
    grow = 2 if workload == "decode" else 0
    gpu = scale.requests * (scale.blocks_per_request + grow) + 16
    cpu = scale.cpu_blocks
    return OffloadConfig(block_size=BLOCK_SIZE, num_gpu_blocks=gpu, num_cpu_blocks=cpu, policy=policy,
                         max_num_batched_tokens=2048)


def _factory(name: str, device: str) -> Any:
    if name == "impl":
        from kvspec.impl import make_scheduler

        return lambda cfg: make_scheduler(cfg, device=device)
    from kvspec.adapters.targets import get_factory

    return get_factory(name)


def _bookkeeping_bytes(name: str, factory: Any, cfg: OffloadConfig, workload: str, scale: Scale) -> float:
    """Bytes per block (GPU + CPU blocks) of the target's own state after setup, payloads excluded."""
    gc.collect()
    tracemalloc.start()
    target = factory(cfg)
    Driver(target, workload, scale).setup()
    py_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tensor_bytes = 0
    if hasattr(target, "memory_bytes"):
        tensor_bytes = sum(target.memory_bytes().values())
    del target
    return (py_bytes + tensor_bytes) / (cfg.num_gpu_blocks + cfg.num_cpu_blocks)


def measure(workload: str, scale: Scale, targets: list[str], policy: str, runs: int, steps: int,
            device: str, progress: Any) -> list[dict[str, Any]]:
    cfg = _config(workload, scale, policy)
    factories = {name: _factory(name, device) for name in targets}
    plans: dict[str, list[float]] = {n: [] for n in targets}
    completes: dict[str, list[float]] = {n: [] for n in targets}
    for run in range(runs):
        for name in targets:
            progress(f"{workload} R={scale.requests} BPR={scale.blocks_per_request} CPU={scale.cpu_blocks} "
                     f"{name} run {run + 1}/{runs}")
            target = factories[name](cfg)
            d = Driver(target, workload, scale)
            d.setup()
            d.step()  # warm-up
            pl, co = [], []
            gc.disable()
            try:
                for _ in range(steps):
                    a, b = d.step()
                    pl.append(a)
                    co.append(b)
            finally:
                gc.enable()
            plans[name].append(statistics.median(pl))
            completes[name].append(statistics.median(co))
            del target, d
    rows: list[dict[str, Any]] = []
    for name in targets:
        rows.append({
            "workload": workload, "requests": scale.requests, "blocks_per_request": scale.blocks_per_request,
            "cpu_blocks": scale.cpu_blocks, "target": name, "policy": policy, "runs": runs, "steps": steps,
            "plan_ms_median": 1e3 * statistics.median(plans[name]),
            "complete_ms_median": 1e3 * statistics.median(completes[name]),
            "bytes_per_block": round(_bookkeeping_bytes(name, factories[name], cfg, workload, scale), 1),
        })
    for r in rows:
        for ref in ("model", "vllm"):
            if ref in targets and r["target"] != ref:
                r[f"plan_ratio_vs_{ref}"] = _paired_ratio(plans[r["target"]], plans[ref])
                r[f"complete_ratio_vs_{ref}"] = _paired_ratio(completes[r["target"]], completes[ref])
    return rows


def _paired_ratio(mine: list[float], ref: list[float]) -> float | None:
    """Median over runs of this run's time / the reference's time in the same run (None if 0)."""
    if any(b == 0 for b in ref):
        return None
    return statistics.median(a / b for a, b in zip(mine, ref, strict=True))


def payload_bench(device: str, runs: int) -> list[dict[str, Any]]:
    """Batched block copy (scattered ids, as a store or load meets them) vs one plain ``copy_`` of the
    same bytes, for three block sizes (fp16 ``[2, 16 tokens, heads, 128]``: 32, 64, 256 KiB); GB/s,
    medians. ``throughput_ratio`` = plain time / batched time."""
    import torch

    from kvspec.impl.payload import copy_blocks

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def timed(fn: Any) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    rows = []
    for heads in (4, 8, 32):
        shape = (2, 16, heads, 128)
        per_block = 2 * 2 * 16 * heads * 128
        n_blocks = (128 << 20) // per_block  # 128 MiB pool, half of it copied
        src = torch.randn((n_blocks, *shape), device=device).to(torch.float16)
        dst = torch.zeros((n_blocks, *shape), dtype=torch.float16)
        g = torch.Generator().manual_seed(0)
        src_ids = torch.randperm(n_blocks, generator=g)[: n_blocks // 2].to(device)
        dst_ids = torch.randperm(n_blocks, generator=g)[: n_blocks // 2]
        flat_src = src[: n_blocks // 2].clone()
        flat_dst = dst[: n_blocks // 2].clone()
        nbytes = flat_src.numel() * flat_src.element_size()
        plains, batcheds, ratios = [], [], []
        for _ in range(max(9, runs)):  # paired, so both see the same machine load
            p = timed(lambda fs=flat_src, fd=flat_dst: fd.copy_(fs))
            b = timed(lambda d=dst, di=dst_ids, s=src, si=src_ids: copy_blocks(d, di, s, si))
            plains.append(p)
            batcheds.append(b)
            ratios.append(p / b)
        assert torch.equal(dst[dst_ids], src[src_ids].cpu())
        plain, batched = statistics.median(plains), statistics.median(batcheds)
        rows.append({"workload": "payload-copy", "device": device, "block_bytes": per_block,
                     "blocks": n_blocks // 2, "bytes": nbytes, "plain_gbps": nbytes / plain / 1e9,
                     "batched_gbps": nbytes / batched / 1e9, "throughput_ratio": statistics.median(ratios)})
        del src, dst, flat_src, flat_dst
    return rows


def _parse_scale(text: str) -> tuple[int, int, int]:
    """``R,BPR,CPU``: three integers, requests >= 1, blocks per request >= 1, CPU blocks >= 2."""
    parts = text.split(",")
    if len(parts) != 3:
        raise ConfigError(f"--scale {echo(text)}: expected R,BPR,CPU (three integers), got {len(parts)} field(s)")
    try:
        r, bpr, cpu = (int(x) for x in parts)
    except ValueError:
        raise ConfigError(f"--scale {echo(text)}: expected R,BPR,CPU (three integers)") from None
    for name, value, low in (("requests", r, 1), ("blocks per request", bpr, 1), ("CPU blocks", cpu, 2)):
        if value < low:
            raise ConfigError(f"--scale {echo(text)}: {name} must be >= {low}, got {value}")
    return r, bpr, cpu


def _parse_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, normalized (``cpu:0`` is ``cpu``); a CUDA device must exist."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {echo(text)}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ConfigError(f"--device {echo(text)}: unsupported device type {dev.type!r}; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {echo(text)}: no CUDA device here (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"--device {echo(text)}: no such CUDA device, this machine has {count} (cuda:0..)")
    return str(dev)


@dataclass
class Plan:
    """What a bench run will do, every argument checked (nothing measured yet)."""

    targets: list[str]
    workloads: list[str]
    points: dict[str, list[tuple[int, int, int]]]
    runs: int
    steps: int
    device: str
    threads: int


def plan(args: argparse.Namespace) -> Plan:
    """Check every argument before any benchmark work starts; ``ConfigError`` names the bad one."""
    targets = list(dict.fromkeys(args.target or ["impl", "model"]))
    for name in targets:
        if name not in TARGETS:
            raise ConfigError(f"unknown bench target {echo(name)}; known: {', '.join(TARGETS)}")
    if "vllm" in targets and args.policy != "baseline":
        raise ConfigError("vLLM implements only the baseline policy")
    for name, value in (("--runs", args.runs), ("--steps", args.steps)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if not 1 <= args.threads <= MAX_THREADS:
        raise ConfigError(f"--threads must be 1..{MAX_THREADS}, got {args.threads}")
    device = _parse_device(args.device)
    workloads = list(dict.fromkeys(args.workload or WORKLOADS))
    if args.scale:
        grid = list(dict.fromkeys(_parse_scale(s) for s in args.scale))
    else:
        grid = QUICK_GRID if args.quick else GRID
    points = {}
    for workload in workloads:
        points[workload] = grid
        if workload == "storm" and not args.scale:
            points[workload] = QUICK_GRID if args.quick else STORM_GRID
        for r, bpr, cpu in points[workload]:
            try:
                _config(workload, Scale(r, bpr, cpu), args.policy).validate()
            except ConfigError as exc:
                raise ConfigError(f"--scale {r},{bpr},{cpu} ({workload}): {exc}") from None
    if "vllm" in targets:
        try:
            from kvspec.adapters.targets import get_factory

            get_factory("vllm")(replace(OffloadConfig(), policy="baseline"))
        except Exception as exc:  # missing vLLM or its dependencies
            why = " ".join(str(exc).split())  # one line
            raise ConfigError(f"target vllm is unavailable: {why if len(why) <= 200 else echo(why, 200)}") from None
    steps = min(args.steps, 4) if args.quick else args.steps
    return Plan(targets, workloads, points, max(5, args.runs), steps, device, args.threads)


def run(args: argparse.Namespace) -> int:
    p = plan(args)
    import torch

    torch.set_num_threads(p.threads)
    started = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[bench {time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    if not args.json:
        print(f"policy {args.policy}; targets {', '.join(p.targets)}; median of {p.runs} runs of {p.steps} steps"
              f"{'; vllm: only its own calls timed' if 'vllm' in p.targets else ''}", flush=True)
    for workload in p.workloads:
        for r, bpr, cpu in p.points[workload]:
            for row in measure(workload, Scale(r, bpr, cpu), p.targets, args.policy, p.runs, p.steps, p.device,
                               progress):
                rows.append(row)
                if not args.json:
                    _print_row(row)
    if args.payload:
        progress("payload copy")
        for row in payload_bench(p.device, p.runs):
            rows.append(row)
            if not args.json:
                _print_row(row)
    if args.json:
        print(json.dumps({"policy": args.policy, "targets": p.targets, "runs": p.runs, "steps": p.steps,
                          "rows": rows}))
    return 0


def _print_row(row: dict[str, Any]) -> None:
    if row["workload"] == "payload-copy":
        print(f"payload copy ({row['device']}, {row['block_bytes'] >> 10} KiB blocks): plain "
              f"{row['plain_gbps']:.2f} GB/s, batched "
              f"{row['batched_gbps']:.2f} GB/s, ratio {row['throughput_ratio']:.2f}", flush=True)
        return
    extra = "".join(f"  plan x{1 / row[f'plan_ratio_vs_{ref}']:.1f} faster than {ref}" for ref in ("model", "vllm")
                    if row.get(f"plan_ratio_vs_{ref}"))
    print(f"{row['policy']:13} {row['workload']:6} R={row['requests']:5} BPR={row['blocks_per_request']:4} "
          f"CPU={row['cpu_blocks']:8} {row['target']:5} plan {row['plan_ms_median']:8.3f} ms  "
          f"complete {row['complete_ms_median']:8.3f} ms  {row['bytes_per_block']:7.1f} B/block{extra}", flush=True)
