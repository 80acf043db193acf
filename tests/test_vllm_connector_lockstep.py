"""The connector model (kvspec.model.offloading.connector) in lockstep with vLLM 0.33.0's real
OffloadingConnector under its real Scheduler and AsyncScheduler
(kvspec/drivers/offloading_connector_lockstep.py): every call vLLM's scheduler makes to the
connector's scheduler side is made on the model too, and return values, connector bookkeeping
and manager snapshots must agree after each.

* ``KVSPEC_VLLM_CONNECTOR_LOCKSTEP_TRACES`` traces of 60 operations (default 8; the generation
  profiles mixed, preempt, window and decode in turn, eight traces each): LRU and ARC,
  sync and async scheduling, with and without a sliding-window group, now and then a store
  threshold; 0 divergences. ``KVSPEC_VLLM_CONNECTOR_LOCKSTEP_SEED`` (default 11) picks the
  configurations and seeds.
* The saved divergence trace (tests/traces/connector_lockstep/) replays clean, and diverges
  again under a model without the rule that fixed it.
* Two more model rules broken on purpose are caught: decode tokens stored despite
  ``offload_prompt_only``, and a preempted request's jobs not flushed.

Marked ``vllm``; skipped, with the reason, where vLLM 0.33.0 cannot be imported.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvspec.adapters.vllm_offloading_connector import connector_driver_available
from kvspec.model.offloading.connector import OffloadingConnectorModel, ReqView, StepInput

VLLM_OK, VLLM_WHY = connector_driver_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")]

TRACES = int(os.environ.get("KVSPEC_VLLM_CONNECTOR_LOCKSTEP_TRACES", "8"))
SEED = int(os.environ.get("KVSPEC_VLLM_CONNECTOR_LOCKSTEP_SEED", "11"))
LENGTH = 60
SAVED = Path(__file__).parent / "traces" / "connector_lockstep"


def test_the_model_agrees_with_vllms_connector_after_every_call() -> None:
    from kvspec.drivers.offloading_connector_lockstep import lockstep_configs, run_lockstep_trace, save_divergence

    traces = steps = calls = 0
    kinds: set[tuple[str, bool, bool]] = set()
    for config, async_scheduling, seed, profile in lockstep_configs(TRACES, seed=SEED):
        r = run_lockstep_trace(config, async_scheduling, seed, LENGTH, profile=profile)
        path = save_divergence(r, LENGTH)
        assert r.divergence is None, (config, async_scheduling, seed, profile, path, r.divergence)
        traces, steps, calls = traces + 1, steps + r.trace.steps, calls + r.calls
        kinds.add((config.eviction_policy, async_scheduling, bool(config.sliding_window)))
    print(f"\nconnector lockstep: {traces} traces, {steps} steps, {calls} calls compared, 0 divergences")
    assert calls > traces * 20
    if TRACES >= 8:
        assert {p for p, _, _ in kinds} == {"lru", "arc"} and {a for _, a, _ in kinds} == {False, True}
        assert {w for _, _, w in kinds} == {False, True}


class _EverySlidingWindowChunk(OffloadingConnectorModel):
    """Broken on purpose: stores every complete sliding-window chunk (the first model's rule)."""

    def _reachable(self, view: ReqView) -> set[int]:
        return set(range(len(view.hashes)))


class _DecodeStoredToo(OffloadingConnectorModel):
    """Broken on purpose: ignores ``offload_prompt_only``."""

    def _offloadable(self, view: ReqView, num_tokens: int) -> int:
        return min(num_tokens, view.num_tokens)


class _PreemptionNotFlushed(OffloadingConnectorModel):
    """Broken on purpose: a preempted request's jobs are not flushed."""

    def build_connector_meta(self, step: StepInput, views: Any) -> Any:
        return super().build_connector_meta(replace(step, preempted=()), views)


def _saved(path: Path) -> tuple[Any, bool, list[dict[str, Any]]]:
    """A saved trace: its configuration, scheduling mode and operations (the drain follows)."""
    from kvspec.adapters.vllm_offloading_connector import ConnectorConfig

    data = json.loads(path.read_text())
    return ConnectorConfig(**data["config"]), data["async_scheduling"], data["ops"]


@pytest.mark.parametrize("path", sorted(SAVED.glob("*.json")), ids=lambda p: p.stem)
def test_a_saved_divergence_replays_clean_and_its_fix_is_needed(path: Path) -> None:
    from kvspec.drivers.offloading_connector_lockstep import run_lockstep_ops

    config, async_scheduling, ops = _saved(path)
    assert run_lockstep_ops(config, async_scheduling, ops).divergence is None
    broken = run_lockstep_ops(config, async_scheduling, ops, factory=_EverySlidingWindowChunk)
    assert broken.divergence is not None and broken.divergence["call"] == "build_connector_meta"
    assert broken.divergence["step"] == 0 and "store_jobs" in broken.divergence["vllm"]


@pytest.mark.parametrize("factory", [_DecodeStoredToo, _PreemptionNotFlushed], ids=lambda f: f.__name__)
def test_a_model_rule_broken_on_purpose_is_caught(factory: type[OffloadingConnectorModel]) -> None:
    from kvspec.drivers.offloading_connector_lockstep import lockstep_configs, run_lockstep_trace

    for config, async_scheduling, seed, profile in lockstep_configs(12, seed=3):
        r = run_lockstep_trace(config, async_scheduling, seed, 40, factory=factory, profile=profile)
        if r.divergence is not None:
            assert r.divergence["call"] == "build_connector_meta"
            assert r.divergence["vllm"] != r.divergence["model"]
            return
    pytest.fail(f"{factory.__name__} was not caught in 12 traces")


FINDINGS = Path(__file__).parent / "traces" / "connector_findings"


@pytest.mark.parametrize("path", sorted(FINDINGS.glob("*.json")), ids=lambda p: p.stem)
def test_a_catalogue_finding_on_vllm_is_what_the_model_predicts(path: Path) -> None:
    """vLLM's behaviour that a catalogue rule flags, with the model in lockstep: no divergence
    up to the finding, so the model's rules (0.33.0's) produce it too."""
    from kvspec.drivers.offloading_connector_lockstep import run_lockstep_ops

    config, async_scheduling, ops = _saved(path)
    r = run_lockstep_ops(config, async_scheduling, ops)
    assert r.divergence is None
    assert r.trace.finding is not None and r.trace.finding["ids"] == [json.loads(path.read_text())["finding"]]
