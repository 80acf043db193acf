"""The second manager's contract: vLLM's ``OffloadingManager`` (``vllm/v1/kv_offload``).

vLLM 0.33.0 has two CPU offload paths. The first, ``SimpleCPUOffloadScheduler``, is
``OffloadTarget`` (``kvspec.contract.types``). The second, the ``OffloadingConnector``, keeps
its CPU cache in an ``OffloadingManager``: a key-value store of *chunks* (one per offloaded
block and KV group) with no cursor. The connector asks it, per request, which keys are
cached (``lookup``), pins the keys it loads (``prepare_load`` / ``complete_load``), marks
keys used (``touch``), allocates chunks for keys it stores (``prepare_store``, evicting
others when the pool is full) and marks them readable when the copy is done
(``complete_store``). ``OffloadingManagerTarget`` is that interface with vLLM's method names;
the model (``kvspec.model.offloading``), the implementation (``kvspec.impl.offloading``),
the known-bug variants and vLLM's own ``CPUOffloadingManager`` (through
``kvspec.adapters.vllm_offloading``) implement it, and one driver
(``kvspec.drivers.offloading``) runs any of them.

Differences from vLLM's signatures, all representational: a key is ``(block hash, group)``
(vLLM packs the same two into bytes: ``key_bytes`` gives vLLM's packing, which decides ties
in LRU order); a request context is named by its request id and carries the end-token
position of each key, which the caller declares with ``set_key_positions`` (vLLM's
``ReqContext.set_offload_key_position``); ``prepare_load`` returns the CPU chunk ids (vLLM's
``CPULoadStoreSpec.block_ids``); ``lookup`` returns vLLM's ``LookupResult`` member name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvspec.contract.errors import ConfigError

OffloadKey = tuple[str, int]  # (block hash, KV group index)

POLICIES = ("lru", "arc")
LOOKUP_RESULTS = ("MISS", "HIT", "HIT_PENDING")


def key_bytes(key: OffloadKey) -> bytes:
    """vLLM's ``make_offload_key``: the hash's bytes then the group as 4 big-endian bytes.

    LRU breaks ties between equal ranks by comparing these bytes (its heap entries are
    ``(rank, key)``), so every target orders keys by them."""
    return key[0].encode() + key[1].to_bytes(4, "big", signed=False)


def key_text(key: OffloadKey) -> str:
    """A key as snapshots and traces write it: ``hash:group``."""
    return f"{key[0]}:{key[1]}"


def parse_key(text: str) -> OffloadKey:
    """The inverse of ``key_text``; ``ConfigError`` naming the text when it is not one."""
    h, sep, g = text.rpartition(":")
    if not sep or not h or not g.isdigit():
        raise ConfigError(f"not an offload key (hash:group): {text[:40]!r}")
    return h, int(g)


@dataclass(frozen=True)
class OffloadingConfig:
    """``CPUOffloadingManager(num_chunks, cache_policy, store_threshold, max_tracker_size)``.

    ``store_threshold`` >= 2 admits a key for storing only once it has been offered that many
    times (vLLM tracks offers in an LRU-bounded counter of ``max_tracker_size`` keys)."""

    num_chunks: int = 8
    policy: str = "lru"
    store_threshold: int = 1
    max_tracker_size: int = 64_000

    def validate(self) -> None:
        for name in ("num_chunks", "store_threshold", "max_tracker_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"offloading config: {name} must be an int >= 1, got {value!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"offloading config: policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")

    def to_json(self) -> dict[str, Any]:
        return {"num_chunks": self.num_chunks, "policy": self.policy, "store_threshold": self.store_threshold,
                "max_tracker_size": self.max_tracker_size}

    @staticmethod
    def from_json(data: object) -> OffloadingConfig:
        """A config from its JSON form; ``ConfigError`` naming the field that is wrong."""
        if not isinstance(data, dict):
            raise ConfigError("offloading config: expected an object")
        known = {"num_chunks", "policy", "store_threshold", "max_tracker_size"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"offloading config: unknown field {unknown[0]!r}")
        cfg = OffloadingConfig(**data)
        cfg.validate()
        return cfg


@dataclass(frozen=True)
class PrepareStoreOutput:
    """vLLM ``PrepareStoreOutput``: the keys to copy, their chunk ids (the store spec), the
    keys evicted to make room."""

    keys_to_store: list[OffloadKey]
    chunk_ids: list[int]
    evicted_keys: list[OffloadKey]


@runtime_checkable
class OffloadingManagerTarget(Protocol):
    """vLLM's ``OffloadingManager`` as the CPU manager implements it (``cpu/manager.py``).

    Every call names its request; a request's context lives from ``on_new_request`` until
    ``on_request_finished`` (vLLM keeps a finished request's context until its transfers
    complete, so ``complete_load`` and ``complete_store`` may name a finished request).
    Calls that vLLM's connector never makes (a key loaded that is not ready, a load completed
    twice, a request unknown) are refused with a ``KVSpecError`` and change nothing.
    """

    @property
    def config(self) -> OffloadingConfig: ...

    def on_new_request(self, req_id: str) -> None: ...
    def set_key_positions(self, req_id: str, positions: Sequence[tuple[OffloadKey, int]]) -> None: ...
    def lookup(self, req_id: str, key: OffloadKey) -> str: ...
    def prepare_load(self, req_id: str, keys: Sequence[OffloadKey]) -> list[int]: ...
    def touch(self, req_id: str, keys: Sequence[OffloadKey]) -> None: ...
    def complete_load(self, req_id: str, keys: Sequence[OffloadKey]) -> None: ...
    def prepare_store(self, req_id: str, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None: ...
    def complete_store(self, req_id: str, keys: Sequence[OffloadKey], success: bool = True) -> None: ...
    def on_request_finished(self, req_id: str) -> None: ...
    def reset_cache(self) -> None: ...
    def snapshot(self) -> dict[str, Any]:
        """The manager's state in the canonical form (``manager: offloading``; SPEC.md §9)."""
        ...


OffloadingFactory = Callable[[OffloadingConfig], OffloadingManagerTarget]
