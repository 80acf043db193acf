"""C3, C5 and C6 are measured by the engine, not read from the policy's own counters.

Each known-bug variant that breaks one of them is made to *lie*: after every call it zeroes
the counters the policy keeps about itself (re-stores planned, self-evictions, useful entries
evicted). The old checks read exactly those counters and would pass it; the catalogue must
still find the bug, by what the engine observed in the connector metadata and the CPU pool.
A further variant amplifies (re-stores keys that are still cached) and reports no re-store.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvspec.contract.config import OffloadConfig
from kvspec.drivers.engine import Engine
from kvspec.drivers.harness import VIOLATION, fuzz
from kvspec.model.block_pool import BlockPool
from kvspec.model.bugs import RepairNoSameStepPin, RepairNoVictimRule
from kvspec.model.repair import Candidate, Finishing, RepairPolicy
from kvspec.model.scheduler import OffloadScheduler, PolicyFactory
from kvspec.oracle.catalogue import check

SELF_REPORTS = ("restores_last_plan", "lost_keys_at_repair", "self_evictions", "useful_evicted_by_restores")


class LyingScheduler(OffloadScheduler):
    """Every entry point ends by zeroing the counters its policy keeps about itself."""

    def _zero(self) -> None:
        for name in SELF_REPORTS:
            setattr(self.policy, name, 0)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        self._zero()
        return meta

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        out = super().request_finished_all_groups(request, block_ids)
        self._zero()
        return out


class AmplifyingRepair(RepairPolicy):
    """Re-stores, besides the lost records, owned keys below a cursor that are still cached."""

    def repair_candidates(self, finishing: Finishing | None) -> list[Candidate]:
        out = super().repair_candidates(finishing)
        wanted = {c.key for c in out}
        for key, owners in list(self.owners.items()):
            if key in wanted or self.sched.cpu_pool.get_one_block(key) is None or self.in_flight_keys.get(key):
                continue
            for rid, g, p in owners:
                st = self.sched.store_state(rid)
                if st is None or st.finished or p >= st.num_stored_blocks[g]:
                    continue
                if finishing is not None and rid != finishing.rid:
                    continue
                b = self.owned_block(st, st.block_ids[g], g, p)
                if b is not None:
                    out.append(Candidate((rid, g, p), b, key))
                    break
        return out


def _factory(policy: PolicyFactory, scheduler: type[OffloadScheduler] = LyingScheduler) -> Any:
    def make(cfg: OffloadConfig) -> OffloadScheduler:
        cfg = replace(cfg, policy="repair", lazy_offload=False)
        return scheduler(cfg, BlockPool(cfg.num_gpu_blocks, "gpu", cfg.num_groups), policy)
    return make


@pytest.mark.parametrize(("cls", "inv"), [(RepairNoSameStepPin, "C5"), (RepairNoVictimRule, "C6"),
                                          (AmplifyingRepair, "C3")])
def test_a_lying_policy_is_still_caught(cls: type[RepairPolicy], inv: str) -> None:
    found = None
    for seed in range(4):
        res = fuzz(_factory(cls), "repair", 20.0, seed, oracle=inv)
        if res.found:
            found = res
            break
    assert found is not None and found.kind == VIOLATION, f"{cls.__name__} escaped {inv}"
    assert found.outcome is not None and found.outcome.violation is not None
    assert found.outcome.violation.id == inv
    # the policy's own counters say nothing happened, so the old self-reported checks would pass it
    assert found.trace is not None
    engine = Engine(_factory(cls)(found.trace.config))
    for op in found.trace.ops:
        engine.apply(op)
        ps = engine.snapshot()["scheduler"]["policy_state"]
        assert all(ps[name] == 0 for name in SELF_REPORTS)
    assert {v.id for v in check(engine.snapshot(), [inv])} == {inv}  # found by the catalogue (once or more)


@pytest.mark.parametrize("seconds", [3.0, pytest.param(10.0, marks=pytest.mark.deep)], ids=["3s", "10s"])
def test_the_correct_policy_passes_the_observed_checks(seconds: float) -> None:
    res = fuzz(_factory(RepairPolicy, OffloadScheduler), "repair", seconds, 7, oracle="C3,C5,C6")
    assert not res.found, res.outcome.describe() if res.outcome else ""
    assert res.rare["re-store"] > 0 and res.rare["eviction under a live cursor"] > 0


# -- observe_plan on hand-built snapshots: every fact, exactly -------------------------------------


def _snap(cursors: dict[str, int], cached: dict[str, list[int]], stores: dict[str, list[int]],
          finished: tuple[str, ...] = ()) -> dict[str, Any]:
    """A step's view: A holds GPU blocks 5, 6, 7 (keys h0..h2), B holds 5, 6 (the same prefix)."""
    tables = {"A": [5, 6, 7], "B": [5, 6]}
    return {
        "engine": {"config": {"groups": [{"kind": "full", "sliding_window": 0}], "block_size": 16},
                   "requests": {rid: {"status": "running", "table": [t], "block_hashes": ["h0", "h1", "h2"][: len(t)],
                                      "num_computed_tokens": 16 * len(t)} for rid, t in tables.items()}},
        "scheduler": {"reqs_to_store": {rid: {"num_stored_blocks": [c], "finished": rid in finished,
                                              "block_ids": [tables[rid]]} for rid, c in cursors.items()},
                      "store_events": {e: {"gpu": g, "cpu": [1] * len(g)} for e, g in stores.items()},
                      "pending_finished_stores": []},
        "gpu_pool": {"block_hash": [None] * 5 + ["h0:0", "h1:0", "h2:0"]},
        "cpu_pool": {"cached": cached},
    }


