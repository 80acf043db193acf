"""The error contract, once, for every target: bad input is refused with a ``KVSpecError`` subclass,
a message that says what was wrong, and no change at all.

``ErrorContract`` is a test mixin: a test class that sets ``factory`` (and ``policy``) inherits one
test per case of ``CASES``. Each case builds a fresh ``Scene`` (a target driven into a state worth
protecting: requests running, prefixes cached on CPU in two KV groups, a store in flight, CPU hits
pinned, a load sent), runs its ``prepare`` step if it has one, makes one bad call, and must see

* the expected ``KVSpecError`` subclass, with a message matching the case's pattern and under
  ``MAX_MESSAGE`` characters, even for a 5 MB bad value;
* the engine's snapshot (the target's, plus the engine's view) and the GPU pool's own view
  (ref counts, keys, free queue) exactly as they were before the call, the engine's last
  operation untouched, and the snapshot still valid (``kvspec.contract.snapshot_io``);
* whatever else the test class observes of the target's own objects (``ErrorContract.observe``:
  for real vLLM, its requests, blocks and manager fields, read from vLLM's objects) unchanged.

The cases cover every entry point of a target (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
``request_finished_all_groups``, ``request_finished``), of its GPU pool and of the engine
(``Engine.apply``): wrong types, missing fields, out-of-range and huge values, and the rules that
read the state (a second load, an unsent load, a load into a missing block). The model, the
implementation and the vLLM adapter share the checks of ``kvspec.contract.checks``, so one
pattern per case holds for all of them.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import (
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
from kvspec.contract.snapshot_io import snapshot_issues
from kvspec.contract.types import CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput
from kvspec.drivers.engine import Engine

HUGE = "r" * 5_000_000  # a 5 MB value: never echoed whole
MAX_MESSAGE = 300
BLOCK = 16
GPU_BLOCKS = 32
GROUPS = 2
PREFIX_TOKENS = 2 * BLOCK  # what the CPU holds of family 1 (request a's prompt): two full blocks
UNKNOWN = "nobody"
NEVER_ISSUED = 10_000  # a store event id no scene reaches


def scene_config(policy: str) -> OffloadConfig:
    return OffloadConfig(block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=16, policy=policy,
                         groups=(KVGroup(),) * GROUPS)


@dataclass
class FakeRequest:
    """A ``RequestView`` whose fields a case can spoil one by one."""

    request_id: Any = "fake"
    num_tokens: Any = 40
    num_computed_tokens: Any = 0
    num_output_placeholders: Any = 0
    skip_reading_prefix_cache: Any = False
    block_hashes: Any = field(default_factory=list)


# The engine's part of every scene: z finished; a and b running with their prefixes stored on CPU;
# c running with its store in flight; w, w2, l and u waiting (family 1 shares a's prefix).
SCENE_OPS: list[dict[str, Any]] = [
    {"op": "add", "rid": "z", "family": 4, "prompt_len": 20, "max_tokens": 1},
    {"op": "step", "admit": ["z"]},
    {"op": "finish", "rid": "z"},
    {"op": "add", "rid": "a", "family": 1, "prompt_len": 40, "max_tokens": 8},
    {"op": "add", "rid": "b", "family": 2, "prompt_len": 20, "max_tokens": 8},
    {"op": "step", "admit": ["a", "b"]},
    {"op": "step"},
    "report every event",
    {"op": "add", "rid": "c", "family": 3, "prompt_len": 36, "max_tokens": 8},
    {"op": "step", "admit": ["c"]},
    {"op": "step"},
    {"op": "add", "rid": "w", "family": 1, "prompt_len": 40},
    {"op": "add", "rid": "w2", "family": 1, "prompt_len": 65},
    {"op": "add", "rid": "l", "family": 1, "prompt_len": 40},
    {"op": "add", "rid": "u", "family": 1, "prompt_len": 40},
]


class Scene:
    """A target in a busy state, built through the engine (``SCENE_OPS``), then by direct calls:
    w and w2 have looked up (and pinned) their CPU hit of a's prefix, l's load of it is
    registered and sent. ``event`` is c's store event, in flight."""

    def __init__(self, factory: Callable[[OffloadConfig], Any], policy: str) -> None:
        self.config = scene_config(policy)
        self.target = factory(self.config)
        self.pool = self.target.gpu_pool
        self.engine = Engine(self.target)
        for op in SCENE_OPS:
            if op == "report every event":
                for event in list(self.engine.reports_left):
                    self.engine.apply({"op": "report", "event": event})
            else:
                self.engine.apply(op)
        assert self.engine.reports_left, "c's store must be in flight"
        self.event = next(iter(self.engine.reports_left))
        assert self.target.get_num_new_matched_tokens(self.req("w"), 0) == (PREFIX_TOKENS, True)
        assert self.target.get_num_new_matched_tokens(self.req("w2"), 0) == (PREFIX_TOKENS, True)
        self.l_table = self.register_load("l")
        self.target.build_connector_meta(SchedulerOutput())  # ships l's load

    def req(self, rid: str) -> Any:
        return self.engine.requests[rid]

    def register_load(self, rid: str) -> tuple[list[int], ...]:
        """Look up ``rid``'s CPU hit and accept it whole into new GPU blocks (the load is not sent)."""
        assert self.target.get_num_new_matched_tokens(self.req(rid), 0) == (PREFIX_TOKENS, True)
        table = tuple(self.pool.get_new_blocks(3) for _ in range(GROUPS))
        self.target.update_state_after_alloc(self.req(rid), table, PREFIX_TOKENS)
        return table

    def block(self, want: Callable[[int], bool]) -> int:
        """The first non-null GPU block ``want`` accepts."""
        return next(b for b in range(1, GPU_BLOCKS) if want(b))

    def free_block(self) -> int:
        return next(iter(self.pool.free_queue))

    def held_once(self) -> int:
        return self.block(lambda b: self.pool.ref_cnt[b] == 1)

    def keyed_block(self) -> int:
        return self.block(lambda b: self.pool.block_hash[b] is not None)

    def unkeyed_block(self) -> int:
        return self.block(lambda b: self.pool.block_hash[b] is None)

    def view(self) -> Any:
        """Everything a rejected call must leave as it was."""
        p = self.pool
        return (self.engine.snapshot(), list(p.ref_cnt), list(p.block_hash), list(p.free_queue),
                p.get_num_free_blocks(), self.engine.last_op, self.engine.last_result)


