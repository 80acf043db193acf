"""The one stateful harness, run on the model's correct policies (oracle: what each claims).

Configurations with one full-attention group and with full + sliding-window groups are
drawn; the invariant catalogue is checked after every operation; rare paths are shown in
``--hypothesis-show-statistics``. The machine's rules draw from the same operation generator
as the fuzzer (``kvspec.drivers.opgen``); below, that generator's own choice of kinds is driven
by Hypothesis too.
"""

import os
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from scenario_kit import SYNC

from kvspec.contract.config import OffloadConfig
from kvspec.drivers.harness import Run, default_oracle, first_difference, make_state_machine, run_ops
from kvspec.drivers.opgen import HypothesisChoices, OpGenerator, OpMix, random_config
from kvspec.impl import make_scheduler as make_impl
from kvspec.model import make_scheduler

# The default run (Hypothesis profile ``ci``) drives each machine for FAST's examples; the ``deep``
# run (test_deep_campaign, below) drives every machine of this file for DEEP's. Other profiles
# (``nightly``) keep their own counts for both.
_CI = os.environ.get("KVSPEC_PROFILE", "ci") == "ci"
_FAST = settings(max_examples=25) if _CI else settings()
_DEEP = settings(max_examples=150, stateful_step_count=60) if _CI else settings()

MACHINES: dict[str, type] = {
    "baseline": make_state_machine(make_scheduler, policy="baseline"),
    "signal-rescan": make_state_machine(make_scheduler, policy="signal-rescan"),
    "repair": make_state_machine(make_scheduler, policy="repair"),
    "lazy-baseline": make_state_machine(make_scheduler, policy="baseline", lazy=True),
    # The implementation under the same harness, the model as reference: equal snapshots after every step.
    "impl-baseline": make_state_machine(make_impl, reference=make_scheduler, policy="baseline"),
    "impl-signal-rescan": make_state_machine(make_impl, reference=make_scheduler, policy="signal-rescan"),
    "impl-repair": make_state_machine(make_impl, reference=make_scheduler, policy="repair"),
    "impl-lazy": make_state_machine(make_impl, reference=make_scheduler, policy="baseline", lazy=True),
}
TestBaseline = _FAST(MACHINES["baseline"]).TestCase
TestSignalRescan = _FAST(MACHINES["signal-rescan"]).TestCase
TestRepair = _FAST(MACHINES["repair"]).TestCase
TestLazyBaseline = _FAST(MACHINES["lazy-baseline"]).TestCase
TestImplBaseline = _FAST(MACHINES["impl-baseline"]).TestCase
TestImplSignalRescan = _FAST(MACHINES["impl-signal-rescan"]).TestCase
TestImplRepair = _FAST(MACHINES["impl-repair"]).TestCase
TestImplLazy = _FAST(MACHINES["impl-lazy"]).TestCase

# Refinement (R1, kvspec.specs.refinement) after every accepted operation: each request's step is
# one the proofs' transitions admit. Fewer examples: each new state shape costs a Z3 query.
_REFINE = settings(max_examples=12, stateful_step_count=25, deadline=None)
TestRefineBaseline = _REFINE(make_state_machine(make_scheduler, policy="baseline", refine=True)).TestCase
TestRefineSignalRescan = _REFINE(make_state_machine(make_scheduler, policy="signal-rescan", refine=True)).TestCase
TestRefineRepair = _REFINE(make_state_machine(make_scheduler, policy="repair", refine=True)).TestCase


@pytest.mark.deep
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_deep_campaign(name: str) -> None:
    """Each machine above for ``_DEEP``'s examples and steps (a fresh class: the default run's
    settings stay on its own)."""
    machine = MACHINES[name]
    run_state_machine_as_test(type(f"Deep{machine.__name__}", (machine,), {}), settings=_DEEP)


OPS_PER_EXAMPLE = 30


@given(st.data())
def test_the_generator_under_hypothesis_makes_valid_traces(data: Any) -> None:
    """``OpGenerator.next_op`` with Hypothesis as its source of choices, invalid operations
    included: every operation does what it says (accepted, or rejected cleanly where it carries
    ``"expect": "error"``) and the repair policy keeps its claims."""
    choices = HypothesisChoices(data)
    config = random_config(choices, "repair")
    gen = OpGenerator(config, choices, OpMix(invalid_rate=0.1))
    run = Run(config, make_scheduler, default_oracle(config))
    for _ in range(OPS_PER_EXAMPLE):
        found = run.apply(gen.next_op(run.engine))
        assert found is None, found.describe()


class _FlushFlipped:
    """The model, except that every connector metadata it returns says the opposite about a flush
    (no snapshot shows it: only the operation's result differs)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self._inner.build_connector_meta(scheduler_output)
        return replace(meta, need_flush=not meta.need_flush)


def test_the_run_loop_compares_results_and_key_order() -> None:
    """With a reference, ``Run`` reports a divergence when only an operation's result differs, and
    ``first_difference`` tells snapshots apart by key order and by leaf type, as JSON text does."""
    ops = [{"op": "add", "rid": "a", "family": 1, "prompt_len": 40}, {"op": "step", "admit": ["a"]}]
    out = run_ops(OffloadConfig(**SYNC), ops, lambda cfg: _FlushFlipped(make_scheduler(cfg)), (), make_scheduler)
    assert out.divergence is not None and "results differ" in out.divergence, out.describe()
    assert run_ops(OffloadConfig(**SYNC), ops, make_scheduler, (), make_scheduler).kind is None
    assert first_difference({"a": 1, "b": 2}, {"b": 2, "a": 1}) is not None
    assert first_difference({"a": [1]}, {"a": [True]}) is not None
    assert first_difference({"a": [1, None]}, {"a": [1, None]}) is None
