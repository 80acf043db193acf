"""Real vLLM 0.33.0 as a kvspec target: its ``BlockPool`` and ``SimpleCPUOffloadScheduler``.

``make_vllm_target(config)`` builds vLLM's own objects (no mocks, no engine, no
worker) and wraps them in the ``OffloadTarget`` contract, so the engine model, the
conformance harness, the fuzzer and ``replay`` can drive real vLLM exactly as they
drive the model:

* **Pools:** the GPU pool is a vLLM ``BlockPool`` with prefix caching; it and the
  manager's CPU pool are exposed as ``gpu_pool``/``cpu_pool`` (``VllmPool``), which
  speak block ids and kvspec keys ``(hash_hex, group_id)``; vLLM keys are the hash
  bytes followed by the group id as 4 big-endian bytes.
* **Manager:** ``SimpleCPUOffloadScheduler`` built from a duck-typed ``vllm_config``
  (only the attributes the manager reads), a ``KVCacheConfig`` with one
  ``FullAttentionSpec`` or ``SlidingWindowSpec`` group per configured group, and an
  explicit ``num_cpu_blocks`` (the CPU null block included, as in kvspec).
* **Requests:** each kvspec request (``RequestView``) is mirrored by one
  ``vllm.v1.request.Request`` whose block hasher hands out the view's own hashes, so
  vLLM sees exactly kvspec's chained hashes. Before every call the mirrors that vLLM
  can read are synchronised (tokens, computed tokens, output placeholders).
* **Inputs** are checked with the model's own rules before anything reaches vLLM,
  so a bad call raises the same ``KVSpecError`` subclass and changes nothing: every check,
  including those of the request views vLLM will read during the call, runs before the first
  vLLM object (or mirror) is touched. ``raw=True`` (targets ``raw:vllm``, ``raw:vllm@VERSION``)
  keeps only the checks without which vLLM's arguments cannot be built (types, shapes, block
  ids that name a block); the model's rules (a load's acceptance and destinations, a store's
  keys, the worker reports' events and counts, count ranges, the null block, double frees,
  second keys) are left to vLLM, and what it does is judged by the invariants.
* **snapshot()** reads vLLM's objects back into the model's canonical format.

``baseline_oracle`` is what vLLM 0.33.0 claims plus completeness C1: with it as the only
oracle (no model alongside, what an engine author without kvspec's model would have),
``kvspec.drivers.harness.fuzz_with_invariants`` finds the stale-cursor FIXME in real vLLM
as a C1 violation by itself.

vLLM is imported only inside ``make_vllm_target``: kvspec imports without it, and a
missing vLLM is a ``ConfigError`` that says how to get it. Only the ``baseline``
policy exists in vLLM 0.33.0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, overload

from kvspec.adapters import vllm_compat as compat
from kvspec.contract.checks import (
    check_block_ids,
    check_block_key,
    check_cached_block_query,
    check_count,
    check_count_type,
    check_free_counts,
    check_id_list,
    check_key_change,
    check_load_acceptance,
    check_load_block,
    check_new_block_count,
    check_request,
    check_scheduler_output,
    check_store_keys,
    check_worker_output,
    name_of,
)
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, InvalidOperationError
from kvspec.contract.snapshot import Transfer, pool_section, scheduler_section
from kvspec.contract.types import (
    BlockIds,
    ConnectorMetadata,
    KVConnectorOutput,
    RequestView,
    SchedulerOutput,
)

VLLM_VERSION = "0.33.0"
_MAX_MODEL_LEN = 1 << 20
_GROUP_ID_BYTES = 4

Key = tuple[str, int]


# -- keys ------------------------------------------------------------------------------------


def hash_to_bytes(block_hash: str) -> bytes:
    """kvspec's hex block hash as vLLM's ``BlockHash`` bytes."""
    try:
        raw = bytes.fromhex(block_hash)
    except (TypeError, ValueError):
        raise InvalidOperationError(f"block hash {block_hash!r} is not hex text") from None
    if not raw:
        raise InvalidOperationError("empty block hash")
    return raw


def key_to_bytes(key: Key) -> bytes:
    """``(hash_hex, group_id)`` as vLLM's ``BlockHashWithGroupId``."""
    return hash_to_bytes(key[0]) + int(key[1]).to_bytes(_GROUP_ID_BYTES, "big")