def test_observe_plan_names_what_the_step_passed_and_evicted() -> None:
    from kvspec.oracle.catalogue import observe_plan

    # A's cursor passes h0 and h1 (cached) and stores h2; the allocation evicts h0, which B
    # owns below its cursor with no parent: a live, useful entry taken by new work
    pre = _snap({"A": 0, "B": 2}, {"h0:0": [1], "h1:0": [2]}, {})
    post = _snap({"A": 3, "B": 2}, {"h1:0": [2]}, {"0": [7]})
    plan = observe_plan(pre, post, [7])
    assert plan == {"copies": 1, "new_work_copies": 1, "restore_copies": 0, "lost_keys": 1, "unlost_restores": [],
                    "judged_cached_evicted": ["h0:0"], "live_useful_evicted": ["h0:0"]}
    # a re-store: h0 and h2 are lost (owned below a cursor, covered by nothing); h0 is copied
    # from block 5, which both A and B hold only below their cursors
    pre = _snap({"A": 3, "B": 2}, {"h1:0": [2]}, {})
    post = _snap({"A": 3, "B": 2}, {"h1:0": [2]}, {"0": [5]})
    plan = observe_plan(pre, post, [5])
    assert (plan["restore_copies"], plan["lost_keys"], plan["unlost_restores"]) == (1, 2, [])
    # re-storing h1, which is still cached, is amplification
    post = _snap({"A": 3, "B": 2}, {"h1:0": [2]}, {"0": [6]})
    assert observe_plan(pre, post, [6])["unlost_restores"] == ["h1:0"]


def test_observe_plan_for_a_finish_flush() -> None:
    from kvspec.oracle.catalogue import observe_plan

    # A finishes with cursor 0: the flush copies h2 (block 7), so it passed h0 and h1; h0 was
    # cached before and is gone after: judged cached and evicted by the flush's own allocation
    pre = _snap({"A": 0}, {"h0:0": [1], "h1:0": [2]}, {})
    post = _snap({"A": 0}, {"h1:0": [2]}, {}, finished=("A",))
    post["scheduler"]["pending_finished_stores"] = [{"gpu": [7], "cpu": [1]}]
    assert observe_plan(pre, post, [7], finishing="A")["judged_cached_evicted"] == ["h0:0"]
    # a flush that copied nothing passed nothing
    assert observe_plan(pre, post, [], finishing="A")["judged_cached_evicted"] == []
