"""vLLM 0.33.0's real scheduler with the real CPU-offload connector, without a model or a GPU.

``VllmScheduler(config, options, next_token)`` builds what vLLM's engine core builds for a
generative model with CPU offload: a real ``VllmConfig`` (from a local OPT ``config.json``:
no weights, no network) with ``KVTransferConfig(kv_connector="SimpleCPUOffloadConnector",
kv_role="kv_both")``, a ``KVCacheConfig`` with one full or sliding-window group per
configured group, and vLLM's ``Scheduler`` or ``AsyncScheduler`` (``options.async_scheduling``;
``None`` takes what ``VllmConfig`` resolves, which in 0.33.0 is async). The scheduler creates
the real connector itself, and ``schedule()`` returns a ``SimpleCPUOffloadMetadata``.

Its methods are what engine core and the workers do to a scheduler:

* ``add_request``: a ``Request`` with the given prompt; its block hasher chains kvspec's
  ``chain_hash`` over the request's own tokens, so the hashes are the ones kvspec's engine
  computes for the same tokens (vLLM's own hasher would give other bytes for the same
  prefixes; only equality of hashes matters to the bookkeeping).
* ``step``: one engine-core step: ``schedule()``, a fake ``ModelRunnerOutput`` (a token from
  ``next_token`` for each request that finished its prefill), ``update_from_output``. Async
  scheduling follows engine core's batch queue (``step_with_batch_queue``, two batches): each
  step schedules a batch and then processes the output of the one before, placeholders
  included. The step's arguments reach vLLM through what ``schedule()`` reads: ``admit`` is the
  waiting queue (requests not admitted are held out of it during the call, the admitted ones
  stand in ``admit`` order), ``preempt`` runs vLLM's own ``_preempt_request`` first, ``resume``
  selects the model-runner variant (``mrv2``: resumed requests go out as new requests),
  ``chunk`` is ``long_prefill_token_threshold`` and ``budget`` the step's token budget
  (``max_num_batched_tokens``); without a budget the step has none beyond ``chunk`` per request
  (vLLM drops the threshold when at most one request is eligible, so then the budget is
  ``chunk``).
* ``report`` / ``load_done``: the workers' ``KVConnectorOutput`` (store completions counted
  per rank, as ``SimpleCPUOffloadWorkerMetadata`` aggregates them; a finished load as
  ``finished_recving``), delivered through ``update_from_output`` with an empty
  ``SchedulerOutput`` (what engine core hands over for a batch that scheduled nothing).
* ``finish``: ``finish_requests(rid, FINISHED_ABORTED)``. With ``options.auto_finish`` (the
  default under async scheduling, where every placeholder must get a sampled token back) vLLM
  also stops a request itself in the step that samples its ``max_tokens``-th token; without it
  vLLM's ``max_tokens`` is unbounded and the fake output samples no more than ``max_tokens``
  tokens, so only ``finish`` ends a request.
* ``reset``: ``reset_prefix_cache(reset_connector=True)``.

Nothing here checks its arguments beyond what vLLM needs: ``kvspec.drivers.scheduler_driver``
puts the engine's operation alphabet and rejections in front of it. ``snapshot()`` reads
vLLM's objects back into kvspec's format. vLLM is imported only when one is built.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from kvspec.adapters.vllm import VLLM_VERSION, VllmTarget, hash_to_bytes, pool_snapshot
from kvspec.contract.config import MAX_BATCHED_TOKENS, OffloadConfig
from kvspec.contract.errors import ConfigError
from kvspec.model.hashing import ROOT_HASH, chain_hash

MAX_MODEL_LEN = 1 << 18  # above any prompt plus output the engine allows (MAX_PROMPT_TOKENS each)
UNBOUNDED_MAX_TOKENS = MAX_MODEL_LEN - 1  # vLLM's max_tokens when only ``finish`` may stop a request
MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs (capped by max_num_batched_tokens, as vLLM requires)
HEADS_PER_RANK = 2  # the local model's attention heads per tensor-parallel rank
HEAD_DIM = 4


@dataclass(frozen=True)
class SchedulerOptions:
    """How vLLM is run: scheduling mode and who stops requests.

    ``async_scheduling``: ``AsyncScheduler`` (True), ``Scheduler`` (False), or what
    ``VllmConfig`` resolves (None: async in vLLM 0.33.0). ``auto_finish``: vLLM stops a request
    at ``max_tokens`` itself (None: under async only)."""

    async_scheduling: bool | None = None
    auto_finish: bool | None = None


@dataclass
class StepObservation:
    """One ``schedule()`` as both sides can report it: tokens per request in scheduling
    order, preempted and finished ids, new and cached request data, draft tokens per request,
    connector metadata."""

    scheduled: list[tuple[str, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    new_reqs: list[tuple[str, list[list[int]]]] = field(default_factory=list)
    cached_reqs: list[tuple[str, list[list[int]] | None, bool]] = field(default_factory=list)
    drafts: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (lists for tuples), for comparison and reports."""
        plain: dict[str, Any] = json.loads(json.dumps({
            "scheduled": self.scheduled, "preempted": self.preempted, "finished": self.finished,
            "new_reqs": self.new_reqs, "cached_reqs": self.cached_reqs, "drafts": self.drafts,
            "metadata": self.metadata,
        }))
        return plain


