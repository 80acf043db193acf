"""Real vLLM 0.33.0 with one of kvspec's patches applied, as kvspec targets.

``patches/vllm-0.33.0/<name>.diff`` changes ``vllm/v1/core/block_pool.py`` and
``vllm/v1/simple_kv_offload/manager.py``; ``scripts/setup-vllm-patched.sh <name>`` builds a
venv (``.vllm-<name>-venv``) that runs the patched files. Each patched module names its
patch in a module constant, ``CPU_EVICTION_RESTORE``, and the targets here refuse to run
anything else:

* ``vllm+pr47235``: PR #47235 as its description states it, with the open details decided
  as the ``signal-rescan`` policy's defaults. Its policy state is the CPU pool's eviction
  flag (``BlockPool._had_recent_eviction``), read back as ``eviction_flag``.
* ``vllm+repair``: kvspec's ``repair`` policy (``kvspec.model.repair``) written into vLLM.
  Its policy state is read from the manager's repair records (``_repair_lost``,
  ``_in_flight_store_hashes``) and counters (``eviction_repair_stats``), in the format of
  ``RepairPolicy.snapshot``.

The target is the baseline adapter (``kvspec.adapters.vllm.VllmTarget``) with the policy's
name and its policy state read from vLLM's own objects into kvspec's snapshot format, so
the invariant catalogue and the policy's claims judge the patched code exactly as they
judge the model.
"""

from __future__ import annotations

from typing import Any

from kvspec.adapters.vllm import VLLM_VERSION, VllmTarget, _import_vllm, _key_text
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError

# target name -> (patch name, the kvspec policy it implements)
PATCHED_TARGETS: dict[str, tuple[str, str]] = {
    "vllm+pr47235": ("pr47235", "signal-rescan"),
    "vllm+repair": ("repair", "repair"),
}


def running_patch() -> tuple[str | None, str | None]:
    """The patch names the running vLLM's two modules carry (None where unpatched)."""
    from vllm.v1.core import block_pool
    from vllm.v1.simple_kv_offload import manager

    return getattr(manager, "CPU_EVICTION_RESTORE", None), getattr(block_pool, "CPU_EVICTION_RESTORE", None)


def _check_patch(target: str, config: OffloadConfig) -> None:
    """``ConfigError`` unless the running vLLM carries the target's patch and ``config`` asks
    for the policy it implements."""
    patch, policy = PATCHED_TARGETS[target]
    if config.policy != policy:
        raise ConfigError(f"the {target!r} target implements the {policy!r} policy, not {config.policy!r}")
    got = running_patch()
    if got != (patch, patch):
        found = "unpatched vLLM" if got == (None, None) else f"vLLM patched with {got}"
        raise ConfigError(
            f"the {target!r} target needs vLLM {VLLM_VERSION} with patches/vllm-0.33.0/{patch}.diff applied; "
            f"this Python runs {found}; build it with scripts/setup-vllm-patched.sh {patch} and run kvspec "
            f"from .vllm-{patch}-venv"
        )


class _PatchedTarget(VllmTarget):
    """A patched vLLM: the baseline adapter's snapshot with the patch's policy state."""

    def policy_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        snap["scheduler"]["policy_state"] = self.policy_state()
        return snap


class VllmPr47235Target(_PatchedTarget):
    """vLLM 0.33.0 + PR #47235: the ``signal-rescan`` policy in vLLM's code."""

    policy_name = "signal-rescan"

    def policy_state(self) -> dict[str, Any]:
        """The CPU pool's eviction flag, as ``SignalRescanPolicy.snapshot`` reports it."""
        return {"eviction_flag": bool(self.manager.cpu_block_pool._had_recent_eviction)}


def make_vllm_pr47235_target(config: OffloadConfig) -> VllmPr47235Target:
    """vLLM 0.33.0 + PR #47235 as an ``OffloadTarget`` (policy ``signal-rescan``)."""
    config.validate()
    v = _import_vllm()
    _check_patch("vllm+pr47235", config)
    return VllmPr47235Target(config, v)


class VllmRepairTarget(_PatchedTarget):
    """vLLM 0.33.0 + ``patches/vllm-0.33.0/repair.diff``: the ``repair`` policy in vLLM's code."""

    policy_name = "repair"

    def policy_state(self) -> dict[str, Any]:
        """The manager's lost records, hashes in flight and repair counters, as
        ``RepairPolicy.snapshot`` reports them."""
        mgr = self.manager
        stats = mgr.eviction_repair_stats
        return {
            "lost": sorted([rid, g, p] for rid, g, p in mgr._repair_lost),
            "in_flight_keys": sorted(_key_text(k) for k in mgr._in_flight_store_hashes),
            "restores_last_plan": stats.restores_last_plan,
            "lost_keys_at_repair": stats.lost_hashes_at_repair,
            "self_evictions": stats.self_evictions,
            "useful_evicted_by_restores": stats.useful_evicted_by_restores,
        }


def make_vllm_repair_target(config: OffloadConfig) -> VllmRepairTarget:
    """vLLM 0.33.0 + the repair patch as an ``OffloadTarget`` (policy ``repair``)."""
    config.validate()
    v = _import_vllm()
    _check_patch("vllm+repair", config)
    return VllmRepairTarget(config, v)
