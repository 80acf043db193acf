"""The implementation against the model on the benchmark workloads, at a scale random traces never
reach: dozens of requests per step, shared prefixes (one GPU block in many requests' tables), a full
CPU pool evicting entries of running requests. Snapshots must be equal after every step."""

from __future__ import annotations

import random

import pytest

from kvspec.adapters.targets import get_factory
from kvspec.commands.bench import Driver, Scale, _config
from kvspec.drivers.harness import Run
from kvspec.drivers.opgen import OpGenerator, RandomChoices, random_config
from kvspec.impl import free_list, prefix_index
from kvspec.impl import make_scheduler as make_impl
from kvspec.model import make_scheduler as make_model


@pytest.mark.parametrize("policy", ["baseline", "signal-rescan", "repair"])
@pytest.mark.parametrize("workload,scale,stagger", [
    ("chat", Scale(48, 8, 200), 0),
    ("chat", Scale(40, 6, 60), 0),  # CPU space runs out inside a step
    ("chat", Scale(64, 12, 40), 3),  # family members apart: cached prefixes evicted by the same step
    ("decode", Scale(32, 4, 400), 0),
    ("storm", Scale(48, 6, 100), 0),
])
def test_bench_workloads_agree(policy: str, workload: str, scale: Scale, stagger: int) -> None:
    _agree(policy, workload, scale, stagger)


@pytest.mark.parametrize("workload,scale", [("chat", Scale(48, 8, 200)), ("storm", Scale(48, 6, 100))])
def test_large_state_snapshot_paths_agree(workload: str, scale: Scale, monkeypatch: pytest.MonkeyPatch) -> None:
    """The implementation's snapshot reads a small prefix map and free queue as lists, a large one
    with tensor operations (past ``SMALL_KEY_SLOTS`` and ``SMALL_WINDOW``); the tensor paths, forced
    here at bench scale, give the model's snapshots too."""
    monkeypatch.setattr(prefix_index, "SMALL_KEY_SLOTS", 0)
    monkeypatch.setattr(free_list, "SMALL_WINDOW", 0)
    _agree("repair", workload, scale, 0)


@pytest.mark.parametrize("small", [0, 1 << 20])
def test_snapshot_paths_agree_on_random_traces(small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both snapshot paths (tensor operations with the thresholds at 0, lists with them above any
    size here) against the model on random traces, where duplicate keys and stale queue slots occur:
    the implementation runs with the model as its reference, snapshots compared after every operation."""
    monkeypatch.setattr(prefix_index, "SMALL_KEY_SLOTS", small)
    monkeypatch.setattr(free_list, "SMALL_WINDOW", small)
    for seed in range(20):
        rng = random.Random(seed)
        cfg = random_config(RandomChoices(rng), ("baseline", "signal-rescan", "repair")[seed % 3], False)
        run = Run(cfg, get_factory("impl"), (), reference=get_factory("model"))
        gen = OpGenerator(cfg, RandomChoices(rng))
        for _ in range(60):
            found = run.apply(gen.next_op(run.engine), recorded=False)
            assert found is None, f"seed {seed}: {found.describe()}"


def _agree(policy: str, workload: str, scale: Scale, stagger: int) -> None:
    """Model and implementation run the bench driver for 14 steps; snapshots equal after each."""
    cfg = _config(workload, scale, policy)
    model, impl = make_model(cfg), make_impl(cfg)
    drivers = [Driver(model, workload, scale), Driver(impl, workload, scale)]
    for d in drivers:
        d.setup()
        for n, r in enumerate(d.reqs):  # request n starts (n % stagger) blocks into its prompt
            r.num_computed_tokens += cfg.block_size * (n % stagger if stagger else 0)
    assert model.snapshot() == impl.snapshot(), "after setup"
    stored = 0
    for step in range(14):
        for d in drivers:
            d.step()
        m, i = model.snapshot(), impl.snapshot()
        assert m == i, f"step {step}"
        stored += len(m["scheduler"]["store_events"])
    assert stored > 0
