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
import z3

from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import check
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
        assert e.target.policy.eviction_flag is False  # nothing left to trigger a rescan


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_same_trace_under_repair_keeps_c2(found: dict[str, dict], name: str) -> None:
    cfg, ops = BUILDERS[name](found[name])
    e = Engine(make_scheduler(replace(cfg, policy="repair")))
    for op in ops:
        e.apply(op)
        assert check(e.snapshot(), ["C2"]) == []


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_larger_counterexamples_replay_hole_for_hole(name: str) -> None:
    """Asked for a counterexample with a cursor of at least 3 and two holes or more, Z3 finds
    one; its trace leaves exactly as many C1 holes in the model as the Z3 step made."""
    from kvspec.specs import obligations as O
    from kvspec.specs.encoding import Quant, reset_names
    from kvspec.specs.traces import _holes

    reset_names()
    enc = Quant(1)

    def bigger(s, st):
        holes = [z3.And(st.post.groups[0].arr["owned"][i], st.post.groups[0].arr["hashed"][i],
                        z3.Not(st.post.groups[0].arr["cached"][i]), z3.Not(st.post.groups[0].arr["infl"][i]))
                 for i in range(3)]
        return [s.groups[0].cur >= 3, s.groups[0].cur <= 4, z3.Sum([z3.If(h, 1, 0) for h in holes]) >= 2]

    if name == "completeness-c1:T2":
        res = O.counterexample(enc, "baseline", "c1", O.evict, bigger)
    elif name == "completeness-flag:H1":
        res = O.counterexample(enc, "signal-rescan", "flag", O.plan_scan,
                               lambda s, st: [z3.Not(st.inputs["scheduled"]), *bigger(s, st)])
    else:
        res = O.counterexample(enc, "signal-rescan", "flag", O.plan_scan,
                               lambda s, st: [st.inputs["scheduled"], s.flag, st.inputs["free"] == 0,
                                              *bigger(s, st)])
    assert res[0] == "found", res
    cex = res[2]
    cfg, ops = BUILDERS[name](cex)
    _, per_op = _replay(cfg, ops)
    expected = min(_holes(cex), 4) if name.endswith("H3") else min(_holes(cex), min(cex["pre.cur0"], 4))
    assert len(per_op[-1]) == expected >= 2
