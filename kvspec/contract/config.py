"""The configuration every target is built from: ``OffloadConfig`` and its KV-cache groups.

Checked when constructed (``__post_init__``) and when read from JSON (``from_json``, strict:
unknown keys, wrong types and out-of-range values are ``ConfigError``s naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvspec.contract.errors import ConfigError, echo
from kvspec.contract.policy import POLICY_REGISTRY

POLICIES = tuple(POLICY_REGISTRY)  # the policy names, in the registry's order

# -- configuration ---------------------------------------------------------------------------

GROUP_KINDS = ("full", "sliding")
MAX_POOL_BLOCKS = 1 << 22  # each pool, null block included (the benchmarks use ~1.1 million CPU blocks)
MAX_BLOCK_SIZE = 1 << 12
MAX_WORLD_SIZE = 64
MAX_BATCHED_TOKENS = 1 << 20
MAX_GROUPS = 8
MAX_SLIDING_WINDOW = 1 << 20
MAX_SPECULATIVE_TOKENS = 8
CONFIG_KEYS = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "groups", "world_size", "lazy_offload",
               "max_num_batched_tokens", "policy", "async_scheduling", "num_speculative_tokens")
_REQUIRED_KEYS = ("block_size", "num_gpu_blocks", "num_cpu_blocks")
_GROUP_KEYS = ("kind", "sliding_window")


def _check_int(value: object, what: str, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{what}: expected an integer, got {echo(value)}")
    if value < lo:
        raise ConfigError(f"{what} must be >= {lo}, got {echo(value)}")
    if value > hi:
        raise ConfigError(f"{what} = {echo(value)} is outside {lo}..{hi}")


def _check_group(kind: object, sliding_window: object, where: str) -> None:
    if not isinstance(kind, str) or kind not in GROUP_KINDS:
        raise ConfigError(f"{where}kind: unknown group kind {echo(kind)}; known: {', '.join(GROUP_KINDS)}")
    if kind == "sliding" and isinstance(sliding_window, int) and not isinstance(sliding_window, bool) \
            and sliding_window < 1:
        raise ConfigError(f"{where}sliding_window = {echo(sliding_window)}: a sliding-window group needs "
                          "sliding_window >= 1")
    _check_int(sliding_window, f"{where}sliding_window", 0, MAX_SLIDING_WINDOW)  # a full group ignores it


def _check_config(block_size: object, num_gpu_blocks: object, num_cpu_blocks: object, groups: object,
                  world_size: object, lazy_offload: object, max_num_batched_tokens: object, policy: object,
                  async_scheduling: object, num_speculative_tokens: object, where: str) -> None:
    """Every field of an :class:`OffloadConfig`; ``where`` prefixes the field names
    (``"config."`` for a file). Raises ``ConfigError`` naming the first bad field."""
    _check_int(block_size, f"{where}block_size", 1, MAX_BLOCK_SIZE)
    for name, n in (("num_gpu_blocks", num_gpu_blocks), ("num_cpu_blocks", num_cpu_blocks)):
        if isinstance(n, int) and not isinstance(n, bool) and n < 2:
            raise ConfigError(f"{where}{name} = {echo(n)}: each pool needs at least 2 blocks "
                              "(one is the null block)")
        _check_int(n, f"{where}{name}", 2, MAX_POOL_BLOCKS)
    if not isinstance(groups, tuple):
        raise ConfigError(f"{where}groups: expected a tuple of KVGroup, got {echo(groups)}")
    if len(groups) > MAX_GROUPS:
        raise ConfigError(f"{where}groups: {len(groups)} groups, more than {MAX_GROUPS}")
    for i, g in enumerate(groups):
        if not isinstance(g, KVGroup):
            raise ConfigError(f"{where}groups[{i}]: expected a KVGroup, got {echo(g)}")
        _check_group(g.kind, g.sliding_window, f"{where}groups[{i}].")
    if not any(g.kind == "full" for g in groups):
        raise ConfigError(f"{where}groups: the offload manager needs a full-attention group (vLLM asserts one)")
    _check_int(world_size, f"{where}world_size", 1, MAX_WORLD_SIZE)
    if not isinstance(lazy_offload, bool):
        raise ConfigError(f"{where}lazy_offload: expected true or false, got {echo(lazy_offload)}")
    _check_int(max_num_batched_tokens, f"{where}max_num_batched_tokens", 1, MAX_BATCHED_TOKENS)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(f"{where}policy: unknown policy {echo(policy)}; known: {', '.join(POLICIES)}")
    if not isinstance(async_scheduling, bool):
        raise ConfigError(f"{where}async_scheduling: expected true or false, got {echo(async_scheduling)}")
    _check_int(num_speculative_tokens, f"{where}num_speculative_tokens", 0, MAX_SPECULATIVE_TOKENS)
    if lazy_offload and policy != "baseline":
        raise ConfigError(f"{where}lazy_offload: lazy offload has no per-request store state: "
                          "use policy 'baseline'")


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: full attention, or sliding window of ``sliding_window`` tokens.

    Checked when constructed: ``kind`` is ``"full"`` or ``"sliding"``, ``sliding_window`` an int
    in 0..MAX_SLIDING_WINDOW (at least 1 for a sliding group); else ``ConfigError``."""

    kind: Literal["full", "sliding"] = "full"
    sliding_window: int = 0

    def __post_init__(self) -> None:
        _check_group(self.kind, self.sliding_window, "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "sliding_window": self.sliding_window}


@dataclass(frozen=True)
class OffloadConfig:
    """The modelled configuration (one scheduler block size for every group).

    ``block_size`` is vLLM's scheduler block size, equal to ``hash_block_size`` and to
    every group's block size. ``num_cpu_blocks`` counts the CPU null block, as vLLM's
    explicit ``num_cpu_blocks`` does ("5 total = 4 usable").

    Checked when constructed (``validate``): every integer a real ``int`` (not a bool, not a
    float) within its bound, ``groups`` a tuple of at most MAX_GROUPS ``KVGroup`` with a
    full-attention group, ``lazy_offload`` a bool, ``policy`` a known name; else ``ConfigError``
    naming the field.

    ``async_scheduling`` is how the engine schedules (vLLM's ``scheduler_config.async_scheduling``):
    vLLM 0.33.0 resolves it to True for generative models, so that is the default; False is
    vLLM's synchronous ``Scheduler``. It is the engine's, not the target's: every target runs
    under either.

    ``num_speculative_tokens`` is vLLM's n-gram speculative decoding (``SpeculativeConfig(method=
    "ngram")``): each decode step verifies up to that many draft tokens, rejected drafts lower the
    computed tokens again. 0 (the default): no speculative decoding. Also the engine's.
    """

    block_size: int = 16
    num_gpu_blocks: int = 16
    num_cpu_blocks: int = 5
    groups: tuple[KVGroup, ...] = (KVGroup(),)
    world_size: int = 1
    lazy_offload: bool = False
    max_num_batched_tokens: int = 64
    policy: str = "repair"
    async_scheduling: bool = True
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad field (run by the constructor)."""
        _check_config(self.block_size, self.num_gpu_blocks, self.num_cpu_blocks, self.groups, self.world_size,
                      self.lazy_offload, self.max_num_batched_tokens, self.policy, self.async_scheduling,
                      self.num_speculative_tokens, "")

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
            "async_scheduling": self.async_scheduling,
            "num_speculative_tokens": self.num_speculative_tokens,
        }

    @staticmethod
    def from_json(d: object, where: str = "config") -> OffloadConfig:
        """The inverse of ``to_json``, strict: no coercion (``"false"`` is not a bool, ``32.5`` not
        an integer), unknown keys refused; ``block_size``, ``num_gpu_blocks`` and ``num_cpu_blocks``
        are required, the other keys default as in the constructor (``groups`` empty or absent: one
        full-attention group). ``ConfigError`` names the field as ``{where}.key``."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected an object, got {echo(d)}")
        for key in d:
            if key not in CONFIG_KEYS:
                raise ConfigError(f"{where}: unknown key {echo(key)}; known: {', '.join(CONFIG_KEYS)}")
        for key in _REQUIRED_KEYS:
            if key not in d:
                raise ConfigError(f"{where}.{key}: missing (required)")
        raw_groups = d.get("groups", [])
        if not isinstance(raw_groups, list):
            raise ConfigError(f"{where}.groups: expected a list of groups, got {echo(raw_groups)}")
        if len(raw_groups) > MAX_GROUPS:
            raise ConfigError(f"{where}.groups: {len(raw_groups)} groups, more than {MAX_GROUPS}")
        groups = []
        for i, g in enumerate(raw_groups):
            at = f"{where}.groups[{i}]"
            if not isinstance(g, dict):
                raise ConfigError(f"{at}: expected an object, got {echo(g)}")
            for key in g:
                if key not in _GROUP_KEYS:
                    raise ConfigError(f"{at}: unknown key {echo(key)}; known: {', '.join(_GROUP_KEYS)}")
            if "kind" not in g:
                raise ConfigError(f"{at}.kind: missing (required)")
            _check_group(g["kind"], g.get("sliding_window", 0), f"{at}.")
            groups.append(KVGroup(g["kind"], g.get("sliding_window", 0)))
        fields: dict[str, Any] = {
            "block_size": d["block_size"],
            "num_gpu_blocks": d["num_gpu_blocks"],
            "num_cpu_blocks": d["num_cpu_blocks"],
            "groups": tuple(groups) or (KVGroup(),),
            "world_size": d.get("world_size", 1),
            "lazy_offload": d.get("lazy_offload", False),
            "max_num_batched_tokens": d.get("max_num_batched_tokens", 64),
            "policy": d.get("policy", "repair"),
            "async_scheduling": d.get("async_scheduling", True),
            "num_speculative_tokens": d.get("num_speculative_tokens", 0),
        }
        _check_config(**fields, where=f"{where}.")
        return OffloadConfig(**fields)

