"""vLLM 0.33.0's own ``CPUOffloadingManager`` (target ``vllm-offloading``) against the model.

* **Lockstep**: random traces from the connector-shaped generator (``kvspec.drivers.offloading``),
  LRU and ARC, store thresholds with small trackers, failed stores, resets; after every
  operation the model's and vLLM's results and full snapshots (chunks and slots, free list,
  counters, LRU ranks or ARC lists and target, offer counts, every request's access record)
  must be equal. ``KVSPEC_VLLM_OFFLOADING_TRACES`` traces of 100 operations (default 1,000).
* **The lockstep can fail**: a model whose LRU touch forgets to reverse its keys, and one whose
  ARC adapts the target the wrong way, each diverge from vLLM within those traces.
* **Verdicts**: vLLM satisfies every O-invariant on the same traces; the known-bug traces are
  clean on vLLM (the finding is the variant's, not the trace's); a refused call leaves vLLM's
  own snapshot unchanged.

Marked ``vllm``; skipped, with the reason, where vLLM 0.33.0 cannot be imported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from offloading_kit import generated_snapshots

from kvspec.adapters.targets import get_offloading_factory
from kvspec.contract.errors import ConfigError, KVSpecError
from kvspec.contract.offloading import OffloadingConfig
from kvspec.contract.snapshot_io import snapshot_issues
from kvspec.drivers import offloading_fuzz as ofz
from kvspec.model.offloading import OffloadingManager, make_offloading_manager
from kvspec.model.offloading.arc import ARCPolicy
from kvspec.model.offloading.lru import LRUPolicy
from kvspec.model.offloading.policy import RequestContext
from kvspec.oracle.catalogue import OFFLOADING_CATALOGUE


def _available() -> tuple[bool, str]:
    try:
        get_offloading_factory("vllm-offloading")(OffloadingConfig())
    except ConfigError as exc:
        return False, str(exc)
    return True, ""


VLLM_OK, VLLM_WHY = _available()
if os.environ.get("KVSPEC_REQUIRE_VLLM") == "1" and not VLLM_OK:
    raise RuntimeError(f"KVSPEC_REQUIRE_VLLM=1 but {VLLM_WHY}")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not VLLM_OK, reason=f"vLLM 0.33.0 is not importable here: {VLLM_WHY}")]

TRACES = int(os.environ.get("KVSPEC_VLLM_OFFLOADING_TRACES", "1000"))
LENGTH = 100


def _vllm(config: OffloadingConfig) -> Any:
    return get_offloading_factory("vllm-offloading")(config)


def test_vllm_offloading_manager_agrees_with_the_model_after_every_operation() -> None:
    res = ofz.lockstep(make_offloading_manager, _vllm, budget=1e9, seed=0, max_traces=TRACES, length=LENGTH)
    print(f"\nvllm-offloading lockstep: {res.traces} traces, {res.ops} operations, divergence: {res.divergence}")
    assert res.divergence is None
    assert res.ops > res.traces * LENGTH * 0.9


def test_vllm_satisfies_every_offloading_invariant_on_generated_traces() -> None:
    res = ofz.fuzz(_vllm, budget=20.0, seed=5, oracle=tuple(OFFLOADING_CATALOGUE))
    assert res.finding is None and res.traces > 20


def test_every_snapshot_of_vllms_manager_follows_the_offloading_format() -> None:
    """What check-snapshot reads: vLLM's own manager, read by the adapter after every operation of
    generated traces (both policies, thresholds), has no format issue."""
    checked = 0
    for seed, op, snap in generated_snapshots(_vllm, range(12)):
        assert snapshot_issues(snap) == [], (seed, op)
        checked += 1
    assert checked > 300


class _LRUTouchUnreversed(LRUPolicy):
    def touch(self, keys: list[Any], ctx: RequestContext) -> None:
        self._refresh(list(keys))


class _ARCAdaptsBackwards(ARCPolicy):
    def _adapt(self, key: Any) -> None:
        b1, b2 = self.b1, self.b2
        self.b1, self.b2 = b2, b1
        try:
            super()._adapt(key)
        finally:
            self.b1, self.b2 = b1, b2


class _TouchModel(OffloadingManager):
    POLICY_CLASSES = {"lru": _LRUTouchUnreversed, "arc": ARCPolicy}  # noqa: RUF012


class _AdaptModel(OffloadingManager):
    POLICY_CLASSES = {"lru": LRUPolicy, "arc": _ARCAdaptsBackwards}  # noqa: RUF012


@pytest.mark.parametrize("broken", [_TouchModel, _AdaptModel], ids=["lru-touch-order", "arc-adapt-direction"])
def test_the_lockstep_catches_a_model_rule_changed_on_purpose(broken: type[OffloadingManager]) -> None:
    res = ofz.lockstep(broken, _vllm, budget=1e9, seed=0, max_traces=300)
    assert res.divergence is not None, f"{broken.__name__} was not told apart from vLLM"


@pytest.mark.parametrize("path", sorted((Path(__file__).parent / "traces" / "offloading").glob("*.jsonl")),
                         ids=lambda p: p.stem)
def test_known_bug_traces_are_clean_on_vllm(path: Path) -> None:
    with path.open() as fh:
        tr = ofz.read_trace(fh)
    out = ofz.run(_vllm, tr.config, tr.ops, tuple(OFFLOADING_CATALOGUE))
    assert out.finding is None and not out.rejected


def test_a_refused_call_leaves_vllm_unchanged() -> None:
    t = _vllm(OffloadingConfig(num_chunks=2))
    t.on_new_request("a")
    out = t.prepare_store("a", [("h0", 0), ("h1", 0)])
    t.complete_store("a", [("h0", 0)])
    assert out is not None
    before = t.snapshot()
    for call in (lambda: t.prepare_load("a", [("h0", 0), ("h1", 0)]),  # h1 still being stored
                 lambda: t.complete_load("a", [("h0", 0)]),  # no load in flight
                 lambda: t.prepare_store("a", [("h2", 0), ("h2", 0)]),
                 lambda: t.lookup("nobody", ("h0", 0)),
                 lambda: t.on_new_request("a")):
        with pytest.raises(KVSpecError):
            call()
        assert t.snapshot() == before


@pytest.mark.parametrize("path", sorted((Path(__file__).parent / "traces" / "offloading_history").rglob("*.jsonl")),
                         ids=lambda p: f"{p.parent.name}/{p.stem[-14:]}")
def test_history_findings_of_old_releases_are_clean_on_vllm_0_33(path: Path) -> None:
    """Each finding of `kvspec history --manager offloading` on 0.23.0 or 0.29.0 does not
    reproduce on 0.33.0: no invariant breaks (0.33.0 may refuse a call earlier, when its answers
    differ from the old release's; scripts/offloading-history-matrix.py shows which)."""
    with path.open() as fh:
        tr = ofz.read_trace(fh)
    out = ofz.run(_vllm, tr.config, tr.ops, tuple(OFFLOADING_CATALOGUE))
    assert out.finding is None
