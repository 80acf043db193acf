"""Real vLLM's ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``) as a target of
the second manager's contract (``OffloadingManagerTarget``): target ``vllm-offloading``.

vLLM's own manager and its own LRU or ARC policy are built as vLLM's connector builds them
(``CPUOffloadingManager(num_chunks, cache_policy, store_threshold=..., max_tracker_size=...)``);
nothing of vLLM is replaced. The adapter only translates:

* keys: kvspec's ``(hash, group)`` is packed with vLLM's own ``make_offload_key`` (the hash's
  UTF-8 bytes, the group as 4 big-endian bytes) and unpacked again for snapshots;
* requests: one ``vllm.v1.kv_offload.base.ReqContext`` per request id, kept here as vLLM's
  connector keeps one per request; key positions go to ``set_offload_key_position``;
* outputs: ``CPULoadStoreSpec.block_ids`` become lists of chunk ids.

Inputs go through the contract's checks (``kvspec.contract.offloading_checks``) before the
call reaches vLLM, reading vLLM's own chunk states for the checks that depend on them, so a
refused call changes nothing in vLLM. ``snapshot()`` reads vLLM's objects (chunks, free
list, counters, the policy's ranks or lists, each request's access record) into the canonical
format; nothing in it comes from kvspec's model.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from kvspec.contract.errors import ConfigError
from kvspec.contract.offloading import OffloadingConfig, OffloadKey, PrepareStoreOutput, key_bytes, key_text
from kvspec.contract.offloading_checks import (
    check_keys,
    check_loadable,
    check_loading,
    check_new_request,
    check_positions,
    check_success,
    known_request,
)

VLLM_VERSION = "0.33.0"


def _import_vllm(release: str | None) -> SimpleNamespace:
    """vLLM's classes; ``ConfigError`` saying how to get them when they are not importable."""
    want = release or VLLM_VERSION
    name = "vllm-offloading" + (f"@{release}" if release else "")
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        where = f".vllm-venvs/{release} (scripts/setup-vllm-release.sh {release})" if release else \
            ".vllm-venv (scripts/setup-vllm-venv.sh)"
        raise ConfigError(f"target {name!r} needs vLLM {want} in this Python: run it from {where}") from None
    if version != want:
        raise ConfigError(f"target {name!r} needs vLLM {want}, found {version}")
    try:
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.cpu import manager
        from vllm.v1.kv_offload.cpu.policies import arc, lru
    except Exception as exc:  # vLLM's import chain can fail in many ways on a bare machine
        raise ConfigError(f"vLLM {version} is installed but its kv_offload module cannot be imported: {exc}") from None
    return SimpleNamespace(base=base, manager=manager, lru=lru, arc=arc)


def _unpack(raw: bytes) -> OffloadKey:
    return raw[:-4].decode(), int.from_bytes(raw[-4:], "big", signed=False)


