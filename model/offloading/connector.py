"""vLLM 0.33.0's ``OffloadingConnectorScheduler`` (``distributed/kv_transfer/kv_connector/v1/
offloading/scheduler.py``): the scheduler side of the OffloadingConnector, around a model
``OffloadingManager`` (``kvspec.model.offloading.manager``).

Scope: the configurations kvspec's harness drives (``kvspec.adapters.vllm_offloading_connector``):
one full-attention group, optionally a second sliding-window group, ``blocks_per_chunk`` chunks
of GPU blocks (the harness gets 1; any value without a sliding-window group), one worker,
GPU prefix caching on, LRU or ARC, ``store_threshold``, ``offload_prompt_only``. Refused with a
``ConfigError`` naming the feature (``ConnectorModelConfig.validate``, ``on_new_request``):
recurrent (mamba) groups and their partial tails, EAGLE draft groups, tiering, decode context
parallelism, the canonical layout, ``sync_load_budget_bytes``, a prefix-cache retention
interval other than vLLM's default 0, a sliding-window group with ``blocks_per_chunk > 1``
and the per-request ``max_load_tokens``/``max_offload_tokens``/``kv_load_tiers``.
KV events are off (the harness sets no ``kv_events_config``): ``take_events`` yields none.

Inputs are what vLLM's scheduler hands the connector, as plain values: a request as a
``ReqView`` (its block hashes as text, token counts, whether it finished or was aborted), the
blocks ``allocate_slots`` gave (per group: ``(block id, hashed)``, id 0 the null block), a
``StepInput`` (the scheduler output's per-request new blocks, scheduled token counts, finished
and preempted ids, block copies) and the workers' completed jobs. A key is ``(block hash,
group)`` as the manager contract has it. Rules, each stated once (vLLM's function in brackets):

* **Keys** [``RequestOffloadState.update_offload_keys``]. A group's chunk ``i`` is keyed by the
  request's block hash ``(i + 1) * blocks_per_chunk - 1`` and the group; keys are appended as
  hashes appear, each declared to the manager at end position ``(i + 1) * tokens_per_chunk``.
* **Lookup** [``get_num_new_matched_tokens``, ``_lookup_complete_chunks``]. The request's block
  lists are cleared and its store cursors set to 0; with a transfer in flight it is answered
  ``None`` (ask again). The hit limit starts at ``num_tokens`` (capped by
  ``num_computed + max_num_new_tokens``; one less with a sliding-window group) and every group
  narrows it: the full group to its longest run of cached chunks from ``num_computed``
  [``_maximal_prefix_lookup``], the sliding-window group to the right end of the last run of
  window-many cached chunks scanning from the right, the first run a chunk wider when the limit
  is not chunk-aligned [``_sliding_window_lookup``, ``load_window_size_in_chunks``]. When a
  group narrows the limit after a sliding-window group was looked up, the sliding-window groups
  are looked up again, until it settles. Less than one chunk is no hit (0); a chunk still being
  stored (``HIT_PENDING``) anywhere in the answer, or a hit chunk being loaded for another
  request, makes it ``None``. A hit is loaded asynchronously (the second value is
  ``hit > 0``; no sync-load budget).
* **Load** [``update_state_after_alloc``]. Every non-null block handed out in the step is noted
  (for flushes). With external tokens, per group the load starts at the first fresh
  (non-null, unhashed) block from ``num_computed`` and ends at the hit; its chunks' keys are
  pinned (``prepare_load``), one load job takes them to those GPU blocks, the store cursor jumps
  to the hit, and the keys count as being loaded until the job completes.
* **Step** [``build_connector_meta``, ``_update_req_states``]. Scheduled requests refresh their
  keys and append their new blocks (a full table replaces the list). Sliding-window blocks
  handed out again in this step are zeroed where they still wait to be stored. Flushed: the
  in-flight jobs (not this step's loads) of preempted requests, and every job whose source
  blocks are fenced and were handed out in the step. Then the stores, then each finished
  request is signalled to the manager once and forgotten when it has no job left.
* **Store** [``_build_store_jobs``]. For each scheduled request, then each finished one, the
  tokens after the batch (an aborted request: those computed; a finished one: all but the last
  sampled, at least the prompt), capped at ``num_tokens`` and, with ``offload_prompt_only``, at
  the prompt. Per group the storable chunks are those complete, allocated and keyed; chunks from
  the store cursor whose blocks are all non-null are offered (``prepare_store``), in the
  sliding-window group only those a later hit can reach (``_reachable``). None offered or
  none to store: the cursors move to the storable end; a refused store (``None``) moves nothing.
  Otherwise one store job copies, per group, the blocks of the chunks to store, and the cursors
  move to the storable end. Sliding-window source blocks are fenced at once, the full group's
  when the request has finished (then a block handed out in this step flushes the job at once).
* **Completion** [``update_connector_output``]. A job is done when every worker reported it:
  the manager completes the store or load, its fences are dropped, and a finished, signalled
  request with no job left is forgotten. Reports of jobs from before the last reset only count
  down the reset fence.
* **Finish** [``request_finished``]. Returns ``(False, None)`` (blocks are freed at once); the
  keys are refreshed (the last store happens at the next step) and the full group's blocks of
  the request's jobs in flight become fenced. An untracked request is opened and closed in the
  manager at once.
* **Reset** [``reset_cache``]. Every job in flight is flushed by the next step; finished
  requests are signalled (once) and forgotten; the manager is reset; live requests restart their
  stores at chunk 0 and forget their jobs, whose later reports are stale.

Not modelled, as it changes nothing here: the reconsidered tail of a finished sliding-window
request (``_final_swa_alignment_blocks``: off with a retention interval); statistics, the
cache-hit sources, the manager lock and its ``on_schedule_end``/``on_reset_flushed`` (no-ops
in the CPU manager). State is O(R*C + J) for R requests of C chunks, J jobs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvspec.contract.errors import ConfigError, InvalidOperationError
from kvspec.contract.offloading import OffloadingConfig, OffloadKey
from kvspec.model.offloading.manager import OffloadingManager

REFUSED_PARAMS = ("max_load_tokens", "max_offload_tokens", "kv_load_tiers")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ConnectorModelConfig:
    """The connector's shape: ``block_size`` tokens per GPU block (= per hash),
    ``blocks_per_chunk``, ``sliding_window`` tokens of a second group (0: none),
    ``offload_prompt_only``, the manager's config; the refused features' knobs at their
    harness values."""

    block_size: int
    manager: OffloadingConfig
    blocks_per_chunk: int = 1
    sliding_window: int = 0
    offload_prompt_only: bool = True
    num_workers: int = 1
    recurrent_groups: int = 0
    eagle: bool = False
    tiering: bool = False
    dcp_world_size: int = 1
    canonical_layout: bool = False
    sync_load_budget_bytes: int = 0
    retention_interval: int | None = 0

    def validate(self) -> None:
        for name in ("block_size", "blocks_per_chunk", "num_workers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"connector model: {name} must be an int >= 1, got {value!r}")
        if type(self.sliding_window) is not int or self.sliding_window < 0:
            raise ConfigError("connector model: sliding_window must be an int >= 0")
        refused = [name for name, on in (
            ("recurrent (mamba) groups", self.recurrent_groups != 0), ("EAGLE draft groups", self.eagle),
            ("tiering", self.tiering), ("decode context parallelism", self.dcp_world_size != 1),
            ("canonical layout", self.canonical_layout), ("sync_load_budget_bytes", self.sync_load_budget_bytes != 0),
            ("a prefix_cache_retention_interval other than 0", self.retention_interval != 0),
            ("a sliding-window group with blocks_per_chunk > 1",
             bool(self.sliding_window) and self.blocks_per_chunk > 1),
        ) if on]
        if refused:
            raise ConfigError(f"connector model: not modelled: {', '.join(refused)}")
        self.manager.validate()

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def num_groups(self) -> int:
        return 2 if self.sliding_window else 1

    @property
    def window_chunks(self) -> int:
        """The sliding-window group's window in chunks [``get_sliding_window_size_in_chunks``]."""
        return _cdiv(self.sliding_window, self.tokens_per_chunk)

    def load_window(self, num_tokens: int) -> int:
        """The sliding-window group's window for a hit ending at ``num_tokens``: a chunk more
        when the end is not chunk-aligned [``GroupOffloadConfig.load_window_size_in_chunks``]."""
        tpc = self.tokens_per_chunk
        return max(self.window_chunks, _cdiv(self.sliding_window - 1 + (-num_tokens % tpc), tpc))