@overload
def key_from_bytes(raw: bytes) -> Key: ...
@overload
def key_from_bytes(raw: None) -> None: ...
@overload
def key_from_bytes(raw: bytes | None) -> Key | None: ...


def key_from_bytes(raw: bytes | None) -> Key | None:
    if raw is None:
        return None
    return raw[:-_GROUP_ID_BYTES].hex(), int.from_bytes(raw[-_GROUP_ID_BYTES:], "big")


def _key_text(raw: bytes) -> str:
    h, g = key_from_bytes(raw)
    return f"{h}:{g}"


# -- pools -----------------------------------------------------------------------------------


class _BlockView:
    """Read-only per-block attribute of a vLLM pool, indexable by block id."""

    def __init__(self, blocks: list[Any], read: Any) -> None:
        self._blocks = blocks
        self._read = read

    def __getitem__(self, block_id: int) -> Any:
        return self._read(self._blocks[block_id])

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Any]:
        return (self._read(b) for b in self._blocks)


class _FreeQueueView:
    """The ids of a vLLM free queue, head (evicted first) to tail, at most ``limit`` of them."""

    def __init__(self, queue: Any, limit: int) -> None:
        self._queue, self._limit = queue, limit

    def __iter__(self) -> Iterator[int]:
        return (b.block_id for b in compat.free_blocks_in(self._queue, self._limit))

    def __len__(self) -> int:
        return int(self._queue.num_free_blocks)

    def __contains__(self, block_id: object) -> bool:
        return any(b == block_id for b in self)


def _cached_map(pool: Any) -> dict[str, list[int]]:
    """vLLM's prefix map as ``{"hash:gid": [block ids in insertion order]}``; the snapshot
    sorts the keys (vLLM's own key order moves a key to the end when one of its duplicate
    blocks is popped; no lookup depends on it)."""
    rows = []
    for raw, entry in pool.cached_block_hash_to_block._cache.items():
        ids = [entry.block_id] if not isinstance(entry, dict) else [b.block_id for b in entry.values()]
        rows.append((key_from_bytes(raw), ids))
    return {f"{k[0]}:{k[1]}": ids for k, ids in rows}


def pool_snapshot(pool: Any) -> dict[str, Any]:
    """A vLLM ``BlockPool`` in the model's ``BlockPool.snapshot`` format.

    vLLM's secondary (fine-grained) keys have no place in the model; when any exist
    they are shown under ``secondary`` so that a comparison with the model fails.
    """
    snap = pool_section(
        pool.num_gpu_blocks,
        (b.ref_cnt for b in pool.blocks),
        (None if b.block_hash is None else _key_text(b.block_hash) for b in pool.blocks),
        (b.block_id for b in compat.free_blocks_in(pool.free_block_queue, pool.num_gpu_blocks + 1)),
        _cached_map(pool),
        pool.free_block_queue.num_free_blocks,
    )
    if getattr(pool, "cached_block_hashes_by_block", None):  # secondary keys: not in every release
        snap["secondary"] = {
            str(b): sorted(_key_text(k) for k in keys)
            for b, keys in sorted(pool.cached_block_hashes_by_block.items())
        }
    return snap