class VllmOffloadingTarget:
    """vLLM's ``CPUOffloadingManager`` behind ``OffloadingManagerTarget``."""

    def __init__(self, config: OffloadingConfig, release: str | None = None) -> None:
        config.validate()
        self._config = config
        self._v = _import_vllm(release)
        self.manager = self._v.manager.CPUOffloadingManager(
            config.num_chunks, cache_policy=config.policy, store_threshold=config.store_threshold,
            max_tracker_size=config.max_tracker_size)
        self._contexts: dict[str, Any] = {}
        self._closed: set[str] = set()

    @property
    def config(self) -> OffloadingConfig:
        return self._config

    def _key(self, key: OffloadKey) -> bytes:
        packed: bytes = self._v.base.make_offload_key(key[0].encode(), key[1])
        assert packed == key_bytes(key)
        return packed

    def _keys(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        return [self._key(k) for k in keys]

    def _ctx(self, req_id: str, submit: bool) -> Any:
        return known_request(req_id, self._contexts, submit, lambda _ctx: req_id in self._closed)

    def _ref_cnt(self, key: OffloadKey) -> int | None:
        chunk = self.manager._policy.get(self._key(key))
        return None if chunk is None else int(chunk.ref_cnt)

    # -- the contract -------------------------------------------------------------------------

    def on_new_request(self, req_id: str) -> None:
        check_new_request(req_id, self._contexts)
        ctx = self._v.base.ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        self._contexts[req_id] = ctx

    def set_key_positions(self, req_id: str, positions: Sequence[tuple[OffloadKey, int]]) -> None:
        ctx = self._ctx(req_id, submit=True)
        check_positions(positions)
        if not hasattr(ctx, "set_offload_key_position"):  # releases whose contexts carry no positions
            return
        for key, position in positions:
            ctx.set_offload_key_position(self._key(key), position)

    def lookup(self, req_id: str, key: OffloadKey) -> str:
        ctx = self._ctx(req_id, submit=True)
        check_keys([key])
        result = self.manager.lookup(self._key(key), ctx)
        if isinstance(result, bool) or result is None:  # releases before 0.29: True, None (pending), False
            return {True: "HIT", None: "HIT_PENDING", False: "MISS"}[result]
        return str(result.name)

    def prepare_load(self, req_id: str, keys: Sequence[OffloadKey]) -> list[int]:
        ctx = self._ctx(req_id, submit=True)
        check_keys(keys)
        check_loadable(keys, self._ref_cnt)
        spec = self.manager.prepare_load(self._keys(keys), ctx)
        return [int(b) for b in spec.block_ids]

    def touch(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        ctx = self._ctx(req_id, submit=True)
        check_keys(keys)
        self.manager.touch(self._keys(keys), ctx)

    def complete_load(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        ctx = self._ctx(req_id, submit=False)
        check_keys(keys)
        check_loading(keys, self._ref_cnt)
        self.manager.complete_load(self._keys(keys), ctx)

    def prepare_store(self, req_id: str, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        ctx = self._ctx(req_id, submit=True)
        check_keys(keys)
        out = self.manager.prepare_store(self._keys(keys), ctx)
        if out is None:
            return None
        return PrepareStoreOutput([_unpack(k) for k in out.keys_to_store],
                                  [int(b) for b in out.store_spec.block_ids],
                                  [_unpack(k) for k in out.evicted_keys])

    def complete_store(self, req_id: str, keys: Sequence[OffloadKey], success: bool = True) -> None:
        ctx = self._ctx(req_id, submit=False)
        check_keys(keys)
        check_success(success)
        self.manager.complete_store(self._keys(keys), ctx, success=success)

    def on_request_finished(self, req_id: str) -> None:
        ctx = self._ctx(req_id, submit=False)
        self._closed.add(req_id)
        self.manager.on_request_finished(ctx)

    def reset_cache(self) -> None:
        self.manager.reset_cache()

    # -- observation --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """vLLM's state in the canonical format. Releases name the same state differently
        (``blocks``/``chunks``, ``block_id``/``chunk_id``) or lack parts of it (counters, ranks,
        request records before 0.31): what a release does not have is null, and the invariants
        that read it skip it."""
        m = self.manager
        policy = m._policy
        if self._config.policy == "lru":
            resident = dict(_attr(policy, "chunks", "blocks"))
            policy_state = self._lru_state(policy, resident)
        else:
            resident = {**policy.t1, **policy.t2}
            policy_state = {name: [key_text(_unpack(k)) for k in getattr(policy, name)]
                            for name in ("t1", "t2", "b1", "b2")}
            policy_state["target_t1_size"] = float(policy.target_t1_size)
        evictable = _attr(m, "_num_evictable_cache_chunks", "_num_evictable_cache_blocks", default=None)
        pending = _attr(m, "_num_write_pending_chunks", "_num_write_pending_blocks", default=None)
        return {
            "manager": "offloading",
            "config": self._config.to_json(),
            "chunks": {key_text(k): {"chunk": int(_attr(c, "chunk_id", "block_id")), "ref_cnt": int(c.ref_cnt)}
                       for k, c in sorted((_unpack(k), c) for k, c in resident.items())},
            "free_list": [int(c) for c in m._free_list],
            "num_allocated": int(_attr(m, "_num_allocated_chunks", "_num_allocated_blocks")),
            "counters": None if evictable is None or pending is None else
            {"evictable": int(evictable), "write_pending": int(pending)},
            "policy": {self._config.policy: policy_state},
            "offers": None if m.counts is None else [[key_text(_unpack(k)), int(n)] for k, n in m.counts.items()],
            "requests": self._requests(),
        }

    def _lru_state(self, policy: Any, resident: dict[bytes, Any]) -> dict[str, Any]:
        ranks = getattr(policy, "_ranks", None)
        if ranks is not None:  # 0.31 on: ranks (an int, or a pair from 0.33), the heap's order
            order = sorted(policy._evictable, key=lambda k: (ranks[k], k))
            return {"order": [key_text(_unpack(k)) for k in order],
                    "ranks": {key_text(k): list(r) if isinstance(r, tuple) else [int(r), 0]
                              for k, r in sorted((_unpack(k), r) for k, r in ranks.items())},
                    "next_rank": int(policy._next_rank)}
        listed = getattr(policy, "evictable_blocks", None)  # 0.29: an ordered evictable list
        keys = list(listed) if listed is not None else [k for k, c in resident.items() if c.ref_cnt == 0]
        return {"order": [key_text(_unpack(k)) for k in keys], "ranks": None, "next_rank": None}

    def _requests(self) -> dict[str, Any]:
        access_cls = getattr(self._v.manager, "_RequestCacheAccess", None)
        m = self.manager
        requests: dict[str, Any] = {}
        for rid, ctx in sorted(self._contexts.items()):
            rec = None if access_cls is None else ctx.get_state(access_cls)
            if rec is None or rec.owner is not m or rec.cache_generation != m._cache_generation:
                requests[rid] = None
                continue
            requests[rid] = {
                "finished": bool(rec.finished),
                **{name: sorted(key_text(_unpack(k)) for k in getattr(rec, attr)) for name, attr in
                   (("seen", "seen_keys"), ("inserted", "inserted_keys"), ("reused", "reused_keys"),
                    ("store_misses", "store_miss_keys"))}}
        return requests


_MISSING = object()


def _attr(obj: Any, *names: str, default: Any = _MISSING) -> Any:
    """The first of ``names`` that ``obj`` has (releases rename fields); ``default`` if none."""
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    if default is _MISSING:
        raise ConfigError(f"this vLLM's {type(obj).__name__} has none of {', '.join(names)}: "
                          "kvspec's adapter does not know this release")
    return default


def make_vllm_offloading_target(config: OffloadingConfig) -> VllmOffloadingTarget:
    return VllmOffloadingTarget(config)


def release_factory(release: str) -> Callable[[OffloadingConfig], VllmOffloadingTarget]:
    """The factory of ``vllm-offloading@RELEASE``: that release's own manager, in its venv."""
    return lambda config: VllmOffloadingTarget(config, release)
