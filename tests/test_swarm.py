"""Swarm testing in the fuzzer (``kvspec.drivers.opgen.swarm_mix``): each trace draws its own mix
of operation kinds and step features, and the configuration's features half the time each; the mix
only changes proportions, so every operation is still one the engine accepts."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from kvspec.cli import main
from kvspec.drivers.harness import Run, default_oracle, fuzz
from kvspec.drivers.opgen import (
    FUZZ_MIX,
    SWARM_KIND_FACTORS,
    OpGenerator,
    OpMix,
    RandomChoices,
    random_config,
    swarm_mix,
)
from kvspec.model import make_scheduler


def _ops(mix: OpMix, seed: int, n: int = 300) -> list[dict[str, object]]:
    """``n`` operations of ``mix`` on the model's repair policy, each judged by its claims."""
    rng = random.Random(seed)
    config = random_config(RandomChoices(rng), "repair", swarm=True)
    run = Run(config, make_scheduler, default_oracle(config))
    gen = OpGenerator(config, RandomChoices(rng), mix)
    ops = []
    for _ in range(n):
        op = gen.next_op(run.engine)
        found = run.apply(op, recorded=False)
        assert found is None, found.describe()
        ops.append(op)
    return ops


def test_a_kind_the_mix_turns_off_is_never_drawn() -> None:
    off = OpMix(kind_factors=(("finish", 0.0), ("reset", 0.0)))
    kinds = Counter(str(op["op"]) for seed in range(3) for op in _ops(off, seed))
    assert kinds["finish"] == kinds["reset"] == 0 and kinds["step"] > 0 and kinds["add"] > 0
    plain = Counter(str(op["op"]) for seed in range(3) for op in _ops(FUZZ_MIX, seed))
    assert plain["finish"] > 0  # the same seeds draw finishes when nothing turns them off
    heavy = Counter(str(op["op"]) for seed in range(3) for op in _ops(OpMix(kind_factors=(("reset", 10.0),)), seed))
    assert heavy["reset"] > 3 * max(1, plain["reset"])


def test_the_step_features_follow_the_mix() -> None:
    never = [op for seed in range(3) for op in _ops(OpMix(preempt_chance=0.0, budget_chance=0.0), seed)]
    steps = [op for op in never if op["op"] == "step"]
    assert steps and not any("preempt" in op or "budget" in op for op in steps)
    often = [op for seed in range(3) for op in _ops(OpMix(preempt_chance=0.5, budget_chance=1.0), seed)]
    steps = [op for op in often if op["op"] == "step"]
    assert sum("preempt" in op for op in steps) > 10 and all("budget" in op for op in steps)


def test_swarm_mixes_vary_every_feature() -> None:
    mixes = [swarm_mix(RandomChoices(random.Random(seed))) for seed in range(200)]
    for kind, options in SWARM_KIND_FACTORS.items():
        assert {dict(m.kind_factors)[kind] for m in mixes} == set(options), kind
    assert {m.num_families for m in mixes} == {1, 2, 3}
    assert len({m.preempt_chance for m in mixes}) == len({m.budget_chance for m in mixes}) == 3
    assert len({m.whole_report_chance for m in mixes}) == len({m.admit_chance for m in mixes}) == 3


def test_swarm_configurations_draw_each_feature_half_the_time() -> None:
    def shares(swarm: bool) -> tuple[float, float, float]:
        cfgs = [random_config(RandomChoices(random.Random(s)), "repair", swarm=swarm) for s in range(600)]
        return (sum(len(c.groups) == 2 for c in cfgs) / 600, sum(c.async_scheduling for c in cfgs) / 600,
                sum(c.num_speculative_tokens > 0 for c in cfgs) / 600)

    for share in shares(True):
        assert 0.42 < share < 0.58
    sliding, async_, spec = shares(False)
    assert 0.24 < sliding < 0.36 and 0.69 < async_ < 0.81 and 0.19 < spec < 0.31


@pytest.mark.parametrize("policy", ["baseline", "signal-rescan", "repair"])
def test_swarm_traces_raise_no_false_alarm(policy: str) -> None:
    """The correct policies under swarm mixes: nothing found, and the traces did vary their mixes."""
    res = fuzz(make_scheduler, policy, 1.5, 3)
    assert not res.found, res.outcome.describe() if res.outcome else ""
    assert res.traces > 3


def test_no_swarm_is_a_campaign_of_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fuzz", "--target", "model", "--budget", "0.5", "--out", str(tmp_path), "--json"]
    assert main([*argv, "--no-swarm"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    swarmed = json.loads(capsys.readouterr().out)
    assert fixed["swarm"] is False and swarmed["swarm"] is True
    assert "noswarm" in fixed["campaign"]["state"] and "noswarm" not in swarmed["campaign"]["state"]