@dataclass(frozen=True)
class Case:
    """One bad call on a scene, the error it must raise and a pattern its message must match
    (``re.search``); ``prepare`` puts the scene in the state the case needs, before the snapshot."""

    name: str
    call: Callable[[Scene], Any]
    error: type[KVSpecError]
    match: str
    prepare: Callable[[Scene], Any] | None = None


def meta(**fields: Any) -> Callable[[Scene], Any]:
    return lambda s: s.target.build_connector_meta(SchedulerOutput(**fields))


def report(**fields: Any) -> Callable[[Scene], Any]:
    return lambda s: s.target.update_connector_output(KVConnectorOutput(**fields))


def event_report(count: Any, *more: tuple[Any, Any]) -> Callable[[Scene], Any]:
    """Worker reports for c's in-flight store event (``count`` ranks), plus ``more`` (event, count)."""
    return lambda s: s.target.update_connector_output(KVConnectorOutput(
        completed_store_events={s.event: count, **dict(more)}))


def cached(req_ids: Any = ("c",), new_block_ids: Any = (None,), resumed: Any = None) -> CachedRequestData:
    """c scheduled with no new block ids, one field replaced (tuples are given as lists)."""
    return CachedRequestData(req_ids=list(req_ids) if isinstance(req_ids, tuple) else req_ids,
                             new_block_ids=list(new_block_ids) if isinstance(new_block_ids, tuple) else new_block_ids,
                             resumed_req_ids=set() if resumed is None else resumed)


def lookup(rid: str | Any, computed: Any) -> Callable[[Scene], Any]:
    return lambda s: s.target.get_num_new_matched_tokens(s.req(rid) if isinstance(rid, str) else rid, computed)


def alloc(rid: str | Any, table: Any, external: Any) -> Callable[[Scene], Any]:
    return lambda s: s.target.update_state_after_alloc(s.req(rid) if isinstance(rid, str) else rid, table, external)


def finish_all(rid: str | Any, table: Any) -> Callable[[Scene], Any]:
    return lambda s: s.target.request_finished_all_groups(s.req(rid) if isinstance(rid, str) else rid, table)


def engine_op(**op: Any) -> Callable[[Scene], Any]:
    return lambda s: s.engine.apply(dict(op))


