"""The connector model (``kvspec.model.offloading.connector``) in lockstep with vLLM 0.33.0's
real ``OffloadingConnectorScheduler``, while vLLM's real scheduler drives it.

``ConnectorLockstep(s)`` wraps the scheduler-side methods of the real connector of a
``VllmConnectorScheduler`` ``s`` (instance attributes; vLLM's behaviour is unchanged): every
call vLLM's scheduler makes (``on_new_request``, ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
``request_finished``, ``reset_cache``, ``take_events``, ``has_pending_push_work``) runs on vLLM
first, then on the model with the same inputs as plain values (requests read from the
``Request`` objects vLLM's scheduler registered). After each call three things are compared:
the return values (metadata as ``JobView``s: kind, request, GPU blocks with group sizes and
first positions, CPU chunks, keys, sync; and the jobs to flush), the connector's bookkeeping (tracked requests, their
jobs, store cursors, block lists, key counts; jobs in flight, job counter, stale threshold,
reset fence, fenced blocks, keys being loaded) and the manager's whole snapshot, every request's
access record included (vLLM's read by the harness's reader, given the request contexts vLLM's
connector made; the model's by ``snapshot_of``). The first difference raises ``LockstepDivergence`` naming the step,
the call and both values; a trace of ``offloading_connector_fuzz.run_trace`` then ends with a
``divergence`` finding.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvspec.adapters.vllm_offloading import _unpack
from kvspec.adapters.vllm_offloading_connector import ConnectorConfig, VllmConnectorScheduler
from kvspec.contract.offloading import key_text
from kvspec.drivers.offloading_connector_fuzz import (
    PROFILES,
    Hook,
    Op,
    TraceResult,
    Verdict,
    draw_config,
    run_ops,
    run_trace,
)
from kvspec.model.offloading.connector import (
    ConnectorModelConfig,
    JobView,
    Meta,
    OffloadingConnectorModel,
    ReqView,
    StepInput,
)
from kvspec.model.offloading.manager import snapshot_of

ModelFactory = Callable[[ConnectorModelConfig], OffloadingConnectorModel]


class LockstepDivergence(Verdict):
    """The model and vLLM's connector differ after a call (``record`` says how)."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(json.dumps(record, default=str)[:2000])
        self.record = record


def model_config(s: VllmConnectorScheduler) -> ConnectorModelConfig:
    c = s.connector_config
    return ConnectorModelConfig(block_size=c.block_size, manager=c.manager_config(),
                                blocks_per_chunk=s.blocks_per_chunk, sliding_window=c.sliding_window,
                                offload_prompt_only=c.offload_prompt_only, num_workers=s.num_workers)


def _view(r: Any) -> ReqView:
    return ReqView(r.request_id, tuple(h.decode() for h in r.block_hashes), int(r.num_tokens),
                   int(r.num_prompt_tokens), int(r.num_computed_tokens), bool(r.is_finished()),
                   r.status.name == "FINISHED_ABORTED", bool(r.skip_reading_prefix_cache),
                   int(r.shared_prefix_boundary), r.kv_transfer_params)


def _step_input(out: Any) -> StepInput:
    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

    data = tuple((rid, None if groups is None else tuple(tuple(int(b) for b in g) for g in groups), bool(full))
                 for rid, groups, full in yield_req_data(out))
    return StepInput(data, tuple((rid, int(n)) for rid, n in out.num_scheduled_tokens.items()),
                     tuple(out.finished_req_ids or ()), tuple(out.preempted_req_ids or ()),
                     tuple(int(c.dst_block_id) for c in out.kv_cache_block_copies or ()))


def _jobs_json(jobs: dict[int, JobView]) -> dict[str, Any]:
    return {str(j): {"kind": v.kind, "req": v.req, "gpu": list(v.gpu), "group_sizes": list(v.group_sizes),
                     "block_indices": list(v.block_indices),
                     "chunks": list(v.chunks), "keys": sorted(key_text(k) for k in v.keys), "sync": v.sync}
            for j, v in sorted(jobs.items())}


