"""The implementation's self-checks: every structure's ``_check()`` holds on a valid state and
fails on a broken one, and the stateful harness runs ``TensorOffloadScheduler._check()`` (which
calls them all) after every operation on an implementation target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import KVConnectorOutput, NewRequestData, SchedulerOutput
from kvspec.drivers.harness import make_state_machine
from kvspec.impl import make_scheduler
from kvspec.impl.free_list import FreeList
from kvspec.impl.keys import KeyTable
from kvspec.impl.repair.in_flight import InFlightKeys
from kvspec.impl.repair.index import LossIndex
from kvspec.impl.scheduler import TensorOffloadScheduler

CPU = torch.device("cpu")
CONFIG = OffloadConfig(block_size=4, num_gpu_blocks=24, num_cpu_blocks=8, max_num_batched_tokens=16)


def _broken(check: Callable[[], None], corrupt: Callable[[], None], message: str) -> None:
    check()  # the valid state passes
    corrupt()
    with pytest.raises(AssertionError, match=message):
        check()


class _Req:
    def __init__(self, rid: str, hashes: list[str], computed: int) -> None:
        self.request_id = rid
        self.block_hashes = hashes
        self.num_computed_tokens = computed
        self.num_output_placeholders = 0
        self.skip_reading_prefix_cache = False
        self.num_tokens = 4 * len(hashes) + 1


def _stored_scheduler(policy: str = "repair") -> TensorOffloadScheduler:
    """A scheduler with one registered request whose two blocks are being stored."""
    s = make_scheduler(replace(CONFIG, policy=policy))
    gpu = s.gpu_pool.get_new_blocks(2)
    for i, b in enumerate(gpu):
        s.gpu_pool.insert_block_hash((f"h{i}", 0), b)
    req = _Req("a", ["h0", "h1"], 8)
    s.update_state_after_alloc(req, (gpu,), 0)
    s.build_connector_meta(SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", (gpu,))],
                                           num_scheduled_tokens={"a": 1}))
    assert s.store_events, "the step stored something"
    return s


@pytest.mark.parametrize("corrupt,message", [
    (lambda f: f.position.__setitem__(5, 99), "its pos is not"),
    (lambda f: setattr(f, "count", f.count + 1), "live entries"),
    (lambda f: f.ring.__setitem__(f.h, -1), "live entries"),
])
def test_free_list_check(corrupt: Callable[[FreeList], None], message: str) -> None:
    f = FreeList(8, torch.arange(1, 8), CPU)
    f.remove(torch.tensor([3]))
    _broken(f._check, lambda: corrupt(f), message)


@pytest.mark.parametrize("corrupt,message", [
    (lambda s: s.cpu_pool.index.first.__setitem__(int(s.cpu_pool.key.max()), -1), "chain head|two ends"),
    (lambda s: s.cpu_pool.index.first.__setitem__(-1, 3), "sentinel"),
    (lambda s: s.cpu_pool.index.nxt.__setitem__(int((s.cpu_pool.key >= 0).nonzero()[0]), 0), "in the chain"),
    (lambda s: s.cpu_pool.ref.__setitem__(int(s.cpu_pool.free.peek_head(1)), 1), "I1"),
    (lambda s: s.cpu_pool.key.__setitem__(0, int(s.cpu_pool.key.max())), "null block|chain"),
])
def test_block_pool_and_prefix_index_checks(corrupt: Callable[[TensorOffloadScheduler], None], message: str) -> None:
    s = _stored_scheduler()
    (e,) = s.store_events
    s.update_connector_output(KVConnectorOutput(completed_store_events={e: 1}))  # the CPU now caches two keys
    _broken(s.cpu_pool._check, lambda: corrupt(s), message)


@pytest.mark.parametrize("corrupt,message", [
    (lambda s: setattr(s.stores, "num_finished", 1), "finished count"),
    (lambda s: (s.stores._copy_hids([0]), s.stores.hid_tab.__setitem__((0, 0), 77)), "hash id tensor"),
    (lambda s: s.stores.rid.__setitem__(0, "b"), "names another request"),
    (lambda s: s.stores.length.__setitem__((0, 0), s.stores.capacity + 1), "capacity"),
])
def test_store_table_check(corrupt: Callable[[TensorOffloadScheduler], None], message: str) -> None:
    s = _stored_scheduler()
    _broken(s.stores._check, lambda: corrupt(s), message)


def test_key_table_check() -> None:
    keys = KeyTable(2, CPU)
    keys.key_id(("x", 1))
    keys.key_id(("odd", 7))
    keys.seeds(torch.tensor([0, 2]))
    _broken(keys._check, lambda: keys._seed_t.__setitem__(0, 1), "seed tensor")
    keys._seed_t[0] = keys._seeds[0]
    _broken(keys._check, lambda: keys._hid.__setitem__("x", 1), "hash ids")
    keys._hid["x"] = 0
    kid = keys.key_id(("x", 1))
    assert keys.key_text(kid) == "x:1"
    keys._check()
    _broken(keys._check, lambda: keys._key_texts.__setitem__(kid, "x:0"), "key texts")


def test_in_flight_mirror_check() -> None:
    keys = KeyTable(1, CPU)
    for h in "abcd":
        keys.hash_id(h)
    mirror = InFlightKeys(keys, CPU)
    mirror.add(torch.tensor([1, 3, 3]))
    mirror.complete(torch.tensor([3]))
    assert dict(mirror.counts) == {1: 1, 3: 1}
    _broken(mirror._check, lambda: mirror.per_key().__setitem__(2, 1), "disagree")


@pytest.mark.parametrize("corrupt,message", [
    (lambda ix: ix.owners.__setitem__(5, {}), "empty owner list"),
    (lambda ix: ix.lost.__setitem__(("a", 1, 0), 4), "lost record"),
    (lambda ix: ix.owners.__setitem__(7, {("a", 0, 2): None}), "indexes"),
])
def test_loss_index_check(corrupt: Callable[[LossIndex], None], message: str) -> None:
    index = LossIndex()
    index.register_all([4, 9], [("a", 0, 0), ("a", 1, 1)])
    index.lost[("a", 0, 0)] = 4
    index.retire(4)
    _broken(lambda: index._check(2), lambda: corrupt(index), message)


@pytest.mark.parametrize("policy", ["baseline", "repair"])
@pytest.mark.parametrize("corrupt,message", [
    (lambda s: s.in_flight.__setitem__(20, True), "in-flight set"),
    (lambda s: s.stores.events[0].add(99), "does not list it"),
    (lambda s: s.store_event_pending_counts.__setitem__(0, 5), "pending count"),
])
def test_scheduler_check(policy: str, corrupt: Callable[[TensorOffloadScheduler], None], message: str) -> None:
    s = _stored_scheduler(policy)
    _broken(s._check, lambda: corrupt(s), message)


def test_repair_policy_check_calls_its_structures() -> None:
    s = _stored_scheduler("repair")
    _broken(s._check, lambda: s.policy.in_flight_keys.per_key().__setitem__(0, 3), "in-flight keys")


def test_the_stateful_harness_runs_the_self_check_on_impl_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = TensorOffloadScheduler._check

    def counting(self: TensorOffloadScheduler) -> None:
        calls.append(1)
        original(self)

    monkeypatch.setattr(TensorOffloadScheduler, "_check", counting)
    machine = make_state_machine(make_scheduler, policy="repair")
    run_state_machine_as_test(machine, settings=settings(max_examples=3, stateful_step_count=8, deadline=None,
                                                         database=None, phases=[Phase.generate],
                                                         suppress_health_check=list(HealthCheck)))
    assert calls, "the harness never called the implementation's _check"


def test_the_stateful_harness_fails_on_a_broken_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror that forgets its tensor side leaves every snapshot as it was; only the self-check sees it."""

    def dict_only(self: InFlightKeys, kids: torch.Tensor) -> None:
        for k in kids.tolist():
            self._counts[k] = self._counts.get(k, 0) + 1

    monkeypatch.setattr(InFlightKeys, "add", dict_only)
    machine = make_state_machine(make_scheduler, policy="repair")
    with pytest.raises(AssertionError, match="in-flight keys"):
        run_state_machine_as_test(machine, settings=settings(max_examples=30, stateful_step_count=20, deadline=None,
                                                             database=None, phases=[Phase.generate],
                                                             suppress_health_check=list(HealthCheck)))