SCHEDULER_OUTPUT_CASES = [
    Case("meta: None", lambda s: s.target.build_connector_meta(None), InvalidOperationError,
         r"^build_connector_meta: expected a SchedulerOutput, got None"),
    Case("meta: a string", lambda s: s.target.build_connector_meta("step"), InvalidOperationError,
         r"expected a SchedulerOutput, got 'step'"),
    Case("meta: scheduled tokens a list", meta(num_scheduled_tokens=[16]), InvalidOperationError,
         r"num_scheduled_tokens must be a dict request id -> tokens, got \[16\]"),
    Case("meta: scheduled tokens int key", meta(num_scheduled_tokens={3: 16}), InvalidOperationError,
         r"num_scheduled_tokens: a request id must be a str, got 3"),
    Case("meta: scheduled tokens str value", meta(scheduled_cached_reqs=cached(), num_scheduled_tokens={"c": "16"}),
         InvalidCountError, r"num_scheduled_tokens\[c\] must be a non-negative int, got '16'"),
    Case("meta: scheduled tokens bool value", meta(num_scheduled_tokens={"c": True}), InvalidCountError,
         r"num_scheduled_tokens\[c\] must be a non-negative int, got True"),
    Case("meta: negative scheduled tokens", meta(scheduled_cached_reqs=cached(), num_scheduled_tokens={"c": -1}),
         InvalidCountError, r"num_scheduled_tokens\[c\] must be a non-negative int, got -1"),
    Case("meta: scheduled tokens huge id", meta(num_scheduled_tokens={HUGE: -1}), InvalidCountError,
         r"num_scheduled_tokens\['rrrr.*\(5000000 chars\)\] must be a non-negative int"),
    Case("meta: finished ids ints", meta(finished_req_ids=[1, 2]), InvalidOperationError,
         r"finished_req_ids: a request id must be a str, got 1"),
    Case("meta: finished ids None", meta(finished_req_ids=None), InvalidOperationError,
         r"finished_req_ids must be a set or list of request ids, got None"),
    Case("meta: preempted ids ints", meta(preempted_req_ids={1}), InvalidOperationError,
         r"preempted_req_ids: a request id must be a str, got 1"),
    Case("meta: preempted ids a string", meta(preempted_req_ids="a"), InvalidOperationError,
         r"preempted_req_ids must be a set or list of request ids, got 'a'"),
    Case("meta: preempted ids nested", meta(preempted_req_ids=[["a"]]), InvalidOperationError,
         r"preempted_req_ids: a request id must be a str, got \['a'\]"),
    Case("meta: new reqs None", meta(scheduled_new_reqs=None), InvalidOperationError,
         r"scheduled_new_reqs must be a list of NewRequestData, got None"),
    Case("meta: new req not a record", meta(scheduled_new_reqs=[3]), InvalidOperationError,
         r"scheduled_new_reqs\[0\]: expected a NewRequestData, got 3 \(no field req_id\)"),
    Case("meta: new req id an int", meta(scheduled_new_reqs=[NewRequestData(7, ([], []))]), InvalidOperationError,
         r"scheduled_new_reqs\[0\]\.req_id must be a str, got 7"),
    Case("meta: new req huge id, bad block", meta(scheduled_new_reqs=[NewRequestData(HUGE, ([99], []))]),
         InvalidBlockError, r"scheduler output for 'rrrr.*\(5000000 chars\): group 0 block id 99 out of range 0\.\.31"),
    Case("meta: new req group not a list", meta(scheduled_new_reqs=[NewRequestData("n", ([1], 5))]),
         GroupCountError, r"scheduler output for n: group 1 must be a list of block ids, got 5"),
    Case("meta: cached reqs None", meta(scheduled_cached_reqs=None), InvalidOperationError,
         r"scheduled_cached_reqs: expected a CachedRequestData, got None \(no field req_ids\)"),
    Case("meta: cached ids a tuple", meta(scheduled_cached_reqs=CachedRequestData(req_ids=("c",))),  # type: ignore[arg-type]
         InvalidOperationError, r"scheduled_cached_reqs\.req_ids must be a list of str, got \('c',\)"),
    Case("meta: cached id an int", meta(scheduled_cached_reqs=cached(req_ids=[1])), InvalidOperationError,
         r"scheduled_cached_reqs\.req_ids: a request id must be a str, got 1"),
    Case("meta: cached block ids a dict", meta(scheduled_cached_reqs=cached(new_block_ids={})), InvalidOperationError,
         r"scheduled_cached_reqs\.new_block_ids must be a list, got \{\}"),
    Case("meta: cached resumed None", meta(scheduled_cached_reqs=CachedRequestData(["c"], [None], None)),  # type: ignore[arg-type]
         InvalidOperationError, r"scheduled_cached_reqs\.resumed_req_ids must be a set or list of request ids"),
    Case("meta: cached ids and tables misaligned", meta(scheduled_cached_reqs=cached(new_block_ids=[None, None])),
         InvalidOperationError, r"scheduled_cached_reqs lists 1 request id\(s\) but 2 block-id entries"),
    Case("meta: cached block out of range", meta(scheduled_cached_reqs=cached(new_block_ids=[([99], [])])),
         InvalidBlockError, r"scheduler output for c: group 0 block id 99 out of range 0\.\.31"),
    Case("meta: cached table of 1 group", meta(scheduled_cached_reqs=cached(new_block_ids=[([1],)])),
         GroupCountError, r"scheduler output for c: expected block ids for 2 group\(s\), got 1"),
    Case("meta: cached table of 3 groups", meta(scheduled_cached_reqs=cached(new_block_ids=[([1], [2], [3])])),
         GroupCountError, r"scheduler output for c: expected block ids for 2 group\(s\), got 3"),
]

