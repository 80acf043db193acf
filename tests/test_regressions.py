"""Every catalogued bug's shrunk trace, replayed as a plain regression test.

The traces under tests/traces/ were written by ``kvspec bugs --out tests/traces``; each
header records the oracle and the finding (kind, operation, invariant). Each must still
show its bug on the variant as a *violation* of the recorded invariant at the recorded
operation (a crash or a rejection is not the bug), through the Python API and through
``kvspec replay``; and it must be clean on the correct policy the variant derives from.
"""

import json
from pathlib import Path

import pytest

from kvspec.adapters import claims as claimed
from kvspec.cli import main
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import VIOLATION, replay
from kvspec.model import make_scheduler
from kvspec.model.bugs import BUGS, make_bug_target

TRACES = Path(__file__).parent / "traces"


def test_every_bug_has_a_trace() -> None:
    assert sorted(p.stem for p in TRACES.glob("*.jsonl")) == sorted(BUGS)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_trace_still_finds_the_bug(name: str) -> None:
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    assert tr.target == f"bug:{name}"
    assert tr.finding is not None and tr.finding["kind"] == VIOLATION, "a shipped trace records a violation"
    oracle = claimed.resolve(None, tr.config, bug=name)
    assert tr.oracle == oracle.ids, "the header records the oracle the catalogue gives the variant"
    out = replay(tr, lambda cfg: make_bug_target(name, cfg), oracle.ids)
    assert out.kind == VIOLATION, out.describe()
    assert out.violation is not None and out.violation.id == tr.finding["invariant"]
    assert out.op_index == tr.finding["op_index"] == len(tr.ops) - 1, "a shrunk trace fails at its last operation"
    assert f"{tr.finding['invariant']}:" in tr.note


@pytest.mark.parametrize("name", sorted(BUGS))
def test_cli_replay_reports_the_recorded_finding(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    assert main(["replay", str(TRACES / f"{name}.jsonl"), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["kind"] == VIOLATION and got["reproduces_recorded"] is True
    assert (got["violation"]["id"], got["op_index"]) == (tr.finding["invariant"], tr.finding["op_index"])


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_trace_is_clean_on_the_correct_policy(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    out = replay(tr, make_scheduler, claimed.claims(tr.config).ids)
    assert not out.failed, out.describe()
    assert main(["replay", str(TRACES / f"{name}.jsonl"), "--target", "model", "--oracle", "claims"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("name", sorted(n for n, b in BUGS.items() if b.oracle is None))
def test_cli_replay_on_the_model_uses_the_recorded_claims(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The header's oracle is the derived policy's claims: the correct model passes it."""
    assert main(["replay", str(TRACES / f"{name}.jsonl"), "--target", "model"]) == 0
    assert "no finding" in capsys.readouterr().out


def test_a_stop_at_max_tokens_is_judged_by_the_finish_flush_rules() -> None:
    """A request that a step's output stops at ``max_tokens`` (async scheduling) finishes inside that
    step; its finish flush is judged like an abort's: without the flush (``final-step-lost``) the
    confirmed block left unstored is a C7 violation at that step, and the correct policy is clean."""
    from kvspec.contract.config import KVGroup, OffloadConfig
    from kvspec.drivers.harness import run_ops

    cfg = OffloadConfig(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, world_size=1, groups=(KVGroup(),),
                        policy="repair", async_scheduling=True)
    ops = [{"op": "add", "rid": "r0", "family": 0, "prompt_len": 8, "max_tokens": 5},
           {"op": "step", "admit": ["r0"], "chunk": 64}] + [{"op": "step", "admit": [], "chunk": 64}] * 6
    oracle = claimed.claims(cfg).ids
    out = run_ops(cfg, ops, lambda c: make_bug_target("final-step-lost", c), oracle)
    assert out.kind == VIOLATION and out.violation is not None and out.violation.id == "C7", out.describe()
    assert out.op_index is not None and ops[out.op_index]["op"] == "step", "found at the step that stopped r0"
    assert not run_ops(cfg, ops, make_scheduler, oracle).failed
