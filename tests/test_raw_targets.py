"""Raw targets and the verdicts of ``kvspec history``, without vLLM.

``raw:vllm`` and ``raw:vllm@VERSION`` are the real-vLLM targets with the model's rules left to vLLM
(``kvspec.adapters.vllm``); what the adapter still checks, what it checks of vLLM's answers, how a
pool's own free count reaches the oracle, and how ``kvspec history`` names what it finds are
checked here on stand-ins for vLLM's objects (the same paths on real vLLM: tests/test_vllm_verdicts.py).
"""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvspec.adapters.targets import get_factory, raw_target
from kvspec.adapters.vllm import VllmBrokeContract, VllmPool, handed_out
from kvspec.commands import history
from kvspec.contract.checks import check_count_type, check_worker_output
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, InvalidCountError, KVSpecError, UnknownEventError
from kvspec.contract.snapshot import pool_section
from kvspec.contract.snapshot_io import snapshot_issues
from kvspec.contract.types import KVConnectorOutput
from kvspec.drivers.harness import Outcome
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import check

# -- names -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "raw"), [("vllm", "raw:vllm"), ("vllm@0.23.0", "raw:vllm@0.23.0"),
                                           ("raw:vllm@0.19.1", "raw:vllm@0.19.1")])
def test_raw_names_of_real_vllm_targets(name: str, raw: str) -> None:
    assert raw_target(name) == raw


@pytest.mark.parametrize("name", ["model", "impl", "vllm+repair", "bug:pin-leak"])
def test_raw_is_only_for_real_vllm(name: str) -> None:
    with pytest.raises(ConfigError, match="--raw needs a real vLLM target"):
        raw_target(name)


def test_a_raw_release_target_is_known_and_checks_its_release() -> None:
    """``raw:vllm@VERSION`` resolves without importing vLLM; a release before 0.19 is refused."""
    assert callable(get_factory("raw:vllm@0.23.0"))
    with pytest.raises(ConfigError, match="no simple_kv_offload manager"):
        get_factory("raw:vllm@0.18.1")
    with pytest.raises(ConfigError, match="unknown target"):
        get_factory("raw:model")


# -- what raw mode still checks -----------------------------------------------------------------------


def test_a_raw_count_is_any_int() -> None:
    assert check_count_type(-3, "n") == -3
    for bad in ("3", 2.0, True, None):
        with pytest.raises(InvalidCountError, match="n must be an int"):
            check_count_type(bad, "n")


def test_raw_worker_reports_keep_shapes_only() -> None:
    """Without the rules, an unissued event and a count beyond the world size pass (vLLM gets them);
    a count that is no int, or an event id that is no int, does not."""
    def load_sent(rid: str) -> bool | None:
        return None

    out = KVConnectorOutput(finished_recving={"nobody"}, completed_store_events={99: 7})
    with pytest.raises(KVSpecError):
        check_worker_output(out, load_sent, 1, 1)
    check_worker_output(out, load_sent, 1, 1, rules=False)
    with pytest.raises(UnknownEventError):
        check_worker_output(KVConnectorOutput(completed_store_events={99: 1}), load_sent, 1, 1)
    with pytest.raises(InvalidCountError, match="must be an int"):
        check_worker_output(KVConnectorOutput(completed_store_events={0: "1"}), load_sent, 1, 1, rules=False)
    with pytest.raises(KVSpecError, match="an event id must be an int"):
        check_worker_output(KVConnectorOutput(completed_store_events={"0": 1}), load_sent, 1, 1, rules=False)


# -- what vLLM hands back -----------------------------------------------------------------------------


def _block(i: int) -> Any:
    return SimpleNamespace(block_id=i)


@pytest.mark.parametrize("bad", [-1, 0, 8])
def test_a_block_vllm_cannot_hand_out_is_a_crash_not_a_refusal(bad: int) -> None:
    """``get_new_blocks`` answering with a free-list sentinel (-1), the null block or an id past the
    pool is vLLM breaking its own contract: ``VllmBrokeContract``, which is no ``KVSpecError``."""
    assert handed_out([_block(3), _block(1)], 8, "gpu", 2) == [3, 1]
    with pytest.raises(VllmBrokeContract, match=f"handed out block id {bad}"):
        handed_out([_block(2), _block(bad)], 8, "gpu", 2)
    assert not issubclass(VllmBrokeContract, KVSpecError)


class _FakeQueue:
    num_free_blocks = 2


class _FakePool:
    """A vLLM ``BlockPool`` stand-in whose ``get_new_blocks`` hands out the free list's sentinel."""

    def __init__(self) -> None:
        self.num_gpu_blocks = 4
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0, block_hash=None) for i in range(4)]
        self.free_block_queue = _FakeQueue()
        self.asked: list[int] = []

    def get_num_free_blocks(self) -> int:
        return 2

    def get_new_blocks(self, n: int) -> list[Any]:
        self.asked.append(n)
        return [_block(-1)] * max(n, 1)


@pytest.mark.parametrize(("raw", "reaches"), [(False, []), (True, [-1])])
def test_a_raw_pool_passes_a_negative_count_to_vllm(raw: bool, reaches: list[int]) -> None:
    pool = _FakePool()
    with pytest.raises(InvalidCountError if not raw else VllmBrokeContract):
        VllmPool(pool, "gpu", raw=raw).get_new_blocks(-1)
    assert pool.asked == reaches