CONNECTOR_OUTPUT_CASES = [
    Case("report: None", lambda s: s.target.update_connector_output(None), InvalidOperationError,
         r"update_connector_output: expected a KVConnectorOutput, got None"),
    Case("report: finished_recving None", report(finished_recving=None), InvalidOperationError,
         r"finished_recving must be a set or list of request ids, got None"),
    Case("report: finished_recving a string", report(finished_recving="a"), InvalidOperationError,
         r"finished_recving must be a set or list of request ids, got 'a'"),
    Case("report: finished_recving ints", report(finished_recving={3}), InvalidOperationError,
         r"finished_recving: a request id must be a str, got 3"),
    Case("report: finished_recving huge id", report(finished_recving={HUGE}), UnknownRequestError,
         r"finished_recving names 'rrrr.*\(5000000 chars\), which has no load"),
    Case("report: unknown load beside a sent one", report(finished_recving={"l", UNKNOWN}), UnknownRequestError,
         r"finished_recving names 'nobody', which has no load"),
    Case("report: events a list", lambda s: s.target.update_connector_output(KVConnectorOutput(
        completed_store_events=[s.event])), InvalidOperationError,  # type: ignore[arg-type]
         r"completed_store_events must be a dict event id -> worker count, got \[\d+\]"),
    Case("report: event id a str", lambda s: s.target.update_connector_output(KVConnectorOutput(
        completed_store_events={str(s.event): 1})), InvalidOperationError,  # type: ignore[dict-item]
         r"completed_store_events: an event id must be an int, got '\d+'"),
    Case("report: event id a bool", report(completed_store_events={True: 1}), InvalidOperationError,
         r"completed_store_events: an event id must be an int, got True"),
    Case("report: good event, bad id beside it", event_report(1, ("x", 1)), InvalidOperationError,
         r"completed_store_events: an event id must be an int, got 'x'"),
    Case("report: unknown store event", report(completed_store_events={NEVER_ISSUED: 1}), UnknownEventError,
         r"store event 10000 was never issued"),
    Case("report: unknown event beside a good one", event_report(1, (NEVER_ISSUED, 1)), UnknownEventError,
         r"store event 10000 was never issued"),
    Case("report: negative event id", report(completed_store_events={-1: 1}), UnknownEventError,
         r"store event -1 was never issued"),
    Case("report: worker count above world size", event_report(2), InvalidCountError,
         r"worker count for store event \d+ = 2 exceeds 1"),
    Case("report: negative worker count", event_report(-1), InvalidCountError,
         r"worker count for store event \d+ must be a non-negative int, got -1"),
    Case("report: zero worker count", event_report(0), InvalidOperationError,
         r"worker count for store event \d+ is 0"),
    Case("report: worker count a str", event_report("1"), InvalidCountError,
         r"worker count for store event \d+ must be a non-negative int, got '1'"),
    Case("report: worker count huge str", event_report(HUGE), InvalidCountError,
         r"must be a non-negative int, got 'rrrr.*\(5000000 chars\)"),
    Case("report: unsent load cannot complete", report(finished_recving={"u"}), InvalidOperationError,
         r"finished_recving names 'u', whose load was never sent", prepare=lambda s: s.register_load("u")),
]

