"""vLLM's real scheduler with the real ``OffloadingConnector`` (scheduler role), and a worker
played from outside: the connector's scheduler side judged without a model. It runs on the
installed release when that is one of ``vllm_compat.CONNECTOR_RELEASES`` (0.23.0, 0.29.0,
0.31.0, 0.33.0; what differs is stated in ``vllm_compat``), else ``ConfigError``.

``VllmConnectorScheduler(config, options, next_token)`` is ``VllmScheduler`` (the real
``Scheduler``/``AsyncScheduler``, a real ``VllmConfig`` on a local ``config.json``) with
``KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")``: vLLM's own
``CPUOffloadingSpec`` with ``config.num_chunks`` CPU chunks (``cpu_bytes_to_use`` is that many
aligned chunk pages), its ``eviction_policy`` (``lru``/``arc``), ``store_threshold`` and
``offload_prompt_only``. vLLM builds the connector and its ``CPUOffloadingManager`` itself.

The workers are played as ``offloading/worker.py`` behaves: the jobs of each step's
``OffloadingConnectorMetadata`` are in flight from that step on; a job named in a step's
``jobs_to_flush`` is waited for before that step's forward pass (its data is copied then); a
finished job is reported as ``OffloadingWorkerMetadata(completed_jobs={job: num_workers})``,
an asynchronous load also as ``finished_recving={request}``, on the ``KVConnectorOutput`` of the
next batch output processed, provided that batch ran no earlier than the job's step: the worker
meets a job only when it runs the batch whose metadata carries it, so under asynchronous
scheduling (two batches in flight) a job issued or flushed at step N is never reported on the
output of batch N-1, which the scheduler processes after scheduling N. Which in-flight jobs
finish when is the caller's choice (``finish_jobs``); flushed jobs and synchronous loads finish
at their step.

Observation, after every ``schedule()`` and every output: the metadata (GPU blocks and CPU
chunk ids of each job), the GPU blocks the pool handed out in the step (``BlockPool.
get_new_blocks`` is wrapped to record them; nothing else changes), the GPU pool, the block
tables and block hashes of the requests, and the connector's manager read exactly as
``VllmOffloadingTarget.snapshot`` reads vLLM's manager. ``snapshot()`` returns one
``manager: offloading`` snapshot with two derived sections: ``observed`` (the keys of the jobs
in flight since the last cache reset, for O2/O3) and ``connector`` (for O11-O15).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvspec.adapters import vllm_compat as compat
from kvspec.adapters.vllm_offloading import VLLM_VERSION, VllmOffloadingTarget, _unpack
from kvspec.adapters.vllm_scheduler import SchedulerOptions, VllmScheduler, _Batch
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import ConfigError
from kvspec.contract.offloading import POLICIES, OffloadingConfig, key_text
from kvspec.model.hashing import ROOT_HASH, chain_hash


@dataclass(frozen=True)
class ConnectorConfig:
    """The engine and the connector: GPU ``block_size`` (= hash block size), ``num_gpu_blocks``
    (vLLM's ``num_gpu_blocks``), ``sliding_window`` (0: one full-attention group; else a
    second, sliding-window group of that many tokens), ``num_chunks`` CPU chunks, vLLM's
    ``eviction_policy``, ``store_threshold`` (vLLM's default 0: no filter) and
    ``offload_prompt_only`` (vLLM's default True: decode blocks are not stored)."""

    block_size: int = 4
    num_gpu_blocks: int = 16
    num_chunks: int = 6
    eviction_policy: str = "lru"
    sliding_window: int = 0
    store_threshold: int = 0
    offload_prompt_only: bool = True
    max_num_batched_tokens: int = 64

    def validate(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "num_chunks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"connector config: {name} must be an int >= 1, got {value!r}")
        if self.eviction_policy not in POLICIES:
            raise ConfigError(f"connector config: eviction_policy must be one of {', '.join(POLICIES)}")
        if type(self.sliding_window) is not int or self.sliding_window < 0:
            raise ConfigError("connector config: sliding_window must be an int >= 0")
        if type(self.store_threshold) is not int or self.store_threshold < 0:
            raise ConfigError("connector config: store_threshold must be an int >= 0")
        if type(self.offload_prompt_only) is not bool:
            raise ConfigError("connector config: offload_prompt_only must be a bool")

    def offload_config(self) -> OffloadConfig:
        """The engine part as kvspec's ``OffloadConfig`` (its CPU and policy fields unused)."""
        groups = (KVGroup(),) if not self.sliding_window else (KVGroup(), KVGroup("sliding", self.sliding_window))
        return OffloadConfig(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks, groups=groups,
                             max_num_batched_tokens=self.max_num_batched_tokens, policy="baseline")

    def manager_config(self) -> OffloadingConfig:
        """The manager's configuration as the second manager's snapshots state it."""
        return OffloadingConfig(num_chunks=self.num_chunks, policy=self.eviction_policy,
                                store_threshold=max(1, self.store_threshold))

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (
            "block_size", "num_gpu_blocks", "num_chunks", "eviction_policy", "sliding_window",
            "store_threshold", "offload_prompt_only", "max_num_batched_tokens")}


@dataclass
class Job:
    """A transfer job as the metadata gave it: ``gpu`` blocks (destinations of a load, sources of
    a store) with ``group_sizes``, CPU ``chunks`` and the keys holding them when it was issued
    (None: no key held the chunk), the step it was issued in, the step whose metadata flushed
    it (None: not flushed), the manager's cache generation it belongs to, and ``done_at``: None
    while the worker has not finished it, else the step whose batch is the first that may report
    it (the job's own step, or the flushing step)."""

    job_id: int
    kind: str  # "load" | "store"
    req: str
    gpu: list[int]
    group_sizes: list[int]
    chunks: list[int]
    keys: list[str | None]
    issued: int
    generation: int
    sync: bool = False
    flushed: int | None = None
    done_at: int | None = None

    @property
    def done(self) -> bool:
        return self.done_at is not None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "req": self.req, "gpu": self.gpu, "group_sizes": self.group_sizes,
                "chunks": self.chunks, "keys": self.keys, "issued": self.issued, "flushed": self.flushed,
                "generation": self.generation, "sync": self.sync}


def _groups(gpu: list[int], sizes: list[int] | None) -> list[tuple[int, int]]:
    """(group index, block) pairs of a ``GPULoadStoreSpec``'s group-major block list."""
    sizes = sizes if sizes is not None else [len(gpu)]
    out, start = [], 0
    for g, n in enumerate(sizes):
        out += [(g, b) for b in gpu[start:start + n]]
        start += n
    return out


@dataclass
class _StepRecord:
    """What one ``schedule()`` did, as observed: its index, the blocks the GPU pool handed out
    (and the requests holding each after the step), the jobs it issued and flushed, and the jobs that were in flight
    at the last cache reset and not yet flushed when it was built."""

    step: int = -1
    fresh: dict[int, list[str]] = field(default_factory=dict)
    issued: list[int] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    reset_unflushed: list[int] = field(default_factory=list)


class VllmConnectorScheduler(VllmScheduler):
    """vLLM's scheduler with the real OffloadingConnector and a worker played from outside."""

    def __init__(self, config: ConnectorConfig, options: SchedulerOptions,
                 next_token: Callable[[str, int], int]) -> None:
        config.validate()
        self.connector_config = config
        self.release = compat.connector_release()
        super().__init__(config.offload_config(), options, next_token, transfer=self._transfer,
                         release=self.release.version)
        self.connector = self.scheduler.connector.connector_scheduler
        self.offload_manager = self.connector.manager
        if compat.num_chunks(self.offload_manager) != config.num_chunks:
            raise ConfigError(f"vLLM {self.release.version} sized the CPU pool at "
                              f"{compat.num_chunks(self.offload_manager)} chunks, not {config.num_chunks}")
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        self._worker_meta = OffloadingWorkerMetadata
        self.num_workers = int(self.connector.config.num_workers)
        self.blocks_per_chunk = compat.blocks_per_chunk(self.connector.config)
        self._resets = 0  # calls of the manager's reset_cache (the generation of releases without one)
        self._reader = self._manager_reader()
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self._handed_out: list[int] | None = None
        self._wrap_pool()
        self.jobs: dict[int, Job] = {}  # in flight: issued, not reported
        self.reported: list[int] = []  # job ids reported, in order
        self.steps = 0
        self._batch_steps: dict[int, int] = {}  # id of a batch's SchedulerOutput -> its step
        self._output_step = -1  # the step of the batch whose output is being processed
        self.record = _StepRecord()
        self.step_snapshot: dict[str, Any] | None = None  # the snapshot right after the last schedule()
        self.reset_pending: set[int] = set()  # in flight at the last reset, not yet seen flushed
        self.positions: dict[str, dict[int, dict[int, int]]] = {}  # rid -> group -> block -> position
        self.connector_output = self._take_output

    # -- construction -----------------------------------------------------------------------

    def _transfer(self, v: SimpleNamespace, kv_cache_config: Any, page_bytes: int) -> Any:
        """vLLM's ``KVTransferConfig`` for the OffloadingConnector with exactly ``num_chunks``
        chunks: ``cpu_bytes_to_use`` is that many chunk pages as ``CPUOffloadingSpec`` sizes them
        (bytes per block times workers, rounded up to the spec's ``BLOCK_SIZE_ALIGNMENT``: the
        memory page size from 0.29, none in 0.23, whose bytes per block sum every KV tensor)."""
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

        c = self.connector_config
        tensors = kv_cache_config.kv_cache_tensors
        total = sum(t.size for t in tensors) if not self.release.at_least("0.29.0") else tensors[0].size
        align = int(getattr(CPUOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", mmap.PAGESIZE))
        chunk = -(-(total // kv_cache_config.num_blocks) * self.config.world_size // align) * align
        return v.KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": c.num_chunks * chunk,
                                       "eviction_policy": c.eviction_policy,
                                       "store_threshold": c.store_threshold,
                                       "offload_prompt_only": c.offload_prompt_only})

    def _manager_reader(self) -> VllmOffloadingTarget:
        """``VllmOffloadingTarget``'s snapshot logic pointed at the connector's own manager."""
        reader = VllmOffloadingTarget.__new__(VllmOffloadingTarget)
        reader._config = self.connector_config.manager_config()
        reader.manager = self.offload_manager
        reader._contexts = {}
        reader._closed = set()
        from kvspec.adapters.vllm_offloading import _import_vllm
        reader._v = _import_vllm(None if self.release.version == VLLM_VERSION else self.release.version)
        original = self.offload_manager.reset_cache

        def reset_cache(*args: Any, **kwargs: Any) -> Any:
            self._resets += 1
            return original(*args, **kwargs)

        self.offload_manager.reset_cache = reset_cache
        return reader

    def _generation(self) -> int:
        """The manager's cache generation: its own counter (0.31 on), else its resets observed."""
        own = getattr(self.offload_manager, "_cache_generation", None)
        return int(own) if own is not None else self._resets

    def _wrap_pool(self) -> None:
        """Record the blocks ``get_new_blocks`` hands out during ``schedule()`` (behaviour unchanged)."""
        original = self.pool.get_new_blocks

        def get_new_blocks(*args: Any, **kwargs: Any) -> Any:
            blocks = original(*args, **kwargs)
            if self._handed_out is not None:
                self._handed_out.extend(int(b.block_id) for b in blocks)
            return blocks

        self.pool.get_new_blocks = get_new_blocks

    def _hasher(self, request: Any) -> list[bytes]:
        """kvspec's ``chain_hash`` over the request's full blocks, each hash as the UTF-8 bytes of
        its hex text (the second manager's keys are ``hash text:group``, ``key_bytes``)."""
        B = self.config.block_size
        tokens = request.all_token_ids
        parent = request.block_hashes[-1].decode() if request.block_hashes else ROOT_HASH
        out: list[bytes] = []
        for start in range(len(request.block_hashes) * B, len(tokens) - B + 1, B):
            parent = chain_hash(parent, tuple(tokens[start:start + B]))
            out.append(parent.encode())
        return out

    # -- stepping ---------------------------------------------------------------------------

    def _schedule(self, admit: list[str], chunk: int, resume: str, budget: int | None) -> Any:
        self._note_positions()
        self._handed_out = []
        try:
            out = super()._schedule(admit, chunk, resume, budget)
        finally:
            handed, self._handed_out = self._handed_out, None
        self._observe(out, handed or [])
        return out

    def _observe(self, out: Any, handed: list[int]) -> None:
        """Record one ``schedule()``: its jobs, flushes and handed-out blocks."""
        step = self.steps
        self.steps += 1
        self._note_positions()
        owners = self._owners()
        meta = out.kv_connector_metadata
        chunk_keys = self._chunk_keys()
        generation = self._generation()
        record = _StepRecord(step=step, fresh={b: sorted(owners.get(b, [])) for b in handed if b != 0},
                             reset_unflushed=sorted(self.reset_pending))
        for kind, jobs in (("load", meta.load_jobs), ("store", meta.store_jobs)):
            for jid, job in sorted(jobs.items()):
                src, dst = compat.job_specs(job)
                gpu_spec, cpu_spec = (dst, src) if kind == "load" else (src, dst)
                chunks = [int(c) for c in cpu_spec.block_ids]
                sizes = gpu_spec.group_sizes
                self.jobs[jid] = Job(jid, kind, job.req_id, [int(b) for b in gpu_spec.block_ids],
                                     [int(n) for n in sizes] if sizes is not None else [len(gpu_spec.block_ids)],
                                     chunks, [chunk_keys.get(c) for c in chunks], step, generation,
                                     sync=bool(getattr(job, "sync", False)))
                record.issued.append(jid)
        for jid in sorted(meta.jobs_to_flush or ()):
            record.flush.append(int(jid))
            job = self.jobs.get(jid)
            if job is not None and job.flushed is None:
                job.flushed = step
                if job.done_at is None:
                    job.done_at = step  # the worker waits for it in this step's batch
        for jid in record.issued:
            if self.jobs[jid].sync:
                self.jobs[jid].done_at = step  # completed before this step's forward pass
        self._batch_steps[id(out)] = step
        self.reset_pending -= set(record.flush)
        self.record = record
        # The issue-time facts (handed-out blocks, issued and flushed jobs) hold for the state right
        # after ``schedule()``; later snapshots (after outputs, aborts, resets) leave them out.
        self.step_snapshot = self.snapshot()
        self.record = _StepRecord(step=step)

    @staticmethod
    def metadata_json(meta: Any) -> dict[str, Any]:
        """``OffloadingConnectorMetadata`` as plain values: each job's request, GPU blocks (with
        group sizes) and CPU chunks, and the jobs to flush."""
        if meta is None:
            return {"load_jobs": {}, "store_jobs": {}, "jobs_to_flush": []}

        def job(j: Any, load: bool) -> dict[str, Any]:
            src, dst = compat.job_specs(j)
            gpu, cpu = (dst, src) if load else (src, dst)
            return {"req": j.req_id, "gpu": [int(b) for b in gpu.block_ids],
                    "group_sizes": None if gpu.group_sizes is None else [int(n) for n in gpu.group_sizes],
                    "chunks": [int(c) for c in cpu.block_ids], "sync": bool(getattr(j, "sync", False))}

        return {"load_jobs": {str(k): job(j, True) for k, j in sorted(meta.load_jobs.items())},
                "store_jobs": {str(k): job(j, False) for k, j in sorted(meta.store_jobs.items())},
                "jobs_to_flush": sorted(int(j) for j in meta.jobs_to_flush or ())}

    def _note_positions(self) -> None:
        """The latest position of each block in each unfinished request's table (kept after a
        request finishes: a finished request's last stores read its last table)."""
        coordinator = self.scheduler.kv_cache_manager.coordinator
        for rid, request in self.requests.items():
            if request.is_finished():
                continue
            tables = coordinator.get_blocks(rid)
            if not any(tables):
                continue
            known = self.positions.setdefault(rid, {})
            for g, blocks in enumerate(tables):
                for p, block in enumerate(blocks):
                    if block.block_id != 0:
                        known.setdefault(g, {})[int(block.block_id)] = p

    def _owners(self) -> dict[int, list[str]]:
        """Block -> the unfinished requests holding it (several: a prefix-shared block)."""
        coordinator = self.scheduler.kv_cache_manager.coordinator
        owners: dict[int, list[str]] = {}
        for rid, request in self.requests.items():
            if request.is_finished():
                continue
            for blocks in coordinator.get_blocks(rid):
                for block in blocks:
                    if block.block_id != 0:
                        owners.setdefault(int(block.block_id), []).append(rid)
        return owners

    def _chunk_keys(self) -> dict[int, str]:
        """CPU chunk -> the key holding it in the connector's manager now."""
        policy = self.offload_manager._policy
        resident: Iterable[tuple[bytes, Any]]
        if self.connector_config.eviction_policy == "lru":
            resident = policy.chunks.items() if hasattr(policy, "chunks") else policy.blocks.items()
        else:
            resident = list(policy.t1.items()) + list(policy.t2.items())
        return {int(getattr(c, "chunk_id", getattr(c, "block_id", -1))): key_text(_unpack(k)) for k, c in resident}

    # -- the worker ---------------------------------------------------------------------------

    def finish_jobs(self, job_ids: Iterable[int]) -> None:
        """The worker finishes these in-flight jobs (each reported with the next output of a batch
        from its step on)."""
        for jid in job_ids:
            job = self.jobs.get(jid)
            if job is not None and job.done_at is None:
                job.done_at = job.issued

    def _process(self, batch: _Batch, accept: int) -> None:
        self._output_step = self._batch_steps.pop(id(batch.output))
        super()._process(batch, accept)

    def _take_output(self) -> Any:
        """The workers' ``KVConnectorOutput`` for the output of the batch scheduled at step
        ``_output_step``: every finished, unreported job of that step or earlier (all ranks at
        once), finished asynchronous loads also as ``finished_recving``."""
        done = sorted(jid for jid, job in self.jobs.items()
                      if job.done_at is not None and job.done_at <= self._output_step)
        if not done:
            return None
        recving = {self.jobs[jid].req for jid in done if self.jobs[jid].kind == "load" and not self.jobs[jid].sync}
        for jid in done:
            del self.jobs[jid]
        self.reported.extend(done)
        meta = self._worker_meta(completed_jobs={jid: self.num_workers for jid in done})
        return self.v.KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta)

    def reset(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``; when the connector's manager was reset,
        every job in flight must be flushed by the next metadata (O15)."""
        generation = self._generation()
        in_flight = {jid for jid, job in self.jobs.items() if job.flushed is None}
        result = super().reset()
        if self._generation() != generation:
            self.reset_pending |= in_flight
        return result

    # -- observation ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The connector's manager (``manager: offloading``, as ``VllmOffloadingTarget`` reads it),
        ``observed`` (keys of the current generation's jobs in flight) and ``connector``."""
        snap = self._reader.snapshot()
        snap["requests"] = {}
        generation = self._generation()
        loads: dict[str, int] = {}
        stores: list[str] = []
        for job in self.jobs.values():
            if job.generation != generation:
                continue
            for key in job.keys:
                if key is None:
                    continue
                if job.kind == "load":
                    loads[key] = loads.get(key, 0) + 1
                else:
                    stores.append(key)
        snap["observed"] = {"loads": loads, "stores": sorted(stores), "last": {"op": "connector-step"}}
        coordinator = self.scheduler.kv_cache_manager.coordinator
        snap["connector"] = {
            "config": self.connector_config.to_json(),
            "blocks_per_chunk": self.blocks_per_chunk,
            "step": self.record.step,
            "fresh": {str(b): o for b, o in sorted(self.record.fresh.items())},
            "issued": self.record.issued,
            "flush": self.record.flush,
            "reset_unflushed": self.record.reset_unflushed,
            "jobs": {str(j): job.to_json() for j, job in sorted(self.jobs.items())},
            "gpu_refs": [int(b.ref_cnt) for b in self.pool.blocks],
            "requests": {
                rid: {"finished": bool(r.is_finished()),
                      "table": [] if r.is_finished() else
                      [[int(b.block_id) for b in g] for g in coordinator.get_blocks(rid)],
                      "positions": {str(g): {str(b): p for b, p in sorted(m.items())}
                                    for g, m in sorted(self.positions.get(rid, {}).items())},
                      "hashes": [h.decode() for h in r.block_hashes]}
                for rid, r in self.requests.items()},
        }
        return snap


def connector_driver_available() -> tuple[bool, str]:
    """(True, "") when vLLM 0.33.0's scheduler and OffloadingConnector import here, else (False, why)
    (the release the CI runs; the other connector releases are driven in their own venvs)."""
    from kvspec.adapters.vllm_scheduler import scheduler_driver_available

    ok, why = scheduler_driver_available()
    if not ok:
        return ok, why
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import common  # noqa: F401
    except Exception as exc:
        return False, f"vLLM's OffloadingConnector cannot be imported: {exc}"
    return True, ""