def _meta_json(meta: Meta) -> dict[str, Any]:
    return {"load_jobs": _jobs_json(dict(meta.load_jobs)), "store_jobs": _jobs_json(dict(meta.store_jobs)),
            "jobs_to_flush": sorted(meta.jobs_to_flush)}


class ConnectorLockstep:
    """The model beside ``s``'s real connector, compared after every call (module docstring)."""

    WRAPPED = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "update_connector_output", "request_finished", "reset_cache", "take_events",
               "has_pending_push_work")

    def __init__(self, s: VllmConnectorScheduler, factory: ModelFactory = OffloadingConnectorModel) -> None:
        self.s = s
        self.real = s.connector
        self.model = factory(model_config(s))
        self.requests: dict[str, Any] = {}  # the Request objects vLLM's scheduler registered
        self.calls = 0
        self.divergence: dict[str, Any] | None = None  # the first difference found
        for name in self.WRAPPED:
            setattr(self.real, name, self._wrap(name, getattr(self.real, name)))

    def _views(self) -> dict[str, ReqView]:
        return {rid: _view(self.requests[rid]) for rid in self.model.reqs}

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        predict = getattr(self, f"_model_{name}")

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            prepared = self._prepare(name, *args, **kwargs)
            result = real(*args, **kwargs)
            if name == "take_events":
                result = list(result)
            self.calls += 1
            if name == "on_new_request":
                rid = args[0].request_id
                self.s._reader._contexts[rid] = self.real._req_status[rid].req_context
            try:
                predicted = predict(*prepared)
            except Exception as exc:
                self._diverge(name, "raised", self._real_value(name, result), f"{type(exc).__name__}: {exc}")
            mine = self._model_value(name, predicted)
            theirs = self._real_value(name, result)
            if mine != theirs:
                self._diverge(name, "return value", theirs, mine)
            self._compare_state(name)
            return iter(result) if name == "take_events" else result

        return wrapped

    # -- the same inputs, as plain values -----------------------------------------------------------

    def _prepare(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        if name == "on_new_request":
            self.requests[args[0].request_id] = args[0]
            return (_view(args[0]),)
        if name == "get_num_new_matched_tokens":
            request, computed = args[0], args[1]
            max_new = kwargs.get("max_num_new_tokens", args[2] if len(args) > 2 else None)
            return _view(request), int(computed), max_new
        if name == "update_state_after_alloc":
            request, blocks, external = args
            table = [[(int(b.block_id), b.block_hash is not None) for b in g] for g in blocks.blocks]
            return _view(request), table, int(external)
        if name == "build_connector_meta":
            return _step_input(args[0]), self._views()
        if name == "update_connector_output":
            meta = args[0].kv_connector_worker_meta
            completed = {} if meta is None else {int(j): int(n) for j, n in meta.completed_jobs.items()}
            return completed, self._views()
        if name == "request_finished":
            return (_view(args[0]),)
        if name == "reset_cache":
            return (self._views(),)
        return ()

    def _model_on_new_request(self, view: ReqView) -> None:
        self.model.on_new_request(view)

    def _model_get_num_new_matched_tokens(self, view: ReqView, computed: int,
                                          max_new: int | None) -> tuple[int | None, bool]:
        return self.model.get_num_new_matched_tokens(view, computed, max_new)

    def _model_update_state_after_alloc(self, view: ReqView, table: list[list[tuple[int, bool]]],
                                        external: int) -> None:
        self.model.update_state_after_alloc(view, table, external)

    def _model_build_connector_meta(self, step: StepInput, views: dict[str, ReqView]) -> Meta:
        return self.model.build_connector_meta(step, views)

    def _model_update_connector_output(self, completed: dict[int, int], views: dict[str, ReqView]) -> None:
        self.model.update_connector_output(completed, views)

    def _model_request_finished(self, view: ReqView) -> tuple[bool, None]:
        return self.model.request_finished(view)

    def _model_reset_cache(self, views: dict[str, ReqView]) -> None:
        self.model.reset_cache(views)

    def _model_take_events(self) -> list[Any]:
        return self.model.take_events()

    def _model_has_pending_push_work(self) -> bool:
        return self.model.has_pending_push_work()

    # -- comparison ------------------------------------------------------------------------------

    def _model_value(self, name: str, value: Any) -> Any:
        return _meta_json(value) if name == "build_connector_meta" else value

    def _real_value(self, name: str, value: Any) -> Any:
        if name == "take_events":
            return [repr(e) for e in value]
        if name != "build_connector_meta":
            return value
        jobs = self.real._jobs

        def job(jid: int, j: Any, load: bool) -> JobView:
            gpu, cpu = (j.dst_spec, j.src_spec) if load else (j.src_spec, j.dst_spec)
            keys = frozenset(_unpack(k) for k in jobs[jid].keys) if jid in jobs else frozenset()
            return JobView("load" if load else "store", j.req_id, tuple(int(b) for b in gpu.block_ids),
                           tuple(int(n) for n in gpu.group_sizes or ()),
                           tuple(int(i) for i in gpu.block_indices or ()), tuple(int(c) for c in cpu.block_ids),
                           keys, bool(j.sync))

        return _meta_json(Meta({j: job(j, v, True) for j, v in value.load_jobs.items()},
                               {j: job(j, v, False) for j, v in value.store_jobs.items()},
                               frozenset(int(j) for j in value.jobs_to_flush or ())))

    def _real_state(self) -> dict[str, Any]:
        r = self.real
        return {
            "requests": {rid: {"jobs": sorted(st.transfer_jobs), "signalled": bool(st.finished_signaled),
                               "local": int(st.num_locally_computed_tokens),
                               "groups": [[g.next_stored_chunk_idx, list(g.block_ids), len(g.offload_keys)]
                                          for g in st.group_states]}
                         for rid, st in sorted(r._req_status.items())},
            "jobs": {str(j): [v.req_id, v.pending_count, v.is_store] for j, v in sorted(r._jobs.items())},
            "counter": r._job_counter, "stale": r._stale_job_threshold,
            "fence": {str(j): n for j, n in sorted(r._reset_fence.items())},
            "fenced": {str(b): sorted(js) for b, js in sorted(r._block_id_to_pending_jobs.items())},
            "loading": sorted(key_text(_unpack(k)) for k in r._chunks_being_loaded or ()),
        }

    def _model_state(self) -> dict[str, Any]:
        m = self.model
        return {
            "requests": {rid: {"jobs": sorted(st.jobs), "signalled": st.signalled, "local": st.num_local,
                               "groups": [[g.next_stored, list(g.block_ids), len(g.keys)] for g in st.groups]}
                         for rid, st in sorted(m.reqs.items())},
            "jobs": {str(j): [v.req, v.pending, v.is_store] for j, v in sorted(m.jobs.items())},
            "counter": m.job_counter, "stale": m.stale_threshold,
            "fence": {str(j): n for j, n in sorted(m.reset_fence.items())},
            "fenced": {str(b): sorted(js) for b, js in sorted(m.fenced.items())},
            "loading": sorted(key_text(k) for k in m.being_loaded),
        }

    def _compare_state(self, name: str) -> None:
        mine, theirs = self._model_state(), self._real_state()
        if mine != theirs:
            self._diverge(name, "connector state", theirs, mine)
        mine_m, theirs_m = snapshot_of(self.model.manager), self.s._reader.snapshot()
        if mine_m != theirs_m:
            self._diverge(name, "manager snapshot", theirs_m, mine_m)

    def _diverge(self, call: str, what: str, vllm: Any, model: Any) -> None:
        if isinstance(vllm, dict) and isinstance(model, dict):
            differing = sorted(k for k in set(vllm) | set(model) if vllm.get(k) != model.get(k))
            vllm = {k: vllm.get(k) for k in differing}
            model = {k: model.get(k) for k in differing}
        self.divergence = {"step": self.s.steps, "call_index": self.calls, "call": call, "what": what,
                           "vllm": vllm, "model": model}
        raise LockstepDivergence(self.divergence)


@dataclass
class LockstepResult:
    """One lockstep trace: the fuzz trace's result and the calls compared."""

    trace: TraceResult
    calls: int

    @property
    def divergence(self) -> dict[str, Any] | None:
        """The first difference (step, call, what, both values), None without one."""
        f = self.trace.finding
        return f["record"] if f is not None and f["kind"] == "divergence" else None


def _lockstep(run: Callable[[Hook], TraceResult], factory: ModelFactory) -> LockstepResult:
    """``run`` (a trace given the hook) with the model in lockstep; a divergence becomes the
    trace's finding (kind ``divergence``, with the record of ``LockstepDivergence``)."""
    holder: list[ConnectorLockstep] = []
    result = run(lambda s: holder.append(ConnectorLockstep(s, factory)))
    f = result.finding
    if f is not None and holder and holder[0].divergence is not None:
        f["kind"] = "divergence"
        f["record"] = holder[0].divergence
    return LockstepResult(result, holder[0].calls if holder else 0)


def run_lockstep_trace(config: ConnectorConfig, async_scheduling: bool, seed: int, num_ops: int = 60,
                       factory: ModelFactory = OffloadingConnectorModel, profile: str = "mixed") -> LockstepResult:
    """``offloading_connector_fuzz.run_trace`` under ``profile`` with the model in lockstep."""
    return _lockstep(lambda hook: run_trace(config, async_scheduling, seed, num_ops, profile, hook), factory)


def run_lockstep_ops(config: ConnectorConfig, async_scheduling: bool, ops: list[Op],
                     factory: ModelFactory = OffloadingConnectorModel) -> LockstepResult:
    """``offloading_connector_fuzz.run_ops`` (a saved trace's operations) with the model in lockstep."""
    return _lockstep(lambda hook: run_ops(config, async_scheduling, ops, hook=hook), factory)


class LockstepCase(NamedTuple):
    """One lockstep trace to run: configuration, scheduling mode, trace seed, generation profile."""

    config: ConnectorConfig
    async_scheduling: bool
    seed: int
    profile: str


def lockstep_configs(count: int, seed: int) -> Iterator[LockstepCase]:
    """``count`` cases: trace ``i`` runs the generation profile ``PROFILES[(i // 8) % 4]`` (eight
    traces of each in turn), LRU for even ``i`` and ARC for odd, async scheduling when ``i // 2``
    is odd; outside the ``window`` profile half the traces (drawn) get a sliding-window group of
    two blocks when ``i // 4`` is odd and none when even, the others keep ``draw_config``'s; a
    store threshold of 2 in a quarter (drawn); the rest as ``draw_config`` draws it."""
    rng = random.Random(seed)
    for i in range(count):
        profile = PROFILES[(i // 8) % len(PROFILES)]
        config = replace(draw_config(rng, profile)[0], store_threshold=rng.choice([0, 0, 0, 2]))
        window = config.sliding_window
        if profile != "window" and rng.random() < 0.5:
            window = (0, 2 * config.block_size)[(i // 4) % 2]
        config = replace(config, eviction_policy=("lru", "arc")[i % 2], sliding_window=window)
        yield LockstepCase(config, bool((i // 2) % 2), rng.randrange(2**31), profile)


def save_divergence(result: LockstepResult, num_ops: int) -> Path | None:
    """The trace of a divergence as JSON under ``$KVSPEC_VLLM_TRACE_DIR`` (None without one)."""
    where = os.environ.get("KVSPEC_VLLM_TRACE_DIR")
    if result.divergence is None or not where:
        return None
    path = Path(where) / f"connector-lockstep-{result.trace.seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result.trace.to_json(), "num_ops": num_ops}, indent=1, default=str))
    return path