# -- a pool's own free count ----------------------------------------------------------------------------


def test_a_free_count_is_shown_only_when_it_disagrees_with_the_queue() -> None:
    same = pool_section(4, [0, 0, 0, 1], [None] * 4, [1, 2], {}, free_count=2)
    assert "free_count" not in same
    off = pool_section(4, [0, 0, 0, 1], [None] * 4, [1, 2], {}, free_count=3)
    assert off["free_count"] == 3


def test_i1_reports_a_free_count_the_queue_does_not_hold() -> None:
    target = make_scheduler(OffloadConfig(num_gpu_blocks=6, num_cpu_blocks=4))
    snap = target.snapshot()
    assert check(snap, ("I1",)) == []
    snap["gpu_pool"]["free_count"] = len(snap["gpu_pool"]["free_queue"]) + 1
    assert snapshot_issues(snap) == []
    [v] = check(snap, ("I1",))
    assert "free count" in v.message


# -- kvspec history's verdicts -----------------------------------------------------------------------


def test_history_never_draws_a_window_of_one_token() -> None:
    rng = random.Random(0)
    windows = [g.sliding_window for _ in range(400) for g in history._config(rng).groups if g.kind == "sliding"]
    assert windows and min(windows) == history.MIN_WINDOW == 2


@pytest.mark.parametrize(("outcome", "raw", "kind"), [
    (Outcome(3, crash="step: InvalidOperationError: x (its rejection changed the state)",
             exception="InvalidOperationError"), False, "divergence"),
    (Outcome(3, expectation="step is recorded as accepted, but the target rejected it"), False, "divergence"),
    (Outcome(3, expectation="step is recorded as accepted, but the target rejected it"), True, "rejection"),
    (Outcome(3, crash="step: AssertionError: ", exception="AssertionError"), False, "crash"),
    (Outcome(3, crash="step: VllmBrokeContract: x", exception="VllmBrokeContract"), True, "crash"),
])
def test_history_names_a_refusal_apart_from_vllm_findings(outcome: Outcome, raw: bool, kind: str) -> None:
    """A refusal by kvspec's adapter is never a vLLM finding: judged clean on the raw target it is a
    divergence (the model's rule), on the raw target itself a rejection (kvspec's gap)."""
    assert history._refused(outcome) == (kind in ("divergence", "rejection"))
    assert history._kind(outcome, raw) == kind


def test_history_judges_a_refusal_on_the_raw_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refused trace is run again on ``raw:vllm@VERSION``: a finding there replaces the refusal."""
    asked: list[str] = []
    found = Outcome(2, crash="step: AssertionError: ", exception="AssertionError")

    def factory_for(name: str) -> Any:
        asked.append(name)
        return name

    monkeypatch.setattr("kvspec.adapters.targets.get_factory", factory_for)
    monkeypatch.setattr("kvspec.drivers.harness.run_ops", lambda *a, **k: found)
    refusal = Outcome(2, expectation="refused")
    assert history._judged_raw(OffloadConfig(), [], "checked", (), refusal, "vllm@0.23.0") == \
        ("raw:vllm@0.23.0", found, True)
    monkeypatch.setattr("kvspec.drivers.harness.run_ops", lambda *a, **k: Outcome(2))
    assert history._judged_raw(OffloadConfig(), [], "checked", (), refusal, "vllm@0.23.0") == \
        ("checked", refusal, False)
    assert asked == ["raw:vllm@0.23.0"] * 2


def test_history_raw_reaches_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: Any) -> Any:
        commands.append(cmd)
        return SimpleNamespace(returncode=0, stdout="")

    monkeypatch.setattr(history.subprocess, "run", fake_run)
    args = argparse.Namespace(budget=1.0, seed=0, out="x", raw=True, seeds=1, swarm=True, continue_=True)
    assert history._run_release("0.23.0", 0, args) == []
    assert commands[0][-1] == "--raw"
    history._run_release("0.23.0", 0, argparse.Namespace(**{**vars(args), "raw": False, "swarm": False}))
    assert commands[1][-1] == "--no-swarm" and "--raw" not in commands[1]


@pytest.mark.parametrize(("version", "kind", "what", "issue"), [
    ("0.19.1", "violation", "I8", "#41289 or #57816"),  # both causes are in 0.19.1's code
    ("0.23.0", "violation", "I8", "#57816"),  # the in-flight set (#41289's fix) is there
    ("0.31.0", "violation", "I10", "#57816"),
    ("0.33.0", "violation", "I10", "no public issue"),  # the resume fix is there
    ("0.23.0", "crash", "AssertionError", "#42571"),
    ("0.29.0", "crash", "AssertionError", "no public issue"),  # free_blocks block by block
    ("0.29.0", "violation", "C8", "#41704"),
    ("0.31.0", "violation", "C8", "no public issue"),  # the finish flush is there
    ("0.23.0", "violation", "I15", "no public issue"),  # no reset() before 0.24: nothing to match
    ("0.33.0", "violation", "C1", "FIXME (0.33.0)"),
])
def test_history_attributes_a_finding_to_the_issues_whose_cause_the_release_has(
        version: str, kind: str, what: str, issue: str) -> None:
    assert history.issue_for(version, kind, what) == issue