def metadata_json(meta: Any) -> dict[str, Any]:
    """Connector metadata (vLLM's ``SimpleCPUOffloadMetadata`` or kvspec's ``ConnectorMetadata``,
    same field names) as plain values; None (no metadata) as the empty plan. O(blocks)."""
    if meta is None:
        return metadata_json(SimpleNamespace(load_event=-1, load_gpu_blocks=[], load_cpu_blocks=[],
                                             load_event_to_reqs={}, store_event=-1, store_gpu_blocks=[],
                                             store_cpu_blocks=[], need_flush=False))
    return {
        "load_event": int(meta.load_event),
        "load_gpu_blocks": [int(b) for b in meta.load_gpu_blocks],
        "load_cpu_blocks": [int(b) for b in meta.load_cpu_blocks],
        "load_event_to_reqs": {str(e): list(rs) for e, rs in sorted(meta.load_event_to_reqs.items())},
        "store_event": int(meta.store_event),
        "store_gpu_blocks": [int(b) for b in meta.store_gpu_blocks],
        "store_cpu_blocks": [int(b) for b in meta.store_cpu_blocks],
        "need_flush": bool(meta.need_flush),
    }


def _block_lists(ids: Any) -> list[list[int]] | None:
    return None if ids is None else [list(g) for g in ids]


def observe_step(out: Any, meta: Any, to_json: Callable[[Any], dict[str, Any]] = metadata_json) -> StepObservation:
    """A scheduler output (vLLM's or kvspec's: the fields both have) plus its metadata (as
    ``to_json`` writes it)."""
    cached = out.scheduled_cached_reqs
    return StepObservation(
        scheduled=list(out.num_scheduled_tokens.items()),
        preempted=sorted(out.preempted_req_ids or ()),
        finished=sorted(out.finished_req_ids or ()),
        new_reqs=[(nr.req_id, _block_lists(nr.block_ids) or []) for nr in out.scheduled_new_reqs],
        cached_reqs=[(rid, _block_lists(ids), rid in cached.resumed_req_ids)
                     for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)],
        drafts={rid: len(ids) for rid, ids in sorted((out.scheduled_spec_decode_tokens or {}).items())},
        metadata=to_json(meta),
    )


# -- vLLM objects ------------------------------------------------------------------------------


