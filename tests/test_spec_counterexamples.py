"""Z3's completeness counterexamples, replayed on the model as engine traces.

For the baseline (T2) and signal-rescan (H1, H3) Z3 must FIND a step that breaks the
policy's completeness claim; ``kvspec.specs.traces`` turns each model into a trace, and
here the trace runs on the real model: C1 reports the holes, and they are still there
after more steps. The same trace under ``repair`` keeps C2 (every hole is recorded and
pending), which shows the traces test the policy, not the harness.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvspec.model import make_scheduler
from kvspec.model.engine import Engine
from kvspec.model.invariants import check
from kvspec.specs.obligations import catalogue
from kvspec.specs.traces import BUILDERS

CEX = {ob.name: ob for ob in catalogue(quick=True) if ob.kind == "counterexample" and ob.name in BUILDERS}


def _replay(cfg, ops) -> tuple[Engine, list[list[str]]]:
    e = Engine(make_scheduler(cfg))
    per_op = []
    for op in ops:
        e.apply(op)
        per_op.append([str(v) for v in check(e.snapshot(), ["C1"])])
    return e, per_op


@pytest.fixture(scope="module")
def found() -> dict[str, dict]:
    out = {}
    for name, ob in CEX.items():
        res = ob.run()
        assert res.result == "found", f"{name}: {res.result} {res.detail}"
        out[name] = res.model
    return out


def test_all_three_counterexamples_have_builders() -> None:
    assert set(CEX) == {"completeness-c1:T2", "completeness-flag:H1", "completeness-flag:H3"}


def test_counterexample_shapes(found: dict[str, dict]) -> None:
    t2, h1, h3 = found["completeness-c1:T2"], found["completeness-flag:H1"], found["completeness-flag:H3"]
    assert t2["pre.cur0"] >= 1
    assert h1["scheduled"] is False and h1["pre.flag"] is True and h1["post.flag"] is False
    assert h3["scheduled"] is True and h3["pre.flag"] is True and h3["free"] == 0


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_counterexample_replays_as_a_c1_violation(found: dict[str, dict], name: str) -> None:
    cfg, ops = BUILDERS[name](found[name])
    e, per_op = _replay(cfg, ops)
    assert per_op[-1], f"{name}: no C1 violation at the end"
    # permanent: the same holes at the last three operations (more steps, nothing repairs them)
    assert per_op[-1] == per_op[-2] == per_op[-3]
    assert all("requests R" in v for v in per_op[-1])
    if cfg.policy == "signal-rescan":
        assert e.target.eviction_flag is False  # nothing left to trigger a rescan


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_same_trace_under_repair_keeps_c2(found: dict[str, dict], name: str) -> None:
    cfg, ops = BUILDERS[name](found[name])
    e = Engine(make_scheduler(replace(cfg, policy="repair")))
    for op in ops:
        e.apply(op)
        assert check(e.snapshot(), ["C2"]) == []