class VllmPool:
    """A vLLM ``BlockPool`` behind kvspec's ``GpuPool`` contract (block ids, text keys).

    Every call is checked with the model pool's rules first (``kvspec.contract.checks``: ids
    in range, never the null block, no free below ref count 0, no allocation beyond the free
    count, keys and group ids of the right shape), so a refused call raises what the model
    raises and changes nothing. ``num_groups`` bounds the group ids of keys (None: unbounded).

    ``raw``: only what is needed to name vLLM's objects is checked (ids that are blocks of the
    pool, counts and keys of the right type); the model's rules are not, so a negative count, the
    null block, a double free or a second key reach vLLM, and what it does is for the oracle to
    judge. What vLLM hands back is checked in both modes: blocks of its own pool, never the null
    block (``VllmBrokeContract`` otherwise, a crash of vLLM, not a refusal).
    """

    def __init__(self, pool: Any, name: str = "gpu", num_groups: int | None = None, raw: bool = False) -> None:
        self.pool = pool
        self.name = name
        self.num_groups = num_groups
        self.raw = raw
        self.num_blocks: int = pool.num_gpu_blocks
        self.ref_cnt = _BlockView(pool.blocks, lambda b: b.ref_cnt)
        self.block_hash = _BlockView(pool.blocks, lambda b: key_from_bytes(b.block_hash))
        self.free_queue = _FreeQueueView(pool.free_block_queue, pool.num_gpu_blocks + 1)

    def get_num_free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def get_new_blocks(self, n: int) -> list[int]:
        if self.raw:
            check_count_type(n, f"{self.name}: blocks to allocate")
        else:
            check_new_block_count(n, self.get_num_free_blocks(), self.name)
        return handed_out(self.pool.get_new_blocks(n), self.num_blocks, self.name, n)

    def touch(self, block_ids: Iterable[int]) -> None:
        ids = self._validate(block_ids, "touch")
        self.pool.touch([self.pool.blocks[b] for b in ids])

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        ids = self._validate(block_ids, "free")
        if not self.raw:
            check_free_counts(ids, lambda b: self.pool.blocks[b].ref_cnt, self.name)
        self.pool.free_blocks([self.pool.blocks[b] for b in ids])

    def insert_block_hash(self, key: Key, block_id: int) -> None:
        """Register a full block under ``key`` (vLLM ``_insert_block_hash``)."""
        check_block_key(key, self.num_groups, self.name, "register")
        self._validate([block_id], "register")
        block = self.pool.blocks[block_id]
        current = None if block.block_hash is None else _key_text(block.block_hash)
        if not self.raw and check_key_change(self.name, block_id, current, f"{key[0]}:{key[1]}"):
            return
        compat.insert_block_hash(self.pool, key_to_bytes(key), block)

    def get_cached_block(self, block_hash: str, group_ids: list[int]) -> list[int] | None:
        check_cached_block_query(block_hash, group_ids, self.num_groups, self.name)
        got = self.pool.get_cached_block(hash_to_bytes(block_hash), list(group_ids))
        return None if got is None else [b.block_id for b in got]

    def get_one_block(self, key: Key) -> int | None:
        check_block_key(key, self.num_groups, self.name, "look up", lookup=True)
        got = self.pool.cached_block_hash_to_block.get_one_block(key_to_bytes(key))
        return None if got is None else got.block_id

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached entries (and hashes) of blocks, whatever their ref count."""
        ids = self._validate(block_ids, "evict", allow_null=True)
        self.pool.evict_blocks(set(ids))

    def reset_prefix_cache(self) -> bool:
        return bool(self.pool.reset_prefix_cache())

    def snapshot(self) -> dict[str, Any]:
        return pool_snapshot(self.pool)

    def _validate(self, block_ids: object, what: str, allow_null: bool = False) -> list[int]:
        return check_id_list(block_ids, self.num_blocks, self.name, what, allow_null or self.raw)


class VllmBrokeContract(RuntimeError):
    """vLLM handed back something its own types exclude (a block that is not one of its pool's,
    the null block as a new block). Not a ``KVSpecError``: the harness reports it as a crash of
    vLLM, never as a refusal of kvspec's input."""


def handed_out(blocks: list[Any], num_blocks: int, pool: str, asked: int) -> list[int]:
    """The ids of the blocks vLLM's ``get_new_blocks(asked)`` returned, each a block of the pool
    other than the null block; else ``VllmBrokeContract`` (what vLLM did is kept: it is the
    finding). O(blocks)."""
    ids = [b.block_id for b in blocks]
    bad = [b for b in ids if not 0 < b < num_blocks]
    if bad:
        raise VllmBrokeContract(f"{pool}: vLLM's get_new_blocks({asked}) handed out block id {bad[0]}, "
                                f"not an allocatable block of the pool (1..{num_blocks - 1})")
    return ids


VllmGpuPool = VllmPool


