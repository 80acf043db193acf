"""Bad input is rejected with a ``KVSpecError`` subclass and a clear message, and changes nothing.

For the pools, the scheduler (every policy) and the engine model: each kind of bad
input (unknown request or event, block id out of range, double free, freeing the
null block, negative or oversized counts, wrong group count, bad engine operations)
raises the expected error type with a message naming what was wrong, and the
snapshot taken (deep-copied) before the call equals the one after it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from scenario_kit import Req, alloc, complete, make, out, req, tokens

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import (
    ConfigError,
    DoubleFreeError,
    GroupCountError,
    InvalidBlockError,
    InvalidCountError,
    InvalidOperationError,
    KVSpecError,
    OutOfBlocksError,
    UnknownEventError,
    UnknownRequestError,
)
from kvspec.contract.types import KVConnectorOutput
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler
from kvspec.model.block_pool import BlockPool

POLICIES = ("baseline", "signal-rescan", "repair")


def assert_rejected(snapshot: Callable[[], Any], call: Callable[[], Any], err: type[KVSpecError],
                    match: str) -> None:
    before = copy.deepcopy(snapshot())
    with pytest.raises(err, match=match):
        call()
    assert snapshot() == before


# -- pools -----------------------------------------------------------------------------------


def _pool() -> BlockPool:
    p = BlockPool(8, "gpu")
    a = p.get_new_blocks(3)  # 1, 2, 3
    p.insert_block_hash(("h1", 0), a[0])
    p.free_blocks([a[0]])  # 1 is free and cached
    return p


POOL_CASES: list[tuple[str, Callable[[BlockPool], Any], type[KVSpecError], str]] = [
    ("alloc negative", lambda p: p.get_new_blocks(-1), InvalidCountError, r"cannot allocate -1 blocks"),
    ("alloc not an int", lambda p: p.get_new_blocks("2"), InvalidCountError, r"cannot allocate '2' blocks"),
    ("alloc oversized", lambda p: p.get_new_blocks(6), OutOfBlocksError, r"cannot allocate 6 blocks, only 5 free"),
    ("touch out of range", lambda p: p.touch([2, 8]), InvalidBlockError, r"cannot touch block 8: ids are 0..7"),
    ("touch negative id", lambda p: p.touch([-1]), InvalidBlockError, r"cannot touch block -1"),
    ("touch null", lambda p: p.touch([2, 0]), InvalidBlockError, r"cannot touch the null block 0"),
    ("free null", lambda p: p.free_blocks([2, 0]), InvalidBlockError, r"cannot free the null block 0"),
    ("free out of range", lambda p: p.free_blocks([2, 99]), InvalidBlockError, r"cannot free block 99"),
    ("double free of a free block", lambda p: p.free_blocks([2, 1]), DoubleFreeError,
     r"block 1 freed 1 time\(s\) with ref count 0"),
    ("double free in one call", lambda p: p.free_blocks([3, 2, 2]), DoubleFreeError,
     r"block 2 freed 2 time\(s\) with ref count 1"),
    ("register out of range", lambda p: p.insert_block_hash(("h", 0), 8), InvalidBlockError,
     r"cannot register block 8"),
    ("register null", lambda p: p.insert_block_hash(("h", 0), 0), InvalidBlockError,
     r"cannot register the null block 0"),
    ("register a second key", lambda p: p.insert_block_hash(("h2", 0), 1), InvalidBlockError,
     r"block 1 already cached as h1:0"),
    ("evict out of range", lambda p: p.evict_blocks([1, 8]), InvalidBlockError, r"cannot evict block 8"),
]


@pytest.mark.parametrize(("name", "call", "err", "match"), POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_pool_rejects(name: str, call: Callable[[BlockPool], Any], err: type[KVSpecError], match: str) -> None:
    p = _pool()
    assert_rejected(p.snapshot, lambda: call(p), err, match)


def test_pool_size_must_be_positive() -> None:
    with pytest.raises(InvalidCountError, match=r"num_blocks must be an int >= 1, got 0"):
        BlockPool(0, "cpu")


# -- scheduler -------------------------------------------------------------------------------


class Busy:
    """A scheduler with a cached prefix, a pin, a sent load and a store in flight."""

    def __init__(self, policy: str) -> None:
        s = make(policy, cpu=8)
        self.s = s
        self.r = req("R", 2, extra=1, family=1)
        gr = alloc(s, self.r, 3)
        self.r.num_computed_tokens = 33
        s.update_state_after_alloc(self.r, (gr,), 0)
        complete(s, s.build_connector_meta(out(new=[("R", gr)])).store_event)
        # L: same prompt, load registered and sent
        self.l_req = Req("L", list(self.r.tokens))
        assert s.get_num_new_matched_tokens(self.l_req, 0) == (32, True)
        self.gl = s.gpu_pool.get_new_blocks(3)
        s.update_state_after_alloc(self.l_req, (self.gl,), 32)
        # P, P2: same prefix, pinned at Phase A
        self.p = Req("P", list(self.r.tokens))
        assert s.get_num_new_matched_tokens(self.p, 0) == (32, True)
        self.p2 = Req("P2", tokens(1, 65))
        assert s.get_num_new_matched_tokens(self.p2, 0) == (32, True)
        # Q: a store in flight
        self.q = req("Q", 2, extra=1, family=2)
        gq = alloc(s, self.q, 3)
        self.q.num_computed_tokens = 33
        s.update_state_after_alloc(self.q, (gq,), 0)
        m = s.build_connector_meta(out(new=[("Q", gq)]))
        assert m.load_event == 0 and m.store_event == 1
        self.gq = gq


SCHED_CASES: list[tuple[str, Callable[[Busy], Any], type[KVSpecError], str]] = [
    ("lookup negative computed", lambda b: b.s.get_num_new_matched_tokens(b.p, -16), InvalidCountError,
     r"num_computed_tokens must be a non-negative int, got -16"),
    ("lookup computed beyond the request", lambda b: b.s.get_num_new_matched_tokens(b.p, 48), InvalidCountError,
     r"num_computed_tokens = 48 exceeds 33"),
    ("alloc wrong group count", lambda b: b.s.update_state_after_alloc(b.p, ([4], [5]), 32), GroupCountError,
     r"expected block ids for 1 group\(s\), got 2"),
    ("alloc ids not per group", lambda b: b.s.update_state_after_alloc(b.p, 7, 32), GroupCountError,
     r"expected block ids for 1 group\(s\), got int"),
    ("alloc block out of range", lambda b: b.s.update_state_after_alloc(b.p, ([4, 16],), 32), InvalidBlockError,
     r"group 0 block id 16 out of range 0..15"),
    ("alloc negative external", lambda b: b.s.update_state_after_alloc(b.p, ([10, 11, 12],), -16),
     InvalidCountError, r"num_external_tokens must be a non-negative int, got -16"),
    ("alloc external beyond the request", lambda b: b.s.update_state_after_alloc(b.p, ([10, 11, 12],), 64),
     InvalidCountError, r"num_external_tokens = 64 exceeds 33"),
    ("alloc external not block-aligned", lambda b: b.s.update_state_after_alloc(b.p, ([10, 11, 12],), 20),
     InvalidOperationError, r"num_external_tokens 20 is not a multiple of the block size 16"),
    ("alloc more external than the hit", lambda b: b.s.update_state_after_alloc(b.p2, ([10, 11, 12, 13, 14],), 48),
     InvalidOperationError, r"P2: accepted 48 external tokens of a 32-token hit"),
    ("alloc load without GPU blocks", lambda b: b.s.update_state_after_alloc(b.p, ([10],), 32),
     InvalidOperationError, r"P: group 0 has no allocated GPU block at position 1 for the load"),
    ("output block out of range", lambda b: b.s.build_connector_meta(out(cached=[("Q", [99])])),
     InvalidBlockError, r"scheduler output for Q: group 0 block id 99 out of range"),
    ("output wrong group count", lambda b: b.s.build_connector_meta(_two_groups("Q")), GroupCountError,
     r"scheduler output for Q: expected block ids for 1 group\(s\), got 2"),
    ("output negative tokens", lambda b: b.s.build_connector_meta(out(cached=[("Q", None)], sched={"Q": -1})),
     InvalidCountError, r"num_scheduled_tokens\[Q\] must be a non-negative int, got -1"),
    ("output ids and requests misaligned", lambda b: b.s.build_connector_meta(_misaligned("Q")),
     InvalidOperationError, r"scheduled_cached_reqs lists 1 request id\(s\) but 2 block-id entries"),
    ("alloc a group given as None", lambda b: b.s.update_state_after_alloc(b.p, (None,), 32), GroupCountError,
     r"update_state_after_alloc: group 0 has no block ids"),
    ("finish a group given as None", lambda b: b.s.request_finished_all_groups(b.q, (None,)), GroupCountError,
     r"request_finished: group 0 has no block ids"),
    ("unknown store event", lambda b: b.s.update_connector_output(KVConnectorOutput(
        completed_store_events={7: 1})), UnknownEventError, r"store event 7 was never issued"),
    ("unknown event beside a good one", lambda b: b.s.update_connector_output(KVConnectorOutput(
        completed_store_events={1: 1, 2: 1})), UnknownEventError, r"store event 2 was never issued"),
    ("negative event id", lambda b: b.s.update_connector_output(KVConnectorOutput(
        completed_store_events={-1: 1})), UnknownEventError, r"store event -1 was never issued"),
    ("worker count above world size", lambda b: b.s.update_connector_output(KVConnectorOutput(
        completed_store_events={1: 2})), InvalidCountError, r"worker count for store event 1 = 2 exceeds 1"),
    ("negative worker count", lambda b: b.s.update_connector_output(KVConnectorOutput(
        completed_store_events={1: -1})), InvalidCountError, r"must be a non-negative int, got -1"),
    ("zero worker count", lambda b: b.s.update_connector_output(KVConnectorOutput(
        completed_store_events={1: 0})), InvalidOperationError, r"worker count for store event 1 is 0"),
    ("unknown request in finished_recving", lambda b: b.s.update_connector_output(KVConnectorOutput(
        finished_recving={"L", "nobody"}, completed_store_events={1: 1})), UnknownRequestError,
     r"finished_recving names 'nobody', which has no load"),
    ("finish wrong group count", lambda b: b.s.request_finished_all_groups(b.q, ([], [])), GroupCountError,
     r"request_finished: expected block ids for 1 group\(s\), got 2"),
    ("finish block out of range", lambda b: b.s.request_finished_all_groups(b.q, ([1, 2, 300],)),
     InvalidBlockError, r"request_finished: group 0 block id 300 out of range"),
]


def _misaligned(rid: str) -> Any:
    o = out(cached=[(rid, None)])
    o.scheduled_cached_reqs.new_block_ids.append(None)
    return o


def _two_groups(rid: str) -> Any:
    o = out(cached=[(rid, None)])
    o.scheduled_cached_reqs.new_block_ids = [([1], [2])]
    return o


@pytest.mark.parametrize(("name", "call", "err", "match"), SCHED_CASES, ids=[c[0] for c in SCHED_CASES])
@pytest.mark.parametrize("policy", POLICIES)
def test_scheduler_rejects(policy: str, name: str, call: Callable[[Busy], Any], err: type[KVSpecError],
                           match: str) -> None:
    b = Busy(policy)
    assert_rejected(b.s.snapshot, lambda: call(b), err, match)


@pytest.mark.parametrize("policy", POLICIES)
def test_second_load_for_a_request_is_refused(policy: str) -> None:
    b = Busy(policy)
    again = Req("L", list(b.r.tokens))
    assert b.s.get_num_new_matched_tokens(again, 0) == (32, True)  # a new pin for L
    assert_rejected(b.s.snapshot, lambda: b.s.update_state_after_alloc(again, (b.gl,), 32),
                    InvalidOperationError, r"L: a load is already registered")


@pytest.mark.parametrize("policy", POLICIES)
def test_unsent_load_cannot_complete(policy: str) -> None:
    s = make(policy, cpu=8)
    r = req("R", 2, extra=1, family=1)
    g = alloc(s, r, 3)
    r.num_computed_tokens = 33
    s.update_state_after_alloc(r, (g,), 0)
    complete(s, s.build_connector_meta(out(new=[("R", g)])).store_event)
    l_req = Req("L", list(r.tokens))
    s.get_num_new_matched_tokens(l_req, 0)
    s.update_state_after_alloc(l_req, (s.gpu_pool.get_new_blocks(3),), 32)
    assert_rejected(s.snapshot, lambda: s.update_connector_output(KVConnectorOutput(finished_recving={"L"})),
                    InvalidOperationError, r"finished_recving names 'L', whose load was never sent")


@pytest.mark.parametrize(("cfg", "match"), [
    ({"policy": "nope"}, r"unknown policy 'nope'; known: baseline, signal-rescan, repair"),
    ({"policy": "repair", "lazy_offload": True}, r"lazy offload has no per-request store state"),
    ({"num_cpu_blocks": 1}, r"each pool needs at least 2 blocks"),
    ({"block_size": 0}, r"block_size must be >= 1, got 0"),
    ({"world_size": 0}, r"world_size must be >= 1, got 0"),
])
def test_config_rejected(cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_scheduler(OffloadConfig(**cfg))


# -- engine ----------------------------------------------------------------------------------


def _engine(policy: str) -> Engine:
    e = Engine(make_scheduler(OffloadConfig(num_cpu_blocks=8, policy=policy)))
    e.apply({"op": "add", "rid": "a", "family": 1, "prompt_len": 40, "max_tokens": 4})
    e.apply({"op": "add", "rid": "w", "family": 2, "prompt_len": 20})
    e.apply({"op": "add", "rid": "z", "family": 3, "prompt_len": 20, "max_tokens": 1})
    e.apply({"op": "step", "admit": ["a", "z"]})
    e.apply({"op": "finish", "rid": "z"})
    e.apply({"op": "step"})  # a's store event 0 in flight
    assert e.reports_left == {0: 1}
    return e


ENGINE_CASES: list[tuple[str, dict[str, Any], type[KVSpecError], str]] = [
    ("unknown op", {"op": "explode"}, InvalidOperationError, r"unknown operation 'explode'"),
    ("op not a string", {"op": 3}, InvalidOperationError, r"unknown operation 3"),
    ("bad argument", {"op": "add", "rid": "n", "family": 1, "prompt_len": 3, "colour": 1},
     InvalidOperationError, r"bad arguments for add"),
    ("missing argument", {"op": "finish"}, InvalidOperationError, r"bad arguments for finish"),
    ("add duplicate", {"op": "add", "rid": "a", "family": 1, "prompt_len": 3}, InvalidOperationError,
     r"request 'a' already exists"),
    ("add empty id", {"op": "add", "rid": "", "family": 1, "prompt_len": 3}, InvalidOperationError,
     r"request id must be a string of 1\.\.256 characters"),
    ("add negative family", {"op": "add", "rid": "n", "family": -1, "prompt_len": 3}, InvalidCountError,
     r"family must be a non-negative int, got -1"),
    ("add empty prompt", {"op": "add", "rid": "n", "family": 1, "prompt_len": 0}, InvalidCountError,
     r"prompt_len must be >= 1"),
    ("add oversized prompt", {"op": "add", "rid": "n", "family": 1, "prompt_len": 1 << 20}, InvalidCountError,
     r"prompt_len = 1048576 exceeds 65536"),
    ("add negative max_tokens", {"op": "add", "rid": "n", "family": 1, "prompt_len": 3, "max_tokens": -2},
     InvalidCountError, r"max_tokens must be a non-negative int, got -2"),
    ("step zero chunk", {"op": "step", "chunk": 0}, InvalidCountError, r"chunk must be >= 1"),
    ("step negative chunk", {"op": "step", "chunk": -5}, InvalidCountError, r"chunk must be a non-negative int"),
    ("step bad resume", {"op": "step", "admit": ["w"], "resume": "mrv3"}, InvalidOperationError,
     r"resume must be 'mrv1' or 'mrv2', got 'mrv3'"),
    ("step admit unknown", {"op": "step", "admit": ["w", "ghost"]}, UnknownRequestError,
     r"unknown request 'ghost'"),
    ("step admit running", {"op": "step", "admit": ["w", "a"]}, InvalidOperationError,
     r"cannot admit a: it is running"),
    ("step admit twice", {"op": "step", "admit": ["w", "w"]}, InvalidOperationError,
     r"admit and preempt must not repeat a request"),
    ("step preempt waiting", {"op": "step", "preempt": ["w"]}, InvalidOperationError,
     r"cannot preempt w: it is waiting"),
    ("step preempt finished", {"op": "step", "preempt": ["z"]}, InvalidOperationError,
     r"cannot preempt z: it is finished"),
    ("report unknown event", {"op": "report", "event": 5}, UnknownEventError, r"store event 5 is not in flight"),
    ("report zero", {"op": "report", "event": 0, "count": 0}, InvalidCountError, r"count must be >= 1"),
    ("report too many", {"op": "report", "event": 0, "count": 2}, InvalidCountError, r"count = 2 exceeds 1"),
    ("load_done without a load", {"op": "load_done", "rid": "a"}, UnknownRequestError,
     r"'a' has no load in flight"),
    ("finish unknown", {"op": "finish", "rid": "ghost"}, UnknownRequestError, r"unknown request 'ghost'"),
    ("finish twice", {"op": "finish", "rid": "z"}, InvalidOperationError, r"z already finished"),
]


@pytest.mark.parametrize(("name", "op", "err", "match"), ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
@pytest.mark.parametrize("policy", POLICIES)
def test_engine_rejects(policy: str, name: str, op: dict[str, Any], err: type[KVSpecError], match: str) -> None:
    e = _engine(policy)
    last = (e.last_op, e.last_result)
    assert_rejected(e.snapshot, lambda: e.apply(op), err, match)
    assert (e.last_op, e.last_result) == last


def test_rejections_are_kvspec_errors() -> None:
    for cases in (POOL_CASES, SCHED_CASES, ENGINE_CASES):
        for case in cases:
            assert issubclass(case[2], KVSpecError)