@dataclass(frozen=True)
class ReqView:
    """A request as the connector reads it at a call."""

    req_id: str
    hashes: tuple[str, ...]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    finished: bool = False
    aborted: bool = False
    skip_reading_prefix_cache: bool = False
    shared_prefix_boundary: int = 0
    kv_transfer_params: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class StepInput:
    """What ``build_connector_meta`` reads of the scheduler output: per scheduled request (new
    ones first) its new blocks per group (None: none) and whether they are its whole table;
    scheduled tokens (in order), finished and preempted ids (in vLLM's iteration order), the
    destinations of block copies."""

    req_data: tuple[tuple[str, tuple[tuple[int, ...], ...] | None, bool], ...] = ()
    num_scheduled: tuple[tuple[str, int], ...] = ()
    finished: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    block_copies: tuple[int, ...] = ()


@dataclass(frozen=True)
class JobView:
    """A transfer job of a step's metadata: GPU blocks (group-major, with group sizes and each
    group's first block position in the request's table, 0 for an empty group), CPU chunks, its
    keys, whether it loads synchronously."""

    kind: str
    req: str
    gpu: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    chunks: tuple[int, ...]
    keys: frozenset[OffloadKey]
    sync: bool = False


@dataclass(frozen=True)
class Meta:
    """A step's ``OffloadingConnectorMetadata``: load and store jobs by id, jobs to flush."""

    load_jobs: Mapping[int, JobView]
    store_jobs: Mapping[int, JobView]
    jobs_to_flush: frozenset[int]


