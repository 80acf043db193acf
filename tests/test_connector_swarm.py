"""Swarm testing in the OffloadingConnector search (``offloading_connector_fuzz.draw_mix``): a
trace's mix only re-weighs what its profile draws, every option can be drawn, and without swarm
the profile's stream of draws is the one it always was (saved seeds keep their traces). The
history command's options that a search does not have are refused, not ignored. Nothing here
needs vLLM; the swarm traces themselves run in tests/test_vllm_offloading_connector.py."""

from __future__ import annotations

import random

import pytest

from kvspec.adapters.vllm_offloading_connector import ConnectorConfig
from kvspec.drivers.offloading_connector_fuzz import (
    KINDS,
    PREEMPT_ABORTS,
    PROFILES,
    SWARM_CHUNKS,
    SWARM_FACTORS,
    WEIGHTS,
    draw_mix,
)


@pytest.mark.parametrize("profile", PROFILES)
def test_without_swarm_a_mix_is_its_profile(profile: str) -> None:
    """The profile's weights (the ``preempt`` abort weight drawn, nothing else drawn), the four
    chunk sizes, three prefixes."""
    config = ConnectorConfig(block_size=4)
    rng, twin = random.Random(3), random.Random(3)
    mix = draw_mix(rng, config, profile)
    expected = list(WEIGHTS[profile])
    if profile == "preempt":
        expected[3] = twin.choice(PREEMPT_ABORTS)
        assert mix.weights[3] in PREEMPT_ABORTS
    assert list(mix.weights) == expected and mix.chunks == (4, 8, 16, 64) and mix.prefixes == 3
    assert rng.getstate() == twin.getstate()  # no other draw: a seed's trace is what it was


@pytest.mark.parametrize("profile", PROFILES)
def test_a_swarm_mix_reweighs_its_profile_and_every_option_is_drawn(profile: str) -> None:
    """Steps keep their weight; every other kind gets its profile's weight (``mixed``'s where the
    profile has none) times one of its factors; chunks come from one of the chunk sets; over
    many traces every factor, every chunk set and every prefix count occurs."""
    config = ConnectorConfig(block_size=2)
    rng = random.Random(11)
    seen: dict[str, set[float]] = {k: set() for k in SWARM_FACTORS}
    chunk_sets, prefix_counts = set(), set()
    plain = draw_mix(random.Random(0), config, profile)
    for _ in range(400):
        mix = draw_mix(rng, config, profile, swarm=True)
        assert mix.weights[KINDS.index("step")] == WEIGHTS[profile][KINDS.index("step")]
        for n, kind in enumerate(KINDS):
            if kind == "step":
                continue
            base = WEIGHTS[profile][n] or WEIGHTS["mixed"][n]
            if profile == "preempt" and kind == "abort":
                factors = {mix.weights[n] / a for a in PREEMPT_ABORTS} & set(SWARM_FACTORS[kind])
                assert factors, mix
                continue
            factor = mix.weights[n] / base
            assert factor in SWARM_FACTORS[kind], (kind, mix)
            seen[kind].add(factor)
        assert set(mix.chunks) <= set(plain.chunks)
        chunk_sets.add(mix.chunks)
        prefix_counts.add(mix.prefixes)
    assert all(seen[k] == set(SWARM_FACTORS[k]) for k in seen if not (profile == "preempt" and k == "abort"))
    assert len(chunk_sets) == len(SWARM_CHUNKS) and prefix_counts == {1, 2, 3}


def test_a_swarm_mix_can_leave_out_each_kind_but_step() -> None:
    """Factor 0 is an option of every kind but step (a trace that never finishes a job piles
    stores in flight onto its preemptions; one without resets keeps what they would drop)."""
    assert all(0.0 in SWARM_FACTORS[k] for k in ("work", "abort", "reset"))
    assert "step" not in SWARM_FACTORS and min(SWARM_FACTORS["add"]) > 0


def test_history_refuses_the_options_a_search_does_not_have(capsys: pytest.CaptureFixture[str]) -> None:
    """``--no-continue`` with the connector, and ``--seeds``/``--no-swarm``/``--no-continue`` with
    ``--manager offloading``, are bad arguments (exit 2, the option named) rather than ignored."""
    from kvspec.cli import main

    assert main(["history", "--connector", "offloading", "--no-continue", "--budget", "1"]) == 2
    assert "--no-continue is the first manager's" in capsys.readouterr().err
    for flag in (["--seeds", "2"], ["--no-swarm"], ["--no-continue"]):
        assert main(["history", "--manager", "offloading", *flag, "--budget", "1"]) == 2
        assert f"history --manager offloading has no {flag[0]} " in capsys.readouterr().err