def _import_scheduler_vllm(release: str | None = None) -> SimpleNamespace:
    """vLLM's scheduler-side classes; ``ConfigError`` when vLLM 0.33.0 (or ``release``, an older
    release the connector harness runs on) is not importable. Sets ``HF_HUB_OFFLINE=1`` unless it
    is set: the local model needs no hub."""
    from kvspec.adapters.vllm import _import_vllm

    base = _import_vllm(release)  # checks the version, quiets the manager's warnings
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:
        raise ConfigError(f"vLLM {release or VLLM_VERSION} is installed but its scheduler cannot be imported: "
                          f"{exc}") from None
    for name in ("vllm.v1.core.sched.scheduler", "vllm.config", "vllm.distributed.kv_transfer"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return SimpleNamespace(
        **vars(base), CacheConfig=CacheConfig, DeviceConfig=DeviceConfig, KVTransferConfig=KVTransferConfig,
        ModelConfig=ModelConfig, ParallelConfig=ParallelConfig, SchedulerConfig=SchedulerConfig,
        VllmConfig=VllmConfig, SpeculativeConfig=SpeculativeConfig, DraftTokenIds=DraftTokenIds,
        AsyncScheduler=AsyncScheduler, Scheduler=Scheduler,
        EmptySchedulerOutput=SchedulerOutput.make_empty, ModelRunnerOutput=ModelRunnerOutput,
        RequestStatus=RequestStatus, StructuredOutputManager=StructuredOutputManager,
    )


_MODEL_DIRS: dict[int, Path] = {}


def local_model_dir(world_size: int) -> Path:
    """A directory holding only a tiny OPT ``config.json`` whose attention heads divide among
    ``world_size`` tensor-parallel ranks (created once per process). O(1)."""
    if world_size not in _MODEL_DIRS:
        heads = HEADS_PER_RANK * world_size
        hidden = heads * HEAD_DIM
        path = Path(tempfile.mkdtemp(prefix=f"kvspec-opt-tp{world_size}-"))
        (path / "config.json").write_text(json.dumps({
            "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": hidden,
            "word_embed_proj_dim": hidden, "ffn_dim": 2 * hidden, "num_attention_heads": heads,
            "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": MAX_MODEL_LEN,
            "torch_dtype": "float16", "do_layer_norm_before": True, "activation_function": "relu",
            "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
        }))
        _MODEL_DIRS[world_size] = path
    return _MODEL_DIRS[world_size]


def build_vllm_config(v: SimpleNamespace, config: OffloadConfig, options: SchedulerOptions, page_bytes: int,
                      transfer: Any = None) -> Any:
    """A real ``VllmConfig`` for ``config``: the local model, chunked prefill with prefix caching,
    ``config.max_num_batched_tokens``, tensor parallelism ``config.world_size``, the
    SimpleCPUOffloadConnector with exactly ``config.num_cpu_blocks`` CPU blocks (or the
    ``KVTransferConfig`` ``transfer`` when given: another connector), and n-gram
    speculative decoding with ``config.num_speculative_tokens`` drafts when that is not 0 (the
    n-gram drafter needs no draft model). O(1)."""
    model = v.ModelConfig(model=str(local_model_dir(config.world_size)), skip_tokenizer_init=True,
                          dtype="float16", max_model_len=MAX_MODEL_LEN)
    scheduler = v.SchedulerConfig(
        max_num_seqs=min(MAX_NUM_SEQS, config.max_num_batched_tokens),
        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=options.async_scheduling)
    cpu_bytes = page_bytes * config.num_groups * config.num_cpu_blocks * config.world_size
    transfer = transfer or v.KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"num_cpu_blocks": config.num_cpu_blocks, "cpu_bytes_to_use": cpu_bytes,
                                   "lazy_offload": config.lazy_offload})
    vllm_config = v.VllmConfig(
        model_config=model, scheduler_config=scheduler,
        cache_config=v.CacheConfig(block_size=config.block_size, enable_prefix_caching=True),
        kv_transfer_config=transfer, device_config=v.DeviceConfig("cpu"),
        parallel_config=v.ParallelConfig(tensor_parallel_size=config.world_size),
        speculative_config=v.SpeculativeConfig(method="ngram", num_speculative_tokens=config.num_speculative_tokens,
                                               prompt_lookup_max=2, prompt_lookup_min=1)
        if config.num_speculative_tokens else None)
    vllm_config.cache_config.num_gpu_blocks = config.num_gpu_blocks
    return vllm_config


# -- the scheduler --------------------------------------------------------------------------------


@dataclass
class _Batch:
    """A scheduled batch whose output is not processed yet, the requests it samples, and those of
    its draft tokens that only pad a request admitted from the waiting queue (no drafter proposed
    them)."""

    output: Any
    sampling: list[str]
    padded: set[str]