REQUEST_CASES = [
    Case("lookup: None request", lookup(None, 0), InvalidOperationError,
         r"get_num_new_matched_tokens: expected a request \(an object with request_id\), got None"),
    Case("lookup: request id an int", lookup(FakeRequest(request_id=5), 0), InvalidOperationError,
         r"get_num_new_matched_tokens: request_id must be a str, got 5"),
    Case("lookup: hashes None", lookup(FakeRequest(block_hashes=None), 0), InvalidOperationError,
         r"request fake: block_hashes must be a list of str, got None"),
    Case("lookup: a hash not a str", lookup(FakeRequest(block_hashes=["ab", 3]), 0), InvalidOperationError,
         r"request fake: block_hashes\[1\] must be a str, got 3"),
    Case("lookup: num_tokens a str", lookup(FakeRequest(num_tokens="40"), 0), InvalidCountError,
         r"request fake: num_tokens must be a non-negative int, got '40'"),
    Case("lookup: skip flag a str", lookup(FakeRequest(skip_reading_prefix_cache="no"), 0), InvalidOperationError,
         r"request fake: skip_reading_prefix_cache must be a bool, got 'no'"),
    Case("lookup: huge id, bad num_tokens", lookup(FakeRequest(request_id=HUGE, num_tokens=-1), 0),
         InvalidCountError, r"request 'rrrr.*\(5000000 chars\): num_tokens must be a non-negative int, got -1"),
    Case("lookup: computed tokens a str", lookup("a", "0"), InvalidCountError,
         r"num_computed_tokens must be a non-negative int, got '0'"),
    Case("lookup: computed tokens huge str", lookup("a", HUGE), InvalidCountError,
         r"num_computed_tokens must be a non-negative int, got 'rrrr.*\(5000000 chars\)"),
    Case("lookup: negative computed tokens", lookup("w", -16), InvalidCountError,
         r"num_computed_tokens must be a non-negative int, got -16"),
    Case("lookup: computed beyond the request", lookup("w", 48), InvalidCountError,
         r"num_computed_tokens = 48 exceeds 40"),
    Case("alloc: None request", alloc(None, ([], []), 0), InvalidOperationError,
         r"update_state_after_alloc: expected a request \(an object with request_id\), got None"),
    Case("alloc: huge id, bad flag", alloc(FakeRequest(request_id=HUGE, skip_reading_prefix_cache=None), ([], []), 0),
         InvalidOperationError, r"request 'rrrr.*\(5000000 chars\): skip_reading_prefix_cache must be a bool"),
    Case("alloc: table of 1 group", alloc("w", ([4],), PREFIX_TOKENS), GroupCountError,
         r"update_state_after_alloc: expected block ids for 2 group\(s\), got 1"),
    Case("alloc: table not per group", alloc("w", 7, PREFIX_TOKENS), GroupCountError,
         r"update_state_after_alloc: expected block ids for 2 group\(s\), got int"),
    Case("alloc: group not a list", alloc(FakeRequest(), ([1], 5), 0), GroupCountError,
         r"update_state_after_alloc: group 1 must be a list of block ids, got 5"),
    Case("alloc: a group given as None", alloc("w", (None, []), PREFIX_TOKENS), GroupCountError,
         r"update_state_after_alloc: group 0 has no block ids \(None\)"),
    Case("alloc: block out of range", alloc("w", ([4, GPU_BLOCKS], []), PREFIX_TOKENS), InvalidBlockError,
         r"update_state_after_alloc: group 0 block id 32 out of range 0\.\.31"),
    Case("alloc: a bool block id", alloc(FakeRequest(), ([1, True], []), 0), InvalidBlockError,
         r"update_state_after_alloc: group 0 block id True out of range 0\.\.31"),
    Case("alloc: huge block id", alloc(FakeRequest(), ([HUGE], []), 0), InvalidBlockError,
         r"group 0 block id 'rrrr.*\(5000000 chars\) out of range"),
    Case("alloc: external tokens a float", alloc(FakeRequest(), ([], []), 16.0), InvalidCountError,
         r"num_external_tokens must be a non-negative int, got 16\.0"),
    Case("alloc: negative external tokens", alloc("w", ([10, 11, 12], [13, 14, 15]), -16), InvalidCountError,
         r"num_external_tokens must be a non-negative int, got -16"),
    Case("alloc: external beyond the request", alloc("w", ([10, 11, 12], [13, 14, 15]), 64), InvalidCountError,
         r"num_external_tokens = 64 exceeds 40"),
    Case("alloc: external off the block grid", alloc("w", ([10, 11, 12], [13, 14, 15]), 20), InvalidOperationError,
         r"w: num_external_tokens 20 is not a multiple of the block size 16"),
    Case("alloc: more external than the hit", alloc("w2", ([10, 11, 12, 13, 14], [15, 16, 17, 18, 19]), 48),
         InvalidOperationError, r"w2: accepted 48 external tokens of a 32-token hit"),
    Case("alloc: load without GPU blocks", alloc("w", ([10], [11]), PREFIX_TOKENS), InvalidOperationError,
         r"w: group 0 has no allocated GPU block at position 1 for the load"),
    Case("alloc: second load for a request", lambda s: s.target.update_state_after_alloc(
        s.req("l"), s.l_table, PREFIX_TOKENS), InvalidOperationError, r"l: a load is already registered",
         prepare=lambda s: s.target.get_num_new_matched_tokens(s.req("l"), 0)),
    Case("finish: None request", lambda s: s.target.request_finished(None), InvalidOperationError,
         r"request_finished: expected a request \(an object with request_id\), got None"),
    Case("finish: unhashable request id", lambda s: s.target.request_finished(FakeRequest(request_id=[])),
         InvalidOperationError, r"request_finished: request_id must be a str, got \[\]"),
    Case("finish all: None request", finish_all(None, ([], [])), InvalidOperationError,
         r"request_finished: expected a request \(an object with request_id\), got None"),
    Case("finish all: table None", finish_all("a", None), GroupCountError,
         r"request_finished: expected block ids for 2 group\(s\), got NoneType"),
    Case("finish all: table of 1 group", finish_all("c", ([],)), GroupCountError,
         r"request_finished: expected block ids for 2 group\(s\), got 1"),
    Case("finish all: a group given as None", finish_all("c", (None, [])), GroupCountError,
         r"request_finished: group 0 has no block ids \(None\)"),
    Case("finish all: block out of range", finish_all("c", ([1, 2, 300], [])), InvalidBlockError,
         r"request_finished: group 0 block id 300 out of range 0\.\.31"),
    Case("finish all: negative block id", finish_all("c", ([1, -1], [])), InvalidBlockError,
         r"request_finished: group 0 block id -1 out of range"),
    Case("finish all: block id a str", finish_all("a", (["1"], [])), InvalidBlockError,
         r"request_finished: group 0 block id '1' out of range"),
]

