"""The second manager's implementation on tensors (``kvspec.impl.offloading``) held to its model
(``kvspec.model.offloading``): equal results and equal snapshots after every operation.

(a) lockstep on random traces drawn as vLLM's connector calls the manager (``Generator``),
    both policies, with and without the store threshold, with counts of the rare paths each
    batch went through; (b) a Hypothesis state machine running both side by side; (c) every
    kind of refused call, refused alike and changing nothing; (d) planted bugs in the
    implementation that the lockstep must report.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvspec.contract.errors import InvalidOperationError, KVSpecError, UnknownRequestError
from kvspec.contract.offloading import OffloadingConfig, OffloadingManagerTarget, OffloadKey, key_bytes
from kvspec.drivers.offloading import Driver, Generator, random_offloading_config
from kvspec.impl.offloading import TensorOffloadingManager, make_offloading_impl
from kvspec.impl.offloading.arc import TensorARC
from kvspec.impl.offloading.lru import TensorLRU
from kvspec.model.offloading import OffloadingManager, make_offloading_manager

Factory = Callable[[OffloadingConfig], OffloadingManagerTarget]

# -- (a) lockstep ---------------------------------------------------------------------------------


@dataclass
class Lockstep:
    """One batch of traces: how many operations ran, the first divergence of each diverging
    trace, and how often the rare paths were taken."""

    traces: int = 0
    operations: int = 0
    divergences: list[str] = field(default_factory=list)
    paths: Counter[str] = field(default_factory=Counter)


def config_for(seed: int, rng: random.Random) -> OffloadingConfig:
    """The generator's random config, with policy and store threshold cycling with the seed so
    that every batch covers the four classes (LRU/ARC x threshold 1/2)."""
    cfg = random_offloading_config(rng)
    threshold = 2 if seed % 4 >= 2 else 1
    return replace(cfg, policy=("lru", "arc")[seed % 2], store_threshold=threshold,
                   max_tracker_size=rng.choice((3, 6, 64_000)) if threshold > 1 else 64_000)


def _count_paths(paths: Counter[str], op: dict[str, Any], result: Any, before: dict[str, Any],
                 after: dict[str, Any]) -> None:
    if op["op"] == "store":
        if result is None:
            paths["store refused (no room)"] += 1
        elif result["evicted_keys"]:
            paths["store with evictions"] += 1
    if op["op"] == "store_done" and not op["success"]:
        paths["store failed"] += 1
    if op["op"] == "reset":
        paths["reset"] += 1
    arc = after["policy"].get("arc")
    if arc is not None and arc["target_t1_size"] != before["policy"]["arc"]["target_t1_size"]:
        paths["ARC ghost hit (target adapted)"] += 1
    lru = after["policy"].get("lru")
    if lru is not None:
        ranks = [tuple(lru["ranks"][k]) for k in lru["order"]]
        if any(a == b for a, b in zip(ranks, ranks[1:], strict=False)):
            paths["LRU order tie broken by key bytes"] += 1


def lockstep(reference: Factory, target: Factory, seeds: range, steps: int) -> Lockstep:
    """Run each seed's trace on both targets (the generator fed the reference's results);
    stop a trace at its first difference in a result, a refusal or the full snapshot."""
    out = Lockstep()
    for seed in seeds:
        rng = random.Random(seed)
        config = config_for(seed, rng)
        ref, tgt = Driver(reference(config)), Driver(target(config))
        gen = Generator(rng)
        out.traces += 1
        before = ref.snapshot()
        diverged = False
        for step in range(steps):
            for op in gen.next_ops():
                out.operations += 1
                r_ref = _outcome(ref, op)
                r_tgt = _outcome(tgt, op)
                s_ref, s_tgt = ref.snapshot(), tgt.snapshot()
                if r_ref != r_tgt or s_ref != s_tgt:
                    field_ = next((k for k in s_ref if s_ref[k] != s_tgt.get(k)), "result")
                    out.divergences.append(f"seed {seed} step {step} {op}: {field_} differs "
                                           f"(reference {r_ref!r:.200}, target {r_tgt!r:.200})")
                    diverged = True
                    break
                _count_paths(out.paths, op, r_ref, before, s_ref)
                before = s_ref
                gen.feed(op, r_ref)
            if diverged:
                break
    return out


def _outcome(driver: Driver, op: dict[str, Any]) -> Any:
    try:
        return driver.apply(op)
    except KVSpecError as exc:
        return ("refused", type(exc).__name__)


@pytest.mark.parametrize("batch", range(4))
def test_impl_agrees_with_the_model_on_random_traces(batch: int) -> None:
    """60 traces per batch (each batch all four config classes), 60 generator steps each."""
    result = lockstep(make_offloading_manager, make_offloading_impl, range(batch * 60, batch * 60 + 60), steps=60)
    assert result.divergences == []
    assert result.traces == 60 and result.operations > 60 * 60
    # The batch went through the rare paths, so agreement on them was checked.
    for path in ("store with evictions", "store refused (no room)", "store failed",
                 "ARC ghost hit (target adapted)", "LRU order tie broken by key bytes"):
        assert result.paths[path] > 0, (path, result.paths)


def test_impl_own_invariants_hold_along_traces() -> None:
    """``_check()`` of the implementation (and of the model) after every operation."""
    for seed in range(12):
        rng = random.Random(1000 + seed)
        config = config_for(seed, rng)
        model, impl = make_offloading_manager(config), make_offloading_impl(config)
        dm, di, gen = Driver(model), Driver(impl), Generator(rng)
        for _ in range(60):
            for op in gen.next_ops():
                result = dm.apply(op)
                assert di.apply(op) == result
                model._check()
                impl._check()
                gen.feed(op, result)


def test_lru_tie_is_broken_by_vllm_key_bytes_not_by_tuple_order() -> None:
    """Keys of one request at one position share a rank; vLLM orders them by packed bytes.
    ("a", 0x22000000) packs to ``a 22 00 00 00`` and ("a!", 0) to ``a 21 00 00 00 00``: bytes
    put ("a!", 0) first although tuple order puts ("a", ...) first. Both targets evict it first."""
    low, high = ("a!", 0), ("a", 0x22000000)
    assert key_bytes(low) < key_bytes(high) and high < low
    cfg = OffloadingConfig(num_chunks=2, policy="lru")
    evicted = []
    for t in (make_offloading_manager(cfg), make_offloading_impl(cfg)):
        t.on_new_request("r")
        t.set_key_positions("r", [(high, 16), (low, 16)])
        t.prepare_store("r", [high, low])
        t.complete_store("r", [high, low])
        assert t.snapshot()["policy"]["lru"]["order"] == ["a!:0", f"a:{0x22000000}"]
        out = t.prepare_store("r", [("c", 0)])
        assert out is not None
        evicted.append(out.evicted_keys)
    assert evicted == [[low], [low]]
