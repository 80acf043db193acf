"""The shared contract: vLLM-shaped inputs and outputs, the target Protocol, input checks.

Everything a target (the model, the implementation, a policy, a bug variant, real
vLLM behind an adapter, an engine author's own code) must offer lives here, once.
The dataclasses are small stand-ins for vLLM's objects with vLLM's field names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from kvspec.errors import (
    ConfigError,
    DoubleFreeError,
    GroupCountError,
    InvalidBlockError,
    InvalidCountError,
    InvalidOperationError,
    UnknownEventError,
    UnknownRequestError,
)

POLICIES = ("baseline", "signal-rescan", "repair")


# -- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: full attention, or sliding window of ``sliding_window`` tokens."""

    kind: Literal["full", "sliding"] = "full"
    sliding_window: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "sliding_window": self.sliding_window}


@dataclass(frozen=True)
class OffloadConfig:
    """The modelled configuration (one scheduler block size for every group).

    ``block_size`` is vLLM's scheduler block size, equal to ``hash_block_size`` and to
    every group's block size. ``num_cpu_blocks`` counts the CPU null block, as vLLM's
    explicit ``num_cpu_blocks`` does ("5 total = 4 usable").
    """

    block_size: int = 16
    num_gpu_blocks: int = 16
    num_cpu_blocks: int = 5
    groups: tuple[KVGroup, ...] = (KVGroup(),)
    world_size: int = 1
    lazy_offload: bool = False
    max_num_batched_tokens: int = 64
    policy: str = "repair"

    def validate(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks < 2 or self.num_cpu_blocks < 2:
            raise ConfigError("each pool needs at least 2 blocks (one is the null block)")
        if not self.groups or all(g.kind != "full" for g in self.groups):
            raise ConfigError("the offload manager needs a full-attention group (vLLM asserts one)")
        for g in self.groups:
            if g.kind not in ("full", "sliding"):
                raise ConfigError(f"unknown group kind {g.kind!r}")
            if g.kind == "sliding" and g.sliding_window < 1:
                raise ConfigError("a sliding-window group needs sliding_window >= 1")
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.lazy_offload and self.policy != "baseline":
            raise ConfigError("lazy offload has no per-request store state: use policy 'baseline'")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def lazy_target_free(self) -> int:
        """vLLM §7.1: blocks the lazy walk may look at, summed over groups, doubled."""
        if not self.lazy_offload:
            return 0
        total = 0
        for g in self.groups:
            if g.kind == "sliding":
                total += -(-g.sliding_window // self.block_size) + 1
            else:
                total += -(-self.max_num_batched_tokens // self.block_size)
        return int(total * 2.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": self.num_cpu_blocks,
            "groups": [g.to_json() for g in self.groups],
            "world_size": self.world_size,
            "lazy_offload": self.lazy_offload,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "policy": self.policy,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> OffloadConfig:
        groups = tuple(KVGroup(g["kind"], int(g.get("sliding_window", 0))) for g in d.get("groups", []))
        cfg = OffloadConfig(
            block_size=int(d["block_size"]),
            num_gpu_blocks=int(d["num_gpu_blocks"]),
            num_cpu_blocks=int(d["num_cpu_blocks"]),
            groups=groups or (KVGroup(),),
            world_size=int(d.get("world_size", 1)),
            lazy_offload=bool(d.get("lazy_offload", False)),
            max_num_batched_tokens=int(d.get("max_num_batched_tokens", 64)),
            policy=str(d.get("policy", "repair")),
        )
        cfg.validate()
        return cfg


# -- vLLM-shaped inputs ----------------------------------------------------------------------


class RequestView(Protocol):
    """What the offload manager reads of a ``vllm.v1.request.Request``."""

    request_id: str
    block_hashes: list[str]
    num_computed_tokens: int
    num_output_placeholders: int
    skip_reading_prefix_cache: bool

    @property
    def num_tokens(self) -> int: ...


BlockIds = tuple[list[int], ...]  # one list of GPU block ids per KV group


@dataclass
class NewRequestData:
    req_id: str
    block_ids: BlockIds


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)


def yield_req_data(out: SchedulerOutput) -> Iterator[tuple[str, BlockIds | None, bool]]:
    """vLLM ``yield_req_data``: (req_id, block ids or None, is_full_table), new requests first."""
    for nr in out.scheduled_new_reqs:
        yield nr.req_id, nr.block_ids, True
    cr = out.scheduled_cached_reqs
    for rid, ids in zip(cr.req_ids, cr.new_block_ids, strict=True):
        yield rid, ids, rid in cr.resumed_req_ids


@dataclass
class KVConnectorOutput:
    """Worker reports: load completions by request, store completions by event (counts summed over ranks)."""

    finished_recving: set[str] = field(default_factory=set)
    completed_store_events: dict[int, int] = field(default_factory=dict)


@dataclass
class ConnectorMetadata:
    """vLLM ``SimpleCPUOffloadMetadata``: what the workers are told to copy this step."""

    load_event: int = -1
    load_gpu_blocks: list[int] = field(default_factory=list)
    load_cpu_blocks: list[int] = field(default_factory=list)
    load_event_to_reqs: dict[int, list[str]] = field(default_factory=dict)
    store_event: int = -1
    store_gpu_blocks: list[int] = field(default_factory=list)
    store_cpu_blocks: list[int] = field(default_factory=list)
    need_flush: bool = False


# -- the target Protocol ---------------------------------------------------------------------


@runtime_checkable
class GpuPool(Protocol):
    """The GPU ``BlockPool`` operations the engine model uses (ids, not block objects)."""

    num_blocks: int

    def get_num_free_blocks(self) -> int: ...
    def get_new_blocks(self, n: int) -> list[int]: ...
    def touch(self, block_ids: Sequence[int]) -> None: ...
    def free_blocks(self, block_ids: Sequence[int]) -> None: ...
    def insert_block_hash(self, key: tuple[str, int], block_id: int) -> None: ...
    def get_cached_block(self, block_hash: str, group_ids: list[int]) -> list[int] | None: ...
    def reset_prefix_cache(self) -> bool: ...


@runtime_checkable
class OffloadTarget(Protocol):
    """A scheduler-side CPU offload manager bound to a GPU pool, vLLM's method names.

    The model, the implementation, every policy and bug variant, and real vLLM (through
    ``kvspec.vllm_adapter``) implement it; the engine model drives any of them.
    """

    config: OffloadConfig
    gpu_pool: GpuPool

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]: ...
    def update_state_after_alloc(self, request: RequestView, block_ids: BlockIds, num_external_tokens: int) -> None: ...
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata: ...
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None: ...
    def request_finished_all_groups(self, request: RequestView, block_ids: BlockIds) -> tuple[bool, None]: ...
    def reset(self) -> bool: ...
    def has_pending_stores(self) -> bool: ...
    def snapshot(self) -> dict[str, Any]:
        """Pools and scheduler state in the canonical format (``kvspec.model.snapshot``)."""
        ...


# -- input checks shared by every target -----------------------------------------------------


def check_block_ids(block_ids: object, num_groups: int, num_blocks: int, what: str, *,
                    none_groups: bool = True) -> BlockIds:
    """Per-group GPU block ids: the right number of groups, every id in range. O(ids).

    ``none_groups``: a group may be None (a scheduler output's "no new ids"); full tables
    (``update_state_after_alloc``, ``request_finished_all_groups``) pass False.
    """
    if not isinstance(block_ids, (tuple, list)) or len(block_ids) != num_groups:
        got = len(block_ids) if isinstance(block_ids, (tuple, list)) else type(block_ids).__name__
        raise GroupCountError(f"{what}: expected block ids for {num_groups} group(s), got {got}")
    for g, ids in enumerate(block_ids):
        if ids is None:
            if not none_groups:
                raise GroupCountError(f"{what}: group {g} has no block ids (None)")
            continue
        for b in ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks:
                raise InvalidBlockError(f"{what}: group {g} block id {b!r} out of range 0..{num_blocks - 1}")
    return tuple(block_ids)


def check_count(value: object, what: str, upper: int | None = None) -> int:
    """A non-negative int, at most ``upper`` when given."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidCountError(f"{what} must be a non-negative int, got {value!r}")
    if upper is not None and value > upper:
        raise InvalidCountError(f"{what} = {value} exceeds {upper}")
    return value


def check_pool_ids(ids: Sequence[object], num_blocks: int, pool: str, what: str, allow_null: bool = False) -> None:
    """Block ids for a pool operation: ints in ``0..num_blocks-1``; the null block 0 only when
    ``allow_null`` (vLLM skips it in touch/free; every caller in the modelled system filters it)."""
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks:
            raise InvalidBlockError(f"{pool}: cannot {what} block {b!r}: ids are 0..{num_blocks - 1}")
        if b == 0 and not allow_null:
            raise InvalidBlockError(f"{pool}: cannot {what} the null block 0")


def check_free_counts(ids: Sequence[int], ref_cnt: Callable[[int], int], pool: str) -> None:
    """No block freed more often than it is referenced (vLLM would leave a negative ref count)."""
    for b, times in Counter(ids).items():
        ref = ref_cnt(b)
        if times > ref:
            raise DoubleFreeError(f"{pool}: block {b} freed {times} time(s) with ref count {ref}")


def check_connector_output(out: KVConnectorOutput, load_sent: Callable[[str], bool | None],
                           store_event_counter: int, world_size: int) -> None:
    """Worker reports: each ``finished_recving`` names a request whose load was sent
    (``load_sent`` returns None when it has no load); each store event was issued and
    its count is 1..world_size."""
    for rid in out.finished_recving:
        sent = load_sent(rid)
        if sent is None:
            raise UnknownRequestError(f"finished_recving names {rid!r}, which has no load")
        if not sent:
            raise InvalidOperationError(f"finished_recving names {rid!r}, whose load was never sent")
    for e, c in out.completed_store_events.items():
        if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < store_event_counter:
            raise UnknownEventError(f"store event {e!r} was never issued")
        check_count(c, f"worker count for store event {e}", world_size)
        if c == 0:
            raise InvalidOperationError(f"worker count for store event {e} is 0")