POOL_CASES = [
    Case("pool: alloc negative", lambda s: s.pool.get_new_blocks(-1), InvalidCountError,
         r"^gpu: cannot allocate -1 blocks$"),
    Case("pool: alloc a str", lambda s: s.pool.get_new_blocks("3"), InvalidCountError, r"cannot allocate '3' blocks"),
    Case("pool: alloc True", lambda s: s.pool.get_new_blocks(True), InvalidCountError,
         r"gpu: cannot allocate True blocks"),
    Case("pool: alloc a float", lambda s: s.pool.get_new_blocks(2.0), InvalidCountError, r"cannot allocate 2\.0"),
    Case("pool: alloc None", lambda s: s.pool.get_new_blocks(None), InvalidCountError, r"cannot allocate None"),
    Case("pool: alloc a huge str", lambda s: s.pool.get_new_blocks(HUGE), InvalidCountError,
         r"cannot allocate 'rrrr.*\(5000000 chars\) blocks"),
    Case("pool: alloc more than free", lambda s: s.pool.get_new_blocks(s.pool.get_num_free_blocks() + 1),
         OutOfBlocksError, r"gpu: cannot allocate \d+ blocks, only \d+ free"),
    Case("pool: alloc 10**30", lambda s: s.pool.get_new_blocks(10**30), OutOfBlocksError,
         r"cannot allocate 1000000000000000000000000000000 blocks, only \d+ free"),
    Case("pool: touch out of range", lambda s: s.pool.touch([2, GPU_BLOCKS]), InvalidBlockError,
         r"gpu: cannot touch block 32: ids are 0\.\.31"),
    Case("pool: touch a negative id", lambda s: s.pool.touch([-1]), InvalidBlockError, r"cannot touch block -1"),
    Case("pool: touch the null block", lambda s: s.pool.touch([2, 0]), InvalidBlockError,
         r"gpu: cannot touch the null block 0"),
    Case("pool: touch None", lambda s: s.pool.touch(None), InvalidBlockError,
         r"gpu: cannot touch None: expected an iterable of block ids"),
    Case("pool: touch an int", lambda s: s.pool.touch(5), InvalidBlockError, r"cannot touch 5: expected an iterable"),
    Case("pool: touch a dict", lambda s: s.pool.touch({1: 1}), InvalidBlockError, r"expected an iterable of block ids"),
    Case("pool: touch a huge id", lambda s: s.pool.touch([1, HUGE]), InvalidBlockError,
         r"cannot touch block 'rrrr.*\(5000000 chars\)"),
    Case("pool: touch a bool id", lambda s: s.pool.touch([True]), InvalidBlockError, r"cannot touch block True"),
    Case("pool: free the null block", lambda s: s.pool.free_blocks([2, 0]), InvalidBlockError,
         r"gpu: cannot free the null block 0"),
    Case("pool: free out of range", lambda s: s.pool.free_blocks([2, 99]), InvalidBlockError,
         r"cannot free block 99: ids are 0\.\.31"),
    Case("pool: free None", lambda s: s.pool.free_blocks(None), InvalidBlockError,
         r"gpu: cannot free None: expected an iterable of block ids"),
    Case("pool: free a string", lambda s: s.pool.free_blocks("12"), InvalidBlockError, r"cannot free '12'"),
    Case("pool: free a free block", lambda s: s.pool.free_blocks([s.free_block()]), DoubleFreeError,
         r"gpu: block \d+ freed 1 time\(s\) with ref count 0"),
    Case("pool: free twice in one call", lambda s: s.pool.free_blocks([s.held_once()] * 2), DoubleFreeError,
         r"gpu: block \d+ freed 2 time\(s\) with ref count 1"),
    Case("pool: evict out of range", lambda s: s.pool.evict_blocks([1, GPU_BLOCKS]), InvalidBlockError,
         r"cannot evict block 32"),
    Case("pool: evict None", lambda s: s.pool.evict_blocks(None), InvalidBlockError, r"cannot evict None"),
    Case("pool: register out of range", lambda s: s.pool.insert_block_hash(("ab", 0), GPU_BLOCKS), InvalidBlockError,
         r"gpu: cannot register block 32"),
    Case("pool: register the null block", lambda s: s.pool.insert_block_hash(("ab", 0), 0), InvalidBlockError,
         r"gpu: cannot register the null block 0"),
    Case("pool: register a second key", lambda s: s.pool.insert_block_hash(("abcd", 0), s.keyed_block()),
         InvalidBlockError, r"gpu: block \d+ already cached as [0-9a-f]+:\d, cannot also register abcd:0"),
    Case("pool: register a bare string key", lambda s: s.pool.insert_block_hash("nokey", 3), InvalidBlockError,
         r"cannot register key 'nokey': a key is a tuple \(block_hash: str, group: int\)"),
    Case("pool: register group 5 of 2", lambda s: s.pool.insert_block_hash(("h", 5), 14), InvalidBlockError,
         r"gpu: cannot register key \('h', 5\): group id 5 out of range 0\.\.1"),
    Case("pool: register group 2 of 2", lambda s: s.pool.insert_block_hash(("h", 2), s.unkeyed_block()),
         InvalidBlockError, r"group id 2 out of range 0\.\.1"),
    Case("pool: register group -1", lambda s: s.pool.insert_block_hash(("h", -1), s.unkeyed_block()),
         InvalidBlockError, r"group id -1 out of range"),
    Case("pool: register group a bool", lambda s: s.pool.insert_block_hash(("h", True), s.unkeyed_block()),
         InvalidBlockError, r"group id True out of range"),
    Case("pool: register hash an int", lambda s: s.pool.insert_block_hash((3, 0), s.unkeyed_block()),
         InvalidBlockError, r"cannot register key \(3, 0\): the block hash must be a str"),
    Case("pool: register empty hash", lambda s: s.pool.insert_block_hash(("", 0), s.unkeyed_block()),
         InvalidBlockError, r"the block hash must be a non-empty, one-line str"),
    Case("pool: register two-line hash", lambda s: s.pool.insert_block_hash(("a\nb", 0), s.unkeyed_block()),
         InvalidBlockError, r"the block hash must be a non-empty, one-line str"),
    Case("pool: register a list key", lambda s: s.pool.insert_block_hash(["h", 0], s.unkeyed_block()),
         InvalidBlockError, r"a key is a tuple"),
    Case("pool: register a 3-tuple key", lambda s: s.pool.insert_block_hash(("h", 0, 0), s.unkeyed_block()),
         InvalidBlockError, r"a key is a tuple"),
    Case("pool: register block a str", lambda s: s.pool.insert_block_hash(("ab", 0), "14"), InvalidBlockError,
         r"cannot register block '14'"),
    Case("pool: register huge hash, bad group", lambda s: s.pool.insert_block_hash((HUGE, 9), s.unkeyed_block()),
         InvalidBlockError, r"group id 9 out of range"),
    Case("pool: lookup hash None", lambda s: s.pool.get_cached_block(None, [0]), InvalidBlockError,
         r"gpu: cannot look up block hash None: it must be a str"),
    Case("pool: lookup groups None", lambda s: s.pool.get_cached_block("h", None), InvalidBlockError,
         r"cannot look up group ids None: expected a list of ints"),
    Case("pool: lookup group 5 of 2", lambda s: s.pool.get_cached_block("h", [0, 5]), InvalidBlockError,
         r"cannot look up: group id 5 out of range 0\.\.1"),
    Case("pool: lookup groups a string", lambda s: s.pool.get_cached_block("h", "0"), InvalidBlockError,
         r"cannot look up group ids '0'"),
    Case("pool: lookup group a float", lambda s: s.pool.get_cached_block("h", [0.0]), InvalidBlockError,
         r"group id 0\.0 out of range"),
    Case("pool: one block of a bare string", lambda s: s.pool.get_one_block("nokey"), InvalidBlockError,
         r"cannot look up key 'nokey'"),
    Case("pool: one block of group 7", lambda s: s.pool.get_one_block(("h", 7)), InvalidBlockError,
         r"group id 7 out of range 0\.\.1"),
]

