"""Running on from a bug (``kvspec.drivers.continuation``): kept violation traces, the generator
going on from any recorded trace (a shrunk one, whose request ids skip), and ``kvspec history``'s
search starting half its traces from the violations it found."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import pytest

from kvspec.commands import history
from kvspec.contract.config import OffloadConfig
from kvspec.drivers import harness
from kvspec.drivers.continuation import Continuations
from kvspec.drivers.engine import Engine
from kvspec.drivers.harness import generate, run_ops
from kvspec.drivers.opgen import FUZZ_MIX
from kvspec.drivers.trace import read
from kvspec.model import make_scheduler

CFG = OffloadConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, policy="baseline")


def test_nothing_kept_draws_a_fresh_start_without_touching_the_random_stream() -> None:
    runs_on, rng, twin = Continuations(1.0), random.Random(7), random.Random(7)
    assert runs_on.draw(rng) is None and rng.random() == twin.random()
    runs_on.keep(CFG, [], "I1")  # an empty trace is no state to run on from
    assert runs_on.draw(rng) is None and rng.random() == twin.random()
    runs_on.keep(CFG, [{"op": "add", "rid": "r0", "family": 0, "prompt_len": 4, "max_tokens": 1}], "I1")
    kept = runs_on.draw(rng)
    assert kept is not None and (kept.config, kept.finding, len(kept.ops)) == (CFG, "I1", 1)
    never = Continuations(0.0, list(runs_on.kept))
    assert all(never.draw(rng) is None for _ in range(50))
    half = Continuations(0.5, list(runs_on.kept))
    drawn = sum(half.draw(rng) is not None for _ in range(2000))
    assert 850 < drawn < 1150


def test_a_new_request_id_skips_the_ids_a_shrunk_trace_left_behind() -> None:
    engine = Engine(make_scheduler(CFG))
    assert engine.unused_request_id() == "r0"
    engine.apply({"op": "add", "rid": "r1", "family": 0, "prompt_len": 4, "max_tokens": 1})
    engine.apply({"op": "add", "rid": "r2", "family": 0, "prompt_len": 4, "max_tokens": 1})
    assert engine.num_added == 2 and engine.unused_request_id() == "r3"
    engine.apply({"op": "add", "rid": "r3", "family": 0, "prompt_len": 4, "max_tokens": 1})
    assert engine.unused_request_id() == "r4"


@pytest.mark.parametrize("seed", range(6))
def test_the_generator_runs_on_from_a_recorded_trace(seed: int) -> None:
    """A recorded trace whose ids skip (as a shrunk one's do) is replayed first, operation for
    operation, then drawn on from: no drawn request collides with a recorded one, and the whole
    trace replays to the same outcome."""
    prefix: list[dict[str, Any]] = [
        {"op": "add", "rid": "r2", "family": 0, "prompt_len": 9, "max_tokens": 3},
        {"op": "add", "rid": "r5", "family": 1, "prompt_len": 8, "max_tokens": 1},
        {"op": "step", "admit": ["r2", "r5"], "chunk": 64},
        {"op": "step", "admit": [], "chunk": 64},
    ]
    oracle = ("I1", "I2", "I3", "I4", "I5")
    ops, out = generate(CFG, make_scheduler, random.Random(seed), 40, oracle, mix=FUZZ_MIX, strict=True,
                        prefix=prefix)
    assert ops[: len(prefix)] == prefix and len(ops) > len(prefix)
    assert out.kind != "expectation", out.describe()  # no drawn operation was refused
    added = [op["rid"] for op in ops if op["op"] == "add"]
    assert len(added) == len(set(added)) and added[:2] == ["r2", "r5"]
    again = run_ops(CFG, ops, make_scheduler, oracle)
    assert (again.kind, again.op_index) == (out.kind, out.op_index)


def _args(tmp_path: Path, continue_: bool) -> argparse.Namespace:
    return argparse.Namespace(seed=0, budget=2.0, out=str(tmp_path), raw=False, swarm=True, continue_=continue_)


def test_history_runs_on_from_the_violations_it_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the model's baseline (the FIXME breaks C1 in its first traces): once C1 is found, about
    half the traces replay C1's shrunk trace before drawing their own operations; with
    ``--no-continue`` none does, and the search up to the first finding is the same either way."""
    prefixes: list[tuple[dict[str, Any], ...]] = []
    real = harness.generate

    def spy(*a: Any, **kw: Any) -> Any:
        prefixes.append(tuple(kw.get("prefix", ())))
        return real(*a, **kw)

    monkeypatch.setattr(harness, "generate", spy)
    rows = list(history.search("0.33.0", make_scheduler, _args(tmp_path / "on", True)))
    first, end = rows[0], rows[-1]
    assert first["invariant"] == "C1" and "continued" not in first
    kept = tuple(read(first["trace"]).ops)
    ran_on = [p for p in prefixes if p]
    assert end["continued"] == len(ran_on) > 0 and all(p == kept for p in ran_on)
    assert 0.3 < len(ran_on) / end["traces"] < 0.7
    prefixes.clear()
    fresh = list(history.search("0.33.0", make_scheduler, _args(tmp_path / "off", False)))
    assert fresh[-1]["continued"] == 0 and not any(prefixes)
    assert (fresh[0]["finding"], fresh[0]["ops"]) == (first["finding"], first["ops"])


def test_shrinking_a_refusal_by_the_target_never_ends_in_bad_input() -> None:
    """A finding where the target refused an operation shrinks only to traces where the target
    refuses one: dropping an ``add`` leaves a ``step`` naming an unknown request, which the engine
    refuses as bad input; that is not the same finding (so a refusal shrunk for ``kvspec history``
    is never reported as a divergence of vLLM's when only the trace was broken)."""
    from kvspec.contract.errors import InvalidOperationError
    from kvspec.drivers.harness import shrink
    from kvspec.model import BlockPool, OffloadScheduler

    class RefusesR1(OffloadScheduler):
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            if request.request_id == "r1":
                raise InvalidOperationError("r1 is refused")
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def factory(cfg: OffloadConfig) -> Any:
        return RefusesR1(cfg, BlockPool(cfg.num_gpu_blocks, "gpu", cfg.num_groups))

    ops: list[dict[str, Any]] = [
        {"op": "add", "rid": "r0", "family": 0, "prompt_len": 4, "max_tokens": 1},
        {"op": "add", "rid": "r1", "family": 0, "prompt_len": 4, "max_tokens": 1},
        {"op": "step", "admit": ["r1", "r0"], "chunk": 64},
    ]
    out = run_ops(CFG, ops, factory, ("I1",))
    assert out.kind == "expectation" and not out.input_error and out.op_index == 2
    small, small_out = shrink(CFG, ops, factory, ("I1",), out, deadline=float("inf"))
    assert small == ops and not small_out.input_error, small_out.describe()
    bad = run_ops(CFG, ops[1:], factory, ("I1",))
    assert bad.kind == "expectation" and bad.input_error and bad.signature() != out.signature()


def test_history_stops_when_its_own_engine_refuses_a_trace_it_made(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An operation kvspec's engine refuses as bad input in a trace the search drew (or replayed
    from a kept one) is kvspec's fault: the search stops with an error (exit 3 in the worker),
    never a finding about vLLM."""
    from kvspec.drivers.harness import Outcome

    bad = Outcome(1, op_index=0, op_name="step", input_error=True,
                  expectation="step is recorded as accepted, but the engine rejected it (bad input in the trace)")
    monkeypatch.setattr(harness, "generate", lambda *a, **kw: ([{"op": "step", "admit": ["r9"], "chunk": 4}], bad))
    with pytest.raises(RuntimeError, match="refused an operation of its own trace"):
        list(history.search("0.33.0", make_scheduler, _args(tmp_path, True)))