@dataclass
class _Group:
    """A request's group: chunk keys, GPU block ids (0: null or stale), the store cursor."""

    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    next_stored: int = 0


@dataclass
class _Req:
    """A tracked request: its groups, tokens computed locally at its lookup, its jobs in
    flight, whether its finish was signalled to the manager."""

    groups: list[_Group]
    num_local: int = 0
    jobs: set[int] = field(default_factory=set)
    signalled: bool = False


@dataclass
class _Job:
    """A job in flight: request, workers still to report, keys, and the GPU blocks it fences
    once its request finished (``deferred_fence``: full attention) or at once (``fence``)."""

    req: str
    pending: int
    keys: frozenset[OffloadKey]
    is_store: bool
    deferred_fence: list[int] = field(default_factory=list)
    fence: list[int] = field(default_factory=list)


class OffloadingConnectorModel:
    """The connector's scheduler side; ``manager`` is the model manager it drives."""

    def __init__(self, config: ConnectorModelConfig) -> None:
        config.validate()
        self.config = config
        self.manager = OffloadingManager(config.manager)
        self.reqs: dict[str, _Req] = {}
        self.jobs: dict[int, _Job] = {}
        self.job_counter = 0
        self.stale_threshold = 0
        self.reset_fence: dict[int, int] = {}
        self.fenced: dict[int, set[int]] = {}  # GPU block -> store jobs reading it
        self.being_loaded: set[OffloadKey] = set()
        self.batch_loads: dict[int, JobView] = {}
        self.batch_flush: set[int] = set()
        self.batch_allocated: set[int] = set()

    # -- helpers -------------------------------------------------------------------------------

    def _is_window(self, g: int) -> bool:
        return g == 1

    def _new_job_id(self) -> int:
        self.job_counter += 1
        return self.job_counter - 1

    def _update_keys(self, rid: str, view: ReqView) -> None:
        """The keys rule (module docstring)."""
        bpc, tpc = self.config.blocks_per_chunk, self.config.tokens_per_chunk
        state = self.reqs[rid]
        for g, group in enumerate(state.groups):
            new = []
            for h in view.hashes[bpc * len(group.keys) + bpc - 1::bpc]:
                group.keys.append((h, g))
                new.append(((h, g), len(group.keys) * tpc))
            if new:
                self.manager.set_key_positions(rid, new)

    def _storable(self, group: _Group, num_tokens: int) -> int:
        """Complete, allocated and keyed leading chunks [``storable_chunks``]."""
        return min(num_tokens // self.config.tokens_per_chunk,
                   len(group.block_ids) // self.config.blocks_per_chunk, len(group.keys))

    def _offloadable(self, view: ReqView, num_tokens: int) -> int:
        """[``_calc_num_offloadable_tokens``]"""
        n = min(num_tokens, view.num_tokens)
        return min(n, view.num_prompt_tokens) if self.config.offload_prompt_only else n

    def _drop_fence(self, jid: int, blocks: Sequence[int]) -> None:
        for b in blocks:
            jobs = self.fenced[b]
            jobs.remove(jid)
            if not jobs:
                del self.fenced[b]

    # -- requests --------------------------------------------------------------------------------

    def on_new_request(self, view: ReqView) -> None:
        """Open the request's context in the manager. Refused (nothing changes) when its
        ``kv_transfer_params`` ask for a feature not modelled."""
        asked = sorted(set(view.kv_transfer_params or ()) & set(REFUSED_PARAMS))
        if asked:
            raise ConfigError(f"connector model: not modelled: request parameters {', '.join(asked)}")
        self.manager.on_new_request(view.req_id)
        self.reqs[view.req_id] = _Req([_Group() for _ in range(self.config.num_groups)])

    def get_num_new_matched_tokens(self, view: ReqView, num_computed: int,
                                   max_new: int | None = None) -> tuple[int | None, bool]:
        """The lookup rule (module docstring). O(C) lookups per group and convergence round."""
        state = self.reqs[view.req_id]
        for group in state.groups:
            group.block_ids.clear()
            group.next_stored = 0
        if state.jobs:
            return None, False
        self._update_keys(view.req_id, view)
        state.num_local = num_computed
        hit = 0 if view.skip_reading_prefix_cache else self._lookup(view, state, max_new)
        return hit, bool(hit)

    def _lookup(self, view: ReqView, state: _Req, max_new: int | None) -> int | None:
        c = self.config
        tpc, local = c.tokens_per_chunk, state.num_local
        limit = view.num_tokens if max_new is None else min(view.num_tokens, local + max_new)
        windows = (1,) if c.sliding_window else ()
        order: tuple[int, ...] = (0, *windows)
        if windows:
            limit -= 1
        num_hit, deferred, todo = 0, False, order
        while todo:
            looked_window, groups, todo = False, todo, ()
            for g in groups:
                keys = state.groups[g].keys
                limit = min(limit, len(keys) * tpc)
                if limit - local < tpc:
                    return 0
                num_chunks = min(_cdiv(limit, tpc), len(keys))
                start = local // tpc
                part = keys[start:num_chunks]
                n = (self._window_hits(view.req_id, part, c.window_chunks,
                                       c.load_window(min(limit, num_chunks * tpc)))
                     if self._is_window(g) else self._prefix_hits(view.req_id, part))
                if n == 0:
                    return 0
                if n is None:
                    deferred = True
                else:
                    limit = min(limit, tpc * (start + n))
                new_hit = limit - local
                if new_hit < tpc:
                    return 0
                if new_hit < num_hit:
                    if deferred:
                        deferred, todo = False, order
                    elif looked_window and not todo:
                        todo = windows
                looked_window |= self._is_window(g)
                num_hit = new_hit
        if deferred:
            return None
        if self.being_loaded:
            end = local + num_hit
            for g, group in enumerate(state.groups):
                part = group.keys[local // tpc:_cdiv(end, tpc)]
                if self._is_window(g):
                    part = part[-c.load_window(end):]
                if any(k in self.being_loaded for k in part):
                    return None
        return num_hit

    def _prefix_hits(self, rid: str, keys: Sequence[OffloadKey]) -> int | None:
        """Cached chunks from the first, up to the first miss; None if one is pending."""
        hits, pending = 0, False
        for key in keys:
            result = self.manager.lookup(rid, key)
            if result == "MISS":
                break
            hits += 1
            pending |= result == "HIT_PENDING"
        return None if pending else hits

    def _window_hits(self, rid: str, keys: Sequence[OffloadKey], window: int, first: int) -> int | None:
        """Scanning from the right: the end of the first run of ``window`` cached chunks (the
        first run, before any miss, needs ``first``); else the hits at the left edge; None if a
        chunk of the run found is pending."""
        hits, pending, need = 0, False, first
        for idx in range(len(keys) - 1, -1, -1):
            result = self.manager.lookup(rid, keys[idx])
            if result == "MISS":
                hits, pending, need = 0, False, window
            else:
                hits += 1
                pending |= result == "HIT_PENDING"
            if hits == need:
                return None if pending else idx + need
        return None if pending else hits

    def update_state_after_alloc(self, view: ReqView, blocks: Sequence[Sequence[tuple[int, bool]]],
                                 num_external: int) -> None:
        """The load rule (module docstring). O(B) for B blocks."""
        for group_blocks in blocks:
            self.batch_allocated.update(b for b, _ in group_blocks if b != 0)
        if num_external == 0:
            return
        c, rid = self.config, view.req_id
        state = self.reqs[rid]
        local = state.num_local
        cached = local + num_external
        keys: list[OffloadKey] = []
        gpu: list[int] = []
        sizes: list[int] = []
        starts: list[int] = []
        for g, group in enumerate(state.groups):
            group_blocks = blocks[g]
            end = _cdiv(cached, c.block_size)
            start = next((i for i in range(_cdiv(local, c.block_size), end)
                          if group_blocks[i][0] != 0 and not group_blocks[i][1]), end)
            num_chunks = _cdiv(cached, c.tokens_per_chunk)
            if end > start:
                keys += group.keys[start // c.blocks_per_chunk:num_chunks]
            gpu += [b for b, _ in group_blocks[start:end]]
            sizes.append(end - start)
            starts.append(start)
            group.next_stored = num_chunks
        chunks = self.manager.prepare_load(rid, keys)
        jid = self._new_job_id()
        self.batch_loads[jid] = JobView("load", rid, tuple(gpu), tuple(sizes), tuple(starts), tuple(chunks),
                                       frozenset(keys))
        state.jobs.add(jid)
        self.jobs[jid] = _Job(rid, c.num_workers, frozenset(keys), is_store=False)
        self.being_loaded.update(keys)

    # -- the step ----------------------------------------------------------------------------------

    def build_connector_meta(self, step: StepInput, views: Mapping[str, ReqView]) -> Meta:
        """The step rule (module docstring); ``views`` holds every tracked request."""
        self._update_requests(step, views)
        for rid in step.preempted:
            state = self.reqs.get(rid)
            if state is not None:
                self.batch_flush |= state.jobs - self.batch_loads.keys()
        for b in self.batch_allocated:
            self.batch_flush |= self.fenced.get(b, set())
        stores = self._build_stores(step, views)
        meta = Meta(self.batch_loads, stores, frozenset(self.batch_flush))
        for rid in step.finished:
            state = self.reqs.get(rid)
            if state is None:
                continue
            state.signalled = True
            self.manager.on_request_finished(rid)
            if not state.jobs:
                del self.reqs[rid]
        self.batch_loads, self.batch_flush, self.batch_allocated = {}, set(), set()
        return meta

    def _update_requests(self, step: StepInput, views: Mapping[str, ReqView]) -> None:
        """Keys and block lists of the scheduled requests; stale sliding-window blocks zeroed."""
        ends: dict[str, int] = {}
        for rid, new_blocks, full_table in step.req_data:
            state = self.reqs[rid]
            self._update_keys(rid, views[rid])
            if full_table:
                for group in state.groups:
                    group.block_ids.clear()
            if new_blocks:
                if self.config.sliding_window:
                    ends[rid] = len(state.groups[1].block_ids)
                for group, blocks in zip(state.groups, new_blocks, strict=True):
                    group.block_ids.extend(blocks)
                    self.batch_allocated.update(b for b in blocks if b != 0)
        self.batch_allocated.update(step.block_copies)
        if not self.config.sliding_window or not self.batch_allocated:
            return
        for rid, state in self.reqs.items():
            group = state.groups[1]
            for j in range(group.next_stored * self.config.blocks_per_chunk, ends.get(rid, len(group.block_ids))):
                if group.block_ids[j] in self.batch_allocated:
                    group.block_ids[j] = 0

    # long function: vLLM's store builder, offer then job, in one pass per request
    def _build_stores(self, step: StepInput, views: Mapping[str, ReqView]) -> dict[int, JobView]:
        """The store rule (module docstring). O(C) per request."""
        c = self.config
        bpc = c.blocks_per_chunk
        scheduled = dict(step.num_scheduled)
        stores: dict[int, JobView] = {}
        for rid in [*scheduled, *step.finished]:
            state = self.reqs.get(rid)
            if state is None:
                continue
            view = views[rid]
            if view.aborted:
                after = view.num_computed_tokens
            elif view.finished:
                after = max(view.num_prompt_tokens, view.num_tokens - 1)
            else:
                after = view.num_computed_tokens + scheduled[rid]
            offloadable = self._offloadable(view, after)
            ranges = []
            offered: list[OffloadKey] = []
            for g, group in enumerate(state.groups):
                end, start = self._storable(group, offloadable), group.next_stored
                ranges.append((start, end))
                reachable = self._reachable(view) if self._is_window(g) else None
                for i in range(start, end):
                    if reachable is not None and i not in reachable:
                        continue
                    if all(group.block_ids[i * bpc + b] != 0 for b in range(bpc)):
                        offered.append(group.keys[i])
            out = self.manager.prepare_store(rid, offered) if offered else None
            if not offered or (out is not None and not out.keys_to_store):
                for group in state.groups:
                    group.next_stored = max(group.next_stored, self._storable(group, offloadable))
                continue
            if out is None:
                continue
            to_store = set(out.keys_to_store)
            gpu: list[int] = []
            sizes: list[int] = []
            starts: list[int] = []
            window_blocks: list[int] = []
            full_blocks: list[int] = []
            for g, (group, (start, end)) in enumerate(zip(state.groups, ranges, strict=True)):
                positions = [p for i in range(start, end) if group.keys[i] in to_store
                             for p in range(i * bpc, (i + 1) * bpc) if group.block_ids[p] != 0]
                blocks = [group.block_ids[p] for p in positions]
                gpu += blocks
                sizes.append(len(blocks))
                starts.append(positions[0] if positions else 0)
                (window_blocks if self._is_window(g) else full_blocks).extend(blocks)
                group.next_stored = max(group.next_stored, end)
            jid = self._new_job_id()
            state.jobs.add(jid)
            for b in window_blocks:
                self.fenced.setdefault(b, set()).add(jid)
            self.jobs[jid] = _Job(rid, c.num_workers, frozenset(to_store), True, full_blocks, window_blocks)
            stores[jid] = JobView("store", rid, tuple(gpu), tuple(sizes), tuple(starts), tuple(out.chunk_ids),
                                   frozenset(to_store))
            if view.finished:
                for b in full_blocks:
                    self.fenced.setdefault(b, set()).add(jid)
                    if b in self.batch_allocated:
                        self.batch_flush.add(jid)
        return stores

    def _reachable(self, view: ReqView) -> set[int]:
        """The sliding-window chunks a later hit can use (retention interval 0: only the replay
        boundary ``num_prompt_tokens - 1`` and the shared-prefix junction): for each boundary
        ``b``, the ``ceil((window - 1) / block_size)`` chunks ending at ``b``'s chunk
        [``SlidingWindowManager.reachable_block_mask``; one block per chunk here]. O(1)."""
        need = _cdiv(self.config.sliding_window - 1, self.config.block_size)
        out: set[int] = set()
        for b in (view.num_prompt_tokens - 1, view.shared_prefix_boundary):
            if b:
                end = b // self.config.tokens_per_chunk
                out.update(range(max(0, end - need), end))
        return out

    def update_connector_output(self, completed: Mapping[int, int], views: Mapping[str, ReqView]) -> None:
        """The completion rule (module docstring); ``completed`` is job -> workers reporting it,
        in report order; ``views`` holds every tracked request."""
        for jid, count in completed.items():
            if jid < self.stale_threshold:
                if jid in self.reset_fence:
                    self.reset_fence[jid] -= count
                    if self.reset_fence[jid] <= 0:
                        del self.reset_fence[jid]
                continue
            job = self.jobs[jid]
            job.pending -= count
            if job.pending > 0:
                continue
            state = self.reqs[job.req]
            keys = sorted(job.keys)
            if job.is_store:
                self.manager.complete_store(job.req, keys)
            else:
                self.manager.complete_load(job.req, keys)
                self.being_loaded -= job.keys
            if self.fenced:
                self._drop_fence(jid, job.fence)
                if views[job.req].finished:
                    self._drop_fence(jid, job.deferred_fence)
            del self.jobs[jid]
            state.jobs.remove(jid)
            if state.signalled and not state.jobs:
                del self.reqs[job.req]

    def request_finished(self, view: ReqView) -> tuple[bool, None]:
        """The finish rule (module docstring)."""
        rid = view.req_id
        state = self.reqs.get(rid)
        if state is None:
            if rid not in self.manager.requests:
                self.manager.on_new_request(rid)
            self.manager.on_request_finished(rid)
            return False, None
        self._update_keys(rid, view)
        for jid in state.jobs:
            for b in self.jobs[jid].deferred_fence:
                self.fenced.setdefault(b, set()).add(jid)
        return False, None

    def reset_cache(self, views: Mapping[str, ReqView]) -> None:
        """The reset rule (module docstring); ``views`` holds every tracked request. Refused
        (``InvalidOperationError``, nothing changed) while the previous reset's flush has not
        gone out with a step: vLLM asserts there (``assert not self._current_batch_jobs_to_flush``),
        so two resets without a step between crash it."""
        if self.batch_flush or self.batch_loads or self.batch_allocated:
            raise InvalidOperationError("reset_cache inside a step or before the last reset's flush went out")
        self.batch_flush |= self.jobs.keys()
        for rid, state in list(self.reqs.items()):
            if views[rid].finished:
                if not state.signalled:
                    self.manager.on_request_finished(rid)
                del self.reqs[rid]
        self.manager.reset_cache()
        for state in self.reqs.values():
            for group in state.groups:
                group.next_stored = 0
            state.jobs.clear()
        self.stale_threshold = self.job_counter
        self.reset_fence.update((jid, job.pending) for jid, job in self.jobs.items())
        self.jobs.clear()
        self.fenced.clear()
        self.being_loaded.clear()

    def has_pending_push_work(self) -> bool:
        """Jobs in flight or a reset fence keep the engine stepping (the CPU manager has no
        work of its own)."""
        return bool(self.jobs or self.reset_fence)

    def take_events(self) -> list[Any]:
        """KV events are off: none."""
        return []

    # -- observation -------------------------------------------------------------------------------

    def _check(self) -> None:
        """Jobs: ids below the counter, at or above the stale threshold, each owned by a tracked
        request that lists it; a request's jobs all exist; a load is never beside another job of
        its request; fences name live store jobs; the stale fence holds only old ids; the manager's
        own check. Per group, the store cursor never passes the keyed chunks."""
        owned = set()
        for rid, state in self.reqs.items():
            assert len(state.groups) == self.config.num_groups
            for jid in state.jobs:
                assert jid in self.jobs and self.jobs[jid].req == rid
            loads = [j for j in state.jobs if not self.jobs[j].is_store]
            assert not loads or len(state.jobs) == 1
            owned |= state.jobs
        assert owned == set(self.jobs)
        assert all(self.stale_threshold <= j < self.job_counter for j in self.jobs)
        assert all(j < self.stale_threshold for j in self.reset_fence)
        for jobs in self.fenced.values():
            assert jobs and all(j in self.jobs and self.jobs[j].is_store for j in jobs)
        assert all(j in self.jobs for j in self.batch_loads)
        self.manager._check()