class VllmScheduler:
    """vLLM's ``Scheduler``/``AsyncScheduler`` with the real connector, stepped as engine core does.

    ``next_token(rid, num_output_tokens)`` is the token the fake model samples for ``rid``.
    ``transfer(v, kv_cache_config, page_bytes)``, when given, is the ``KVTransferConfig`` of
    another connector (``kvspec.adapters.vllm_offloading_connector``); ``connector_output``, when
    set, is called for each batch output and returns the workers' ``KVConnectorOutput`` that
    rides on it (None: none)."""

    def __init__(self, config: OffloadConfig, options: SchedulerOptions, next_token: Callable[[str, int], int],
                 transfer: Callable[[SimpleNamespace, Any, int], Any] | None = None,
                 release: str | None = None) -> None:
        config.validate()
        if config.policy != "baseline":
            raise ConfigError(f"vLLM {VLLM_VERSION} implements only the 'baseline' policy, not {config.policy!r}")
        self.config, self.options, self.next_token = config, options, next_token
        self.v = v = _import_scheduler_vllm(release)
        kv_cache_config, page_bytes = VllmTarget.kv_cache_config_for(v, config)
        self.vllm_config = build_vllm_config(v, config, options, page_bytes,
                                             None if transfer is None else transfer(v, kv_cache_config, page_bytes))
        self.async_scheduling = bool(self.vllm_config.scheduler_config.async_scheduling)
        self.auto_finish = self.async_scheduling if options.auto_finish is None else options.auto_finish
        if self.async_scheduling and not self.auto_finish:
            raise ConfigError("async scheduling needs auto_finish: every placeholder gets a sampled token back, "
                              "so vLLM must stop requests at max_tokens itself")
        cls = v.AsyncScheduler if self.async_scheduling else v.Scheduler
        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
                             structured_output_manager=v.StructuredOutputManager(self.vllm_config),
                             block_size=config.block_size, hash_block_size=config.block_size, log_stats=False)
        self.manager: Any = getattr(self.scheduler.connector, "scheduler_manager", None)  # SimpleCPUOffload's
        self.connector_output: Callable[[], Any] | None = None
        self.batch_queue_size = self.vllm_config.max_concurrent_batches
        self.requests: dict[str, Any] = {}  # every request ever added, in creation order
        self.max_tokens: dict[str, int] = {}
        self.in_flight: deque[_Batch] = deque()
        self.last_step = StepObservation(metadata=metadata_json(None))
        self.last_step_idle = False  # the last step found nothing to schedule and did not call schedule()

    # -- engine core ------------------------------------------------------------------------

    def add_request(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        """``add_request`` of a new ``Request`` (``max_tokens`` as the module doc says)."""
        vllm_max = max(1, max_tokens) if self.auto_finish else UNBOUNDED_MAX_TOKENS
        request = self.v.Request(rid, prompt, self.v.SamplingParams(max_tokens=vllm_max, ignore_eos=True), None,
                                 arrival_time=float(len(self.requests)), block_hasher=self._hasher)
        self.requests[rid] = request
        self.max_tokens[rid] = max_tokens
        self.scheduler.add_request(request)

    def _hasher(self, request: Any) -> list[bytes]:
        """vLLM's block-hasher contract (hashes of the full blocks not hashed yet, chained to the
        last one) with kvspec's ``chain_hash``. O(new tokens)."""
        B = self.config.block_size
        tokens = request.all_token_ids
        parent = request.block_hashes[-1].hex() if request.block_hashes else ROOT_HASH
        out: list[bytes] = []
        for start in range(len(request.block_hashes) * B, len(tokens) - B + 1, B):
            parent = chain_hash(parent, tuple(tokens[start:start + B]))
            out.append(hash_to_bytes(parent))
        return out

    @staticmethod
    def metadata_json(meta: Any) -> dict[str, Any]:
        """This connector's metadata as plain values (``metadata_json``)."""
        return metadata_json(meta)

    def is_running(self, rid: str) -> bool:
        return bool(self.requests[rid].status == self.v.RequestStatus.RUNNING)

    def step(self, admit: list[str], chunk: int, preempt: list[str], resume: str,
             budget: int | None = None, accept: int = 0) -> StepObservation:
        """One engine-core step (``EngineCore.step``, or ``step_with_batch_queue`` with two batches
        in flight): schedule a batch when the scheduler has requests, then process the oldest
        batch's output once the queue is full or nothing else could be scheduled, each request
        getting ``accept`` of its drafts accepted (``_process``). ``preempt`` must name running
        requests."""
        self.last_step = StepObservation(metadata=metadata_json(None))
        self.last_step_idle = not self.scheduler.has_requests()
        if not self.last_step_idle:
            for rid in preempt:
                self.scheduler.running.remove(self.requests[rid])
                self.scheduler._preempt_request(self.requests[rid], time.monotonic())
            out = self._schedule(admit, chunk, resume, budget)
            self.last_step = observe_step(out, out.kv_connector_metadata, self.metadata_json)
            self.in_flight.appendleft(_Batch(out, self._sampling(out), self._padded(out)))
            if len(self.in_flight) < self.batch_queue_size and (
                    out.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()):
                return self.last_step
        elif not self.in_flight:
            return self.last_step  # engine core does not step an idle scheduler
        self._process(self.in_flight.pop(), accept)
        return self.last_step

    def _schedule(self, admit: list[str], chunk: int, resume: str, budget: int | None) -> Any:
        """``schedule()`` with the waiting queue holding exactly ``admit`` (in order) and the step's
        knobs set; the requests held out go back to the queue afterwards."""
        waiting = self.scheduler.waiting
        held = [r for r in waiting if r.request_id not in admit]
        admitted = [self.requests[rid] for rid in admit]
        waiting.remove_requests(held + admitted)
        for request in admitted:
            waiting.add_request(request)
        self._set_knobs(chunk, resume, budget)
        try:
            return self.scheduler.schedule()
        finally:
            for request in held:
                waiting.add_request(request)

    def _set_knobs(self, chunk: int, resume: str, budget: int | None) -> None:
        """What ``schedule()`` reads of the step's arguments: the model-runner variant,
        ``long_prefill_token_threshold = chunk`` and the step budget ``budget``; without one, no
        step budget (only ``chunk`` per request: vLLM drops the threshold when at most one request
        is eligible, so then the budget is ``chunk``). No limit on the number of running requests
        (``max_num_seqs``), as in the engine."""
        s = self.scheduler
        s.use_v2_model_runner = resume == "mrv2"
        if budget is None:
            running, waiting = s.get_request_counts()
            budget = chunk if running + waiting <= 1 else MAX_BATCHED_TOKENS
        s.scheduler_config.long_prefill_token_threshold = chunk
        s.scheduler_config.max_num_batched_tokens = budget
        s.max_num_scheduled_tokens = budget
        s.max_num_running_reqs = s.max_num_active_reqs = MAX_BATCHED_TOKENS

    def _sampling(self, out: Any) -> list[str]:
        """Requests of a fresh batch that get a sampled token back: those that finished their
        prefill (every one under auto-finish; otherwise while the engine would still sample)."""
        sampling = []
        for rid in out.num_scheduled_tokens:
            request = self.requests[rid]
            if request.is_prefill_chunk:
                continue
            if self.auto_finish or request.num_output_tokens < self.max_tokens[rid]:
                sampling.append(rid)
        return sampling

    @staticmethod
    def _padded(out: Any) -> set[str]:
        """Requests with draft tokens that ``schedule()`` took from the waiting queue (new, or
        resumed): their drafts are padding, since only a request that ran before has proposals."""
        from_waiting = {nr.req_id for nr in out.scheduled_new_reqs} | set(out.scheduled_cached_reqs.resumed_req_ids)
        return set(out.scheduled_spec_decode_tokens) & from_waiting

    def _process(self, batch: _Batch, accept: int) -> None:
        """``update_from_output`` of a batch with the engine's sampled tokens: for each sampling
        request the next token, plus ``accept`` accepted drafts (at most as many as it had, none of
        a padding, and without auto-finish none past ``max_tokens``). Synchronous scheduling with
        drafts: then the drafter's proposals (``update_draft_token_ids``), k for each request of the
        batch still below ``max_tokens``, none for the others."""
        rids = list(batch.output.num_scheduled_tokens)
        sampled = [self._sampled(batch, rid, accept) if rid in batch.sampling else [] for rid in rids]
        output = self.v.ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                          sampled_token_ids=sampled,
                                          kv_connector_output=None if self.connector_output is None
                                          else self.connector_output())
        self.scheduler.update_from_output(batch.output, output)
        k = self.config.num_speculative_tokens
        if k and not self.async_scheduling and rids:
            proposals = []
            for rid, tokens in zip(rids, sampled, strict=True):
                n = self.requests[rid].num_output_tokens
                proposals.append([self.next_token(rid, n + i) for i in range(k)]
                                 if tokens and n < self.max_tokens[rid] else [])
            self.scheduler.update_draft_token_ids(self.v.DraftTokenIds(req_ids=rids, draft_token_ids=proposals))

    def _sampled(self, batch: _Batch, rid: str, accept: int) -> list[int]:
        """The tokens the fake model returns for ``rid``: its next one and its accepted drafts."""
        n = self.requests[rid].num_output_tokens
        drafts = len(batch.output.scheduled_spec_decode_tokens.get(rid, ()))
        accepted = 0 if rid in batch.padded else min(accept, drafts)
        if not self.auto_finish:
            accepted = min(accepted, self.max_tokens[rid] - n - 1)
        return [self.next_token(rid, n + i) for i in range(1 + accepted)]

    def report(self, event: int, count: int) -> None:
        """``count`` ranks report store ``event`` done."""
        meta = self.v.SimpleCPUOffloadWorkerMetadata(completed_store_events={event: count})
        self._deliver(self.v.KVConnectorOutput(kv_connector_worker_meta=meta))

    def load_done(self, rid: str) -> None:
        """The workers report ``rid``'s load complete."""
        self._deliver(self.v.KVConnectorOutput(finished_recving={rid}))

    def _deliver(self, connector_output: Any) -> None:
        """A worker output with no batch behind it (a step that scheduled nothing)."""
        output = self.v.ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=connector_output)
        self.scheduler.update_from_output(self.v.EmptySchedulerOutput(), output)

    def finish(self, rid: str) -> None:
        """``finish_requests(rid, FINISHED_ABORTED)``, in whatever phase ``rid`` is."""
        self.scheduler.finish_requests(rid, self.v.RequestStatus.FINISHED_ABORTED)

    def reset(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``."""
        return bool(self.scheduler.reset_prefix_cache(reset_connector=True))

    # -- observation --------------------------------------------------------------------------

    def phase(self, rid: str) -> RequestPhase:
        """What vLLM says of ``rid``'s phase."""
        request = self.requests[rid]
        return RequestPhase(request.status.name, request.is_finished(),
                            rid in self.scheduler.finished_recving_kv_req_ids, request.num_computed_tokens)

    def snapshot(self) -> dict[str, Any]:
        """vLLM's state in kvspec's format: both pools, the connector's scheduler section, and the
        unfinished requests (tokens, computed tokens, placeholders, block table). O(state)."""
        coordinator = self.scheduler.kv_cache_manager.coordinator
        requests = {
            rid: {"num_tokens": r.num_tokens, "num_computed_tokens": r.num_computed_tokens,
                  "num_output_placeholders": r.num_output_placeholders,
                  "table": [[b.block_id for b in g] for g in coordinator.get_blocks(rid)]}
            for rid, r in self.requests.items() if not r.is_finished()
        }
        return {
            "gpu_pool": pool_snapshot(self.scheduler.kv_cache_manager.block_pool),
            "cpu_pool": pool_snapshot(self.manager.cpu_block_pool),
            "scheduler": VllmTarget.manager_snapshot(self.manager, "baseline"),
            "requests": requests,
        }


class RequestPhase(NamedTuple):
    """A request's phase as vLLM holds it: ``RequestStatus`` name, finished or not, whether its load
    was reported done (``finished_recving``), computed tokens."""

    status: str
    finished: bool
    load_reported: bool
    num_computed_tokens: int


def scheduler_driver_available() -> tuple[bool, str]:
    """(True, "") when vLLM 0.33.0's scheduler can be imported here, else (False, why)."""
    try:
        _import_scheduler_vllm()
    except ConfigError as exc:
        return False, str(exc)
    return True, ""