ENGINE_CASES = [
    Case("engine: unknown op", engine_op(op="explode"), InvalidOperationError, r"unknown operation 'explode'"),
    Case("engine: op not a string", engine_op(op=3), InvalidOperationError, r"unknown operation 3"),
    Case("engine: bad argument", engine_op(op="add", rid="n", family=1, prompt_len=3, colour=1),
         InvalidOperationError, r"bad arguments for add"),
    Case("engine: missing argument", engine_op(op="finish"), InvalidOperationError, r"bad arguments for finish"),
    Case("engine: add twice", engine_op(op="add", rid="a", family=1, prompt_len=3), InvalidOperationError,
         r"request 'a' already exists"),
    Case("engine: add a finished id", engine_op(op="add", rid="z", family=1, prompt_len=3), InvalidOperationError,
         r"request 'z' already exists"),
    Case("engine: add an empty id", engine_op(op="add", rid="", family=1, prompt_len=3), InvalidOperationError,
         r"request id must be a string of 1\.\.256 characters"),
    Case("engine: add a huge id", engine_op(op="add", rid=HUGE, family=1, prompt_len=3), InvalidOperationError,
         r"request id must be a string of 1\.\.256 characters, got 'rrrr.*\(5000000 chars\)"),
    Case("engine: add a negative family", engine_op(op="add", rid="n", family=-1, prompt_len=3), InvalidCountError,
         r"family must be a non-negative int, got -1"),
    Case("engine: add an empty prompt", engine_op(op="add", rid="n", family=1, prompt_len=0), InvalidCountError,
         r"prompt_len must be >= 1"),
    Case("engine: add an oversized prompt", engine_op(op="add", rid="n", family=1, prompt_len=1 << 20),
         InvalidCountError, r"prompt_len = 1048576 exceeds 65536"),
    Case("engine: add negative max_tokens", engine_op(op="add", rid="n", family=1, prompt_len=3, max_tokens=-2),
         InvalidCountError, r"max_tokens must be a non-negative int, got -2"),
    Case("engine: add max_tokens 0", engine_op(op="add", rid="n", family=1, prompt_len=3, max_tokens=0),
         InvalidCountError, r"max_tokens must be >= 1 \(vLLM's SamplingParams\); 0 is read only from a trace of "
         r"format 1-3"),
    Case("engine: add a format mark of 4", engine_op(op="add", rid="n", family=1, prompt_len=3, max_tokens=0, format=4),
         InvalidCountError, r"format must be a trace format of 1\.\.3 \(which allowed max_tokens 0\), got 4"),
    Case("engine: step zero chunk", engine_op(op="step", chunk=0), InvalidCountError, r"chunk must be >= 1"),
    Case("engine: step negative chunk", engine_op(op="step", chunk=-5), InvalidCountError,
         r"chunk must be a non-negative int"),
    Case("engine: step bad resume", engine_op(op="step", admit=["w"], resume="mrv3"), InvalidOperationError,
         r"resume must be 'mrv1' or 'mrv2', got 'mrv3'"),
    Case("engine: step admit not a list", engine_op(op="step", admit="w"), InvalidOperationError,
         r"admit must be a list of request ids \(strings\), got 'w'"),
    Case("engine: admit an unknown request", engine_op(op="step", admit=["w", "ghost"]), UnknownRequestError,
         r"unknown request 'ghost'"),
    Case("engine: admit a running request", engine_op(op="step", admit=["w", "a"]), InvalidOperationError,
         r"cannot admit a: it is running"),
    Case("engine: admit twice", engine_op(op="step", admit=["w", "w"]), InvalidOperationError,
         r"admit and preempt must not repeat a request"),
    Case("engine: preempt a waiting request", engine_op(op="step", preempt=["w"]), InvalidOperationError,
         r"cannot preempt w: it is waiting"),
    Case("engine: preempt a finished request", engine_op(op="step", preempt=["z"]), InvalidOperationError,
         r"cannot preempt z: it is finished"),
    Case("engine: report an event not in flight", engine_op(op="report", event=NEVER_ISSUED), UnknownEventError,
         r"store event 10000 is not in flight"),
    Case("engine: report zero ranks", lambda s: s.engine.apply({"op": "report", "event": s.event, "count": 0}),
         InvalidCountError, r"count must be >= 1"),
    Case("engine: report too many ranks", lambda s: s.engine.apply({"op": "report", "event": s.event, "count": 2}),
         InvalidCountError, r"count = 2 exceeds 1"),
    Case("engine: load_done without a load", engine_op(op="load_done", rid="a"), UnknownRequestError,
         r"'a' has no load in flight"),
    Case("engine: finish an unknown request", engine_op(op="finish", rid="ghost"), UnknownRequestError,
         r"unknown request 'ghost'"),
    Case("engine: finish twice", engine_op(op="finish", rid="z"), InvalidOperationError, r"'z' already finished"),
]

