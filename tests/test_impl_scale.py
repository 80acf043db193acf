"""The implementation against the model on the benchmark workloads, at a scale random traces never
reach: dozens of requests per step, shared prefixes (one GPU block in many requests' tables), a full
CPU pool evicting entries of running requests. Snapshots must be equal after every step."""

from __future__ import annotations

import pytest

from kvspec.commands.bench import Driver, Scale, _config
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