# -- requests --------------------------------------------------------------------------------


@dataclass
class _Mirror:
    """A kvspec request and the vLLM ``Request`` that stands for it."""

    view: RequestView
    request: Any


def _tokens_of(view: RequestView) -> list[int] | None:
    tokens = getattr(view, "all_tokens", None)
    if tokens is None:
        tokens = getattr(view, "tokens", None)
    return list(tokens) if tokens is not None else None


# -- the target ------------------------------------------------------------------------------


class VllmTarget:
    """vLLM 0.33.0's ``SimpleCPUOffloadScheduler`` bound to a vLLM GPU ``BlockPool``."""

    policy_name = "baseline"

    def __init__(self, config: OffloadConfig, vllm: SimpleNamespace, raw: bool = False) -> None:
        self.config = config
        self._v = vllm
        self.raw = raw
        self.num_groups = config.num_groups
        self.block_size = config.block_size
        self.release: compat.Release = getattr(vllm, "release", compat.Release(VLLM_VERSION))
        self._lookup_local: dict[str, int] = {}  # computed tokens at each lookup (2-tuple pins)
        kv_cache_config, page_bytes = self.kv_cache_config_for(vllm, config)
        capacity = compat.cpu_capacity_bytes(self.release, vllm.KVCacheTensor, page_bytes, config.num_groups,
                                             config.num_cpu_blocks)
        self.manager = vllm.SimpleCPUOffloadScheduler(
            compat.vllm_config(config, _MAX_MODEL_LEN), kv_cache_config,
            **compat.manager_kwargs(self.release, config, capacity))
        compat.check_cpu_blocks(self.release, self.manager, config.num_cpu_blocks)
        compat.fill_absent_state(self.manager)
        gpu = vllm.BlockPool(config.num_gpu_blocks, enable_caching=True, hash_block_size=config.block_size)
        self.manager.bind_gpu_block_pool(gpu)
        self.gpu_pool = VllmPool(gpu, "gpu", config.num_groups, raw)
        self.cpu_pool = VllmPool(self.manager.cpu_block_pool, "cpu", config.num_groups, raw)
        self._mirrors: dict[str, _Mirror] = {}

    @staticmethod
    def kv_cache_config_for(v: SimpleNamespace, cfg: OffloadConfig) -> tuple[Any, int]:
        """vLLM's ``KVCacheConfig`` for ``cfg`` (one tensor and one group per configured group), page bytes."""
        tensors, groups = [], []
        page_bytes = 0
        for g, spec in enumerate(cfg.groups):
            common = {"block_size": cfg.block_size, "num_kv_heads": 1, "head_size": 8, "dtype": v.float16}
            if spec.kind == "sliding":
                kv_spec = v.SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
            else:
                kv_spec = v.FullAttentionSpec(**common)
            page = kv_spec.page_size_bytes
            page_bytes = page_bytes or page
            layer = f"layer.{g}"
            tensors.append(compat.kv_cache_tensor(v.KVCacheTensor, page, cfg.num_gpu_blocks, layer))
            groups.append(v.KVCacheGroupSpec([layer], kv_spec))
        return v.KVCacheConfig(num_blocks=cfg.num_gpu_blocks, kv_cache_tensors=tensors,
                               kv_cache_groups=groups), page_bytes

    # -- request mirrors ---------------------------------------------------------------------

    def _prepare(self, request: RequestView | None, what: str) -> Any:
        """Before a manager call: check every view vLLM may read during it (``request``'s and the
        live requests'), then mirror ``request`` and synchronise them all. A view that cannot be
        mirrored is refused before any vLLM object or mirror changes. The vLLM request of
        ``request`` (None without one). O(views + new tokens)."""
        if request is not None:
            check_request(request, what)
            self._check_view(request, what)
        for rid in self._live():
            if rid in self._mirrors:
                self._check_view(self._mirrors[rid].view, what)
        req = None if request is None else self._mirror(request)
        self._sync_known()
        return req

    def _check_view(self, view: RequestView, what: str) -> None:
        """``view`` (a full request view) can be mirrored: no fewer tokens than vLLM already saw,
        and every hash vLLM has not read yet hex text. ``KVSpecError``; changes nothing. O(new
        hashes)."""
        m = self._mirrors.get(view.request_id)
        seen_tokens = 0 if m is None else m.request.num_tokens
        if view.num_tokens < seen_tokens:
            raise InvalidOperationError(
                f"{what}: {name_of(view.request_id)}: {view.num_tokens} tokens, fewer than the {seen_tokens} "
                "vLLM already saw")
        for h in view.block_hashes[0 if m is None else len(m.request.block_hashes):]:
            hash_to_bytes(h)

    def _live(self) -> set[str]:
        """Requests whose state vLLM can read during a manager call."""
        mgr = self.manager
        return set(mgr._reqs_to_store) | set(mgr._reqs_to_load) | set(mgr._abandoned_reqs_to_load)

    def _mirror(self, view: RequestView) -> Any:
        """The vLLM request for ``view`` (created on first sight), synchronised (``view`` checked
        by ``_check_view``)."""
        rid = view.request_id
        m = self._mirrors.get(rid)
        if m is None:
            m = _Mirror(view, None)
            tokens = _tokens_of(view)
            if tokens is None:
                tokens = [0] * view.num_tokens

            def hasher(req: Any, m: _Mirror = m) -> list[bytes]:
                return [hash_to_bytes(h) for h in m.view.block_hashes[len(req.block_hashes):]]

            m.request = self._v.Request(rid, tokens, self._v.SamplingParams(max_tokens=1 << 16), None,
                                        block_hasher=hasher)
            self._mirrors[rid] = m
        m.view = view
        self._sync(m)
        return m.request

    def _sync(self, m: _Mirror) -> None:
        view, req = m.view, m.request
        n = view.num_tokens
        if n > req.num_tokens:
            tokens = _tokens_of(view)
            req.append_output_token_ids(tokens[req.num_tokens:] if tokens is not None else [0] * (n - req.num_tokens))
        req.update_block_hashes()
        req.num_computed_tokens = view.num_computed_tokens
        req.num_output_placeholders = view.num_output_placeholders
        req.skip_reading_prefix_cache = bool(view.skip_reading_prefix_cache)

    def _sync_known(self) -> None:
        """Synchronise every request whose state vLLM can read during the next call."""
        for rid in self._live():
            m = self._mirrors.get(rid)
            if m is not None:
                self._sync(m)

    # -- OffloadTarget: loads ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        check_request(request, "get_num_new_matched_tokens")
        self._count(num_computed_tokens, "num_computed_tokens", request.num_tokens)
        req = self._prepare(request, "get_num_new_matched_tokens")
        self._lookup_local[request.request_id] = num_computed_tokens
        n, is_async = self.manager.get_num_new_matched_tokens(req, num_computed_tokens)
        return int(n or 0), bool(is_async)

    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        rid = check_request(request, "update_state_after_alloc")
        ids = check_block_ids(block_ids, self.num_groups, self.gpu_pool.num_blocks, "update_state_after_alloc",
                              none_groups=False)
        self._count(num_external_tokens, "num_external_tokens", request.num_tokens)
        pending = self.manager._pending_cpu_hits.get(rid)
        if num_external_tokens > 0 and pending is not None and not self.raw:
            self._check_load(rid, ids, pending, num_external_tokens)
        req = self._prepare(request, "update_state_after_alloc")
        blocks = self._v.KVCacheBlocks(tuple([self.gpu_pool.pool.blocks[b] for b in g or ()] for g in ids))
        self.manager.update_state_after_alloc(req, blocks, num_external_tokens)

    def _count(self, value: object, what: str, upper: int) -> None:
        """A count argument: non-negative and at most ``upper`` (raw: any int)."""
        if self.raw:
            check_count_type(value, what)
        else:
            check_count(value, what, upper)

    def _check_load(self, rid: str, ids: BlockIds, pending: Any, ext: int) -> None:
        """The model's rules for accepting ``ext`` tokens of the pinned hit ``pending``
        (``kvspec.contract.checks``): aligned, within the hit, one load per request, and a GPU
        block allocated at every position the load fills."""
        hits, hit_len, local = compat.pending_hit(pending, self._lookup_local.get(rid, 0))
        check_load_acceptance(rid, ext, self.block_size, hit_len, rid in self.manager._reqs_to_load)
        start = local // self.block_size
        for g, group_hits in enumerate(hits):
            for i, cb in enumerate(group_hits[: -(-ext // self.block_size)]):
                if not cb.is_null:
                    check_load_block(rid, g, start + i, ids[g] or ())

    # -- OffloadTarget: planning -------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        out = scheduler_output
        check_scheduler_output(out, self.num_groups, self.gpu_pool.num_blocks)
        self._prepare(None, "build_connector_meta")
        meta = self.manager.build_connector_meta(self._scheduler_output(out))
        return ConnectorMetadata(
            load_event=meta.load_event,
            load_gpu_blocks=list(meta.load_gpu_blocks),
            load_cpu_blocks=list(meta.load_cpu_blocks),
            load_event_to_reqs={e: list(rs) for e, rs in meta.load_event_to_reqs.items()},
            store_event=meta.store_event,
            store_gpu_blocks=list(meta.store_gpu_blocks),
            store_cpu_blocks=list(meta.store_cpu_blocks),
            need_flush=bool(meta.need_flush),
        )

    def _scheduler_output(self, out: SchedulerOutput) -> Any:
        v = self._v

        def groups(ids: tuple[list[int] | None, ...]) -> tuple[list[int] | None, ...]:
            """A block table as vLLM objects hold it (a group may be None, as the input checks allow)."""
            return tuple(None if g is None else list(g) for g in ids)

        new = [
            v.NewRequestData(req_id=nr.req_id, prompt_token_ids=None, mm_features=[], sampling_params=None,
                             pooling_params=None, block_ids=groups(nr.block_ids), num_computed_tokens=0,
                             lora_request=None)
            for nr in out.scheduled_new_reqs
        ]
        cr = out.scheduled_cached_reqs
        cached = v.CachedRequestData(
            req_ids=list(cr.req_ids),
            resumed_req_ids=set(cr.resumed_req_ids),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None if ids is None else groups(ids) for ids in cr.new_block_ids],
            num_computed_tokens=[0] * len(cr.req_ids),
            num_output_tokens=[0] * len(cr.req_ids),
        )
        return v.SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(out.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(out.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(out.finished_req_ids),
            free_encoder_mm_hashes=[],
            preempted_req_ids=set(out.preempted_req_ids),
            **compat.scheduler_output_extra(v.SchedulerOutput, self.num_groups),
        )

    # -- OffloadTarget: worker reports --------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        mgr = self.manager

        def load_sent(rid: str) -> bool | None:
            st = mgr._reqs_to_load.get(rid) or mgr._abandoned_reqs_to_load.get(rid)
            return None if st is None else st.load_event is not None

        check_worker_output(connector_output, load_sent, mgr._store_event_counter, self.config.world_size,
                            rules=not self.raw)
        for e in () if self.raw else connector_output.completed_store_events:
            t = mgr._store_event_to_blocks.get(e)
            check_store_keys(e, t.gpu_block_ids if t is not None else (),
                             lambda g: self.gpu_pool.pool.blocks[g].block_hash)
        self._prepare(None, "update_connector_output")
        mgr.update_connector_output(self._v.KVConnectorOutput(
            finished_recving=set(connector_output.finished_recving),
            kv_connector_worker_meta=self._v.SimpleCPUOffloadWorkerMetadata(
                completed_store_events=dict(connector_output.completed_store_events)),
        ))

    # -- OffloadTarget: finish, reset ---------------------------------------------------------

    def request_finished_all_groups(self, request: RequestView, block_ids: BlockIds) -> tuple[bool, None]:
        check_request(request, "request_finished")
        ids = check_block_ids(block_ids, self.num_groups, self.gpu_pool.num_blocks, "request_finished",
                              none_groups=False)
        req = self._prepare(request, "request_finished")
        done, params = self.manager.request_finished_all_groups(req, tuple(list(g or []) for g in ids))
        assert params is None
        return bool(done), None

    def request_finished(self, request: RequestView) -> tuple[bool, None]:
        """vLLM's single-list ``request_finished`` (no flush); the scheduler never calls it."""
        check_request(request, "request_finished", full=False)
        req = self._prepare(request, "request_finished")
        done, params = self.manager.request_finished(req, [])
        assert params is None
        return bool(done), None

    def reset(self) -> bool:
        if not self.release.has_reset:
            return False  # the release's connector has no reset: refused, nothing changes
        return bool(self.manager.reset())

    def has_pending_stores(self) -> bool:
        return bool(self.manager.has_pending_stores())

    # -- observation -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """vLLM's state in the model's canonical format (``OffloadScheduler.snapshot``)."""
        return {
            "gpu_pool": self.gpu_pool.snapshot(),
            "cpu_pool": pool_snapshot(self.manager.cpu_block_pool),
            "scheduler": self.manager_snapshot(self.manager, self.policy_name, self._lookup_local),
        }

    @staticmethod
    def manager_snapshot(mgr: Any, policy: str, lookup_local: dict[str, int] | None = None) -> dict[str, Any]:
        """A ``SimpleCPUOffloadScheduler``'s state as the canonical scheduler section."""

        def transfer(t: Any) -> Transfer:
            return t.gpu_block_ids, t.cpu_block_ids

        def load(st: Any) -> tuple[Transfer, int | None, bool]:
            return transfer(st.transfer_meta), st.load_event, st.finished

        return scheduler_section(
            policy=policy,
            lazy=mgr._lazy_mode,
            lazy_cursor=None if mgr._cursor is None else mgr._cursor.block_id,
            pending_cpu_hits={r: ([[b.block_id for b in g] for g in blocks], hit_len, local)
                              for r, (blocks, hit_len, local) in compat.pending_hits(mgr, lookup_local or {})},
            reqs_to_load={r: load(st) for r, st in mgr._reqs_to_load.items()},
            abandoned_reqs_to_load={r: load(st) for r, st in mgr._abandoned_reqs_to_load.items()},
            load_event_to_reqs=mgr._load_event_to_reqs,
            store_events={e: transfer(t) for e, t in mgr._store_event_to_blocks.items()},
            abandoned_store_events={e: transfer(t) for e, t in mgr._abandoned_store_event_to_blocks.items()},
            pending_finished_stores=[transfer(t) for t in mgr._pending_finished_stores],
            reqs_to_store={r: (st.block_ids, st.num_stored_blocks, st.store_events, st.finished)
                           for r, st in mgr._reqs_to_store.items()},
            store_event_to_reqs=mgr._store_event_to_reqs,
            in_flight=mgr._in_flight_store_gpu_blocks,
            load_event_counter=mgr._load_event_counter,
            store_event_counter=mgr._store_event_counter,
            store_event_pending_counts=mgr._store_event_pending_counts,
            policy_state={},
        )


# -- factory ---------------------------------------------------------------------------------


def _import_vllm(release: str | None = None) -> SimpleNamespace:
    """vLLM's classes, imported now; ``ConfigError`` when vLLM 0.33.0 (or ``release``) is not importable."""
    if release is not None:
        rel = compat.installed_release(release)
        ns = _import_classes(release)
        ns.release = rel
        return ns
    try:
        version = compat.installed_version()
    except Exception:
        raise ConfigError(
            "the 'vllm' target needs vLLM 0.33.0, which is not installed here; "
            "create its venv with scripts/setup-vllm-venv.sh and run kvspec from .vllm-venv"
        ) from None
    if version != VLLM_VERSION:
        raise ConfigError(f"the 'vllm' target is written against vLLM {VLLM_VERSION}, found {version}")
    return _import_classes(VLLM_VERSION)


def _import_classes(version: str) -> SimpleNamespace:
    try:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
        from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            SlidingWindowSpec,
        )
        from vllm.v1.outputs import KVConnectorOutput as VllmKVConnectorOutput
        from vllm.v1.request import Request
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
    except ImportError as exc:
        raise ConfigError(f"vLLM {version} is installed but cannot be imported: {exc}") from None
    # The manager warns on paths the engine model drives on purpose (a pin dropped by a
    # new lookup, a refused reset); keep the harness output readable.
    for name in ("vllm.v1.simple_kv_offload.manager", "vllm.v1.core.block_pool"):
        logger = logging.getLogger(name)
        if logger.level != logging.ERROR:  # setLevel clears every logger's cache: once is enough
            logger.setLevel(logging.ERROR)
    return SimpleNamespace(
        float16=torch.float16, SamplingParams=SamplingParams, BlockPool=BlockPool, KVCacheBlocks=KVCacheBlocks,
        CachedRequestData=CachedRequestData, NewRequestData=NewRequestData, SchedulerOutput=VllmSchedulerOutput,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
        KVCacheTensor=KVCacheTensor, SlidingWindowSpec=SlidingWindowSpec, KVConnectorOutput=VllmKVConnectorOutput,
        Request=Request, SimpleCPUOffloadScheduler=SimpleCPUOffloadScheduler,
        SimpleCPUOffloadWorkerMetadata=SimpleCPUOffloadWorkerMetadata,
    )


def vllm_available() -> tuple[bool, str]:
    """(True, "") when vLLM 0.33.0 can be imported here, else (False, why)."""
    try:
        _import_vllm()
    except ConfigError as exc:
        return False, str(exc)
    return True, ""


def make_vllm_target(config: OffloadConfig, raw: bool = False) -> VllmTarget:
    """Real vLLM 0.33.0 (``baseline`` only) as an ``OffloadTarget`` for ``config``; ``raw``: the
    model's rules left to vLLM (``VllmTarget``)."""
    config.validate()
    if config.policy != "baseline":
        raise ConfigError(
            f"vLLM {VLLM_VERSION} implements only the 'baseline' policy, not {config.policy!r}"
        )
    vllm = _import_vllm()
    _refuse_patched("vllm")
    return VllmTarget(config, vllm, raw)


def make_raw_vllm_target(config: OffloadConfig) -> VllmTarget:
    """Target ``raw:vllm``: vLLM 0.33.0 with the model's rules left to vLLM."""
    return make_vllm_target(config, raw=True)


def _refuse_patched(target: str) -> None:
    """``ConfigError`` when the running vLLM carries one of kvspec's patches (its modules name it in
    ``CPU_EVICTION_RESTORE``): a plain vLLM target must judge vLLM's own code, not a patched copy."""
    from vllm.v1.core import block_pool
    from vllm.v1.simple_kv_offload import manager

    patch = getattr(manager, "CPU_EVICTION_RESTORE", None) or getattr(block_pool, "CPU_EVICTION_RESTORE", None)
    if patch is not None:
        raise ConfigError(f"the {target!r} target judges unpatched vLLM, but this Python runs vLLM patched with "
                          f"{patch!r}; use the 'vllm+{patch}' target here, or run kvspec from .vllm-venv")


def release_factory(version: str, raw: bool = False) -> Callable[[OffloadConfig], VllmTarget]:
    """The factory of target ``vllm@VERSION`` (``raw:vllm@VERSION`` with ``raw``). Building a target in a process
    whose vLLM is another release is a ``ConfigError`` naming the venv to use."""
    compat.parse_release(version)

    def make(config: OffloadConfig) -> VllmTarget:
        config.validate()
        if config.policy != "baseline":
            raise ConfigError(f"vLLM {version} implements only the 'baseline' policy, not {config.policy!r}")
        vllm = _import_vllm(version)
        _refuse_patched(f"vllm@{version}")
        return VllmTarget(config, vllm, raw)

    return make


# -- the oracle of vLLM 0.33.0 ------------------------------------------------------------------


def baseline_oracle(config: OffloadConfig) -> tuple[str, ...]:
    """The invariants vLLM 0.33.0 (the ``baseline`` policy) claims, plus completeness C1: the oracle
    that finds the stale-cursor FIXME in real vLLM with no model alongside
    (``kvspec.drivers.harness.fuzz_with_invariants``)."""
    from kvspec.model.baseline import BaselinePolicy

    return (*BaselinePolicy.claims(config), "C1")