CASES: list[Case] = SCHEDULER_OUTPUT_CASES + CONNECTOR_OUTPUT_CASES + REQUEST_CASES + POOL_CASES + ENGINE_CASES


class ErrorContract:
    """The error contract as a test mixin: set ``factory`` (a target factory, called with the
    scene's configuration) and ``policy`` in a ``Test...`` class to run every case on that target.

    The cases of one class share a scene while each leaves it unchanged, which is what each case
    proves (a failing case discards it, so the next one starts afresh); a case with a ``prepare``
    step gets a scene of its own."""

    factory: ClassVar[Callable[[OffloadConfig], Any]]
    policy: ClassVar[str] = "baseline"
    _shared: ClassVar[dict[type, Scene]] = {}

    @staticmethod
    def observe(scene: Scene) -> Any:
        """What else a refused call must leave as it was, read from the target's own objects."""
        return None

    def scene_for(self, case: Case) -> Scene:
        cls = type(self)
        if case.prepare is not None:
            scene = Scene(cls.factory, cls.policy)
            case.prepare(scene)
            return scene
        if cls not in ErrorContract._shared:
            ErrorContract._shared[cls] = Scene(cls.factory, cls.policy)
        return ErrorContract._shared[cls]

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_bad_input_is_refused_and_changes_nothing(self, case: Case) -> None:
        try:
            check_refused(self.scene_for(case), case, self.observe)
        except BaseException:
            ErrorContract._shared.pop(type(self), None)
            raise


def check_refused(scene: Scene, case: Case, observe: Callable[[Scene], Any] = ErrorContract.observe) -> None:
    """``case``'s call on ``scene`` raises its error with a matching, bounded message and leaves
    everything as it was (the state still follows the snapshot format), ``observe(scene)`` included."""
    before = copy.deepcopy(scene.view())
    seen = copy.deepcopy(observe(scene))
    with pytest.raises(KVSpecError) as info:
        case.call(scene)
    message = str(info.value)
    assert type(info.value) is case.error, f"raised {type(info.value).__name__}: {message[:200]}"
    assert re.search(case.match, message), f"message {message[:200]!r} does not match {case.match!r}"
    assert 0 < len(message) < MAX_MESSAGE, f"a message of {len(message)} characters"
    after = scene.view()
    assert after == before, "the rejected call changed the state"
    assert observe(scene) == seen, "the rejected call changed the target's own objects"
    assert snapshot_issues(after[0]) == [], "the state no longer follows the snapshot format"
