"""Bad input at the Python API is refused alike by the model and the implementation (issue 11).

A corpus of bad calls at every public entry point of a target (``build_connector_meta``,
``update_connector_output``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``request_finished_all_groups``, ``request_finished``) and of its GPU pool
(``get_new_blocks``, ``touch``, ``free_blocks``, ``evict_blocks``, ``insert_block_hash``,
``get_cached_block``, ``get_one_block``): wrong types, missing fields, out-of-range values
and huge values. Each call runs on the model and on the implementation, for every policy,
in a busy state (requests running, a prefix cached on CPU, a store in flight), and must

* raise the expected ``KVSpecError`` subclass, the same one on both sides;
* say so in a message under 300 characters, even for a 5 MB bad value;
* leave ``target.snapshot()`` and the GPU pool's own view (snapshot, ref counts, hashes)
  exactly as they were, and the engine's snapshot valid.

Plus ``kvspec bench`` and ``kvspec prove`` arguments that must exit 2 before any work.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvspec.cli import main
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import (
    GroupCountError,
    InvalidBlockError,
    InvalidCountError,
    InvalidOperationError,
    KVSpecError,
    OutOfBlocksError,
    UnknownRequestError,
)
from kvspec.contract.snapshot_io import snapshot_issues
from kvspec.contract.types import CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput
from kvspec.drivers.engine import Engine
from kvspec.impl import make_scheduler as make_impl
from kvspec.model import make_scheduler as make_model
from kvspec.model.block_pool import BlockPool

POLICIES = ("baseline", "signal-rescan", "repair")
HUGE = "r" * 5_000_000  # a 5 MB value: never echoed whole
MAX_MESSAGE = 300


@dataclass
class FakeRequest:
    """A ``RequestView`` whose fields a case can spoil one by one."""

    request_id: Any = "fake"
    num_tokens: Any = 40
    num_computed_tokens: Any = 0
    num_output_placeholders: Any = 0
    skip_reading_prefix_cache: Any = False
    block_hashes: Any = field(default_factory=list)


class Busy:
    """A target driven by the engine model into a state worth protecting: two KV groups,
    ``a`` and ``b`` running with their prefixes stored on CPU, ``c`` running with its
    store event in flight."""

    def __init__(self, side: str, policy: str) -> None:
        cfg = OffloadConfig(num_gpu_blocks=32, num_cpu_blocks=16, policy=policy, groups=(KVGroup(), KVGroup()))
        self.target = (make_model if side == "model" else make_impl)(cfg)
        e = Engine(self.target)
        e.apply({"op": "add", "rid": "a", "family": 1, "prompt_len": 40, "max_tokens": 8})
        e.apply({"op": "add", "rid": "b", "family": 2, "prompt_len": 20, "max_tokens": 8})
        e.apply({"op": "step", "admit": ["a", "b"]})
        e.apply({"op": "step"})
        for event in list(e.reports_left):
            e.apply({"op": "report", "event": event})
        e.apply({"op": "add", "rid": "c", "family": 3, "prompt_len": 36, "max_tokens": 8})
        e.apply({"op": "step", "admit": ["c"]})
        e.apply({"op": "step"})
        assert e.reports_left, "a store must be in flight"
        self.event = next(iter(e.reports_left))
        snap = self.target.snapshot()
        assert snap["cpu_pool"]["cached"], "a prefix must be cached on CPU"
        self.engine = e
        self.pool = self.target.gpu_pool

    def unhashed_block(self) -> int:
        """A non-null GPU block without a key (so a key refusal is about the key)."""
        return next(b for b in range(1, self.pool.num_blocks) if self.pool.block_hash[b] is None)

    def req(self, rid: str) -> Any:
        return self.engine.requests[rid]


Case = tuple[str, Callable[[Busy], Any], type[KVSpecError]]


_UNSET: Any = object()


def _cached(req_ids: Any = _UNSET, new_block_ids: Any = _UNSET, resumed: Any = _UNSET) -> CachedRequestData:
    """``a`` scheduled with no new ids, one field replaced."""
    return CachedRequestData(req_ids=["a"] if req_ids is _UNSET else req_ids,
                             new_block_ids=[None] if new_block_ids is _UNSET else new_block_ids,
                             resumed_req_ids=set() if resumed is _UNSET else resumed)


def _meta(b: Busy, **fields: Any) -> Any:
    return b.target.build_connector_meta(SchedulerOutput(**fields))


def _report(b: Busy, **fields: Any) -> Any:
    return b.target.update_connector_output(KVConnectorOutput(**fields))


SCHEDULER_OUTPUT_CASES: list[Case] = [
    ("meta: None", lambda b: b.target.build_connector_meta(None), InvalidOperationError),
    ("meta: a string", lambda b: b.target.build_connector_meta("step"), InvalidOperationError),
    ("meta: scheduled tokens a list", lambda b: _meta(b, num_scheduled_tokens=[16]), InvalidOperationError),
    ("meta: scheduled tokens int key", lambda b: _meta(b, num_scheduled_tokens={3: 16}), InvalidOperationError),
    ("meta: scheduled tokens str value", lambda b: _meta(b, scheduled_cached_reqs=_cached(),
                                                           num_scheduled_tokens={"a": "16"}), InvalidCountError),
    ("meta: scheduled tokens bool value", lambda b: _meta(b, num_scheduled_tokens={"a": True}), InvalidCountError),
    ("meta: scheduled tokens huge id", lambda b: _meta(b, num_scheduled_tokens={HUGE: -1}), InvalidCountError),
    ("meta: finished ids ints", lambda b: _meta(b, finished_req_ids=[1, 2]), InvalidOperationError),
    ("meta: finished ids None", lambda b: _meta(b, finished_req_ids=None), InvalidOperationError),
    ("meta: preempted ids ints", lambda b: _meta(b, preempted_req_ids={1}), InvalidOperationError),
    ("meta: preempted ids a string", lambda b: _meta(b, preempted_req_ids="a"), InvalidOperationError),
    ("meta: preempted ids nested", lambda b: _meta(b, preempted_req_ids=[["a"]]), InvalidOperationError),
    ("meta: new reqs None", lambda b: _meta(b, scheduled_new_reqs=None), InvalidOperationError),
    ("meta: new req not a record", lambda b: _meta(b, scheduled_new_reqs=[3]), InvalidOperationError),
    ("meta: new req id an int", lambda b: _meta(b, scheduled_new_reqs=[NewRequestData(7, ([], []))]),
     InvalidOperationError),
    ("meta: new req huge id, bad block", lambda b: _meta(b, scheduled_new_reqs=[NewRequestData(HUGE, ([99], []))]),
     InvalidBlockError),
    ("meta: new req group not a list", lambda b: _meta(b, scheduled_new_reqs=[NewRequestData("n", ([1], 5))]),
     GroupCountError),
    ("meta: cached reqs None", lambda b: _meta(b, scheduled_cached_reqs=None), InvalidOperationError),
    ("meta: cached ids a tuple", lambda b: _meta(b, scheduled_cached_reqs=_cached(req_ids=("a",))),
     InvalidOperationError),
    ("meta: cached id an int", lambda b: _meta(b, scheduled_cached_reqs=_cached(req_ids=[1])),
     InvalidOperationError),
    ("meta: cached block ids a dict", lambda b: _meta(b, scheduled_cached_reqs=_cached(new_block_ids={})),
     InvalidOperationError),
    ("meta: cached block ids wrong groups", lambda b: _meta(b, scheduled_cached_reqs=_cached(
        new_block_ids=[([1],)])), GroupCountError),
    ("meta: cached resumed None", lambda b: _meta(b, scheduled_cached_reqs=_cached(resumed=None)),
     InvalidOperationError),
]

CONNECTOR_OUTPUT_CASES: list[Case] = [
    ("report: None", lambda b: b.target.update_connector_output(None), InvalidOperationError),
    ("report: finished_recving None", lambda b: _report(b, finished_recving=None), InvalidOperationError),
    ("report: finished_recving a string", lambda b: _report(b, finished_recving="a"), InvalidOperationError),
    ("report: finished_recving ints", lambda b: _report(b, finished_recving={3}), InvalidOperationError),
    ("report: finished_recving huge id", lambda b: _report(b, finished_recving={HUGE}), UnknownRequestError),
    ("report: events a list", lambda b: _report(b, completed_store_events=[b.event]), InvalidOperationError),
    ("report: event id a str", lambda b: _report(b, completed_store_events={str(b.event): 1}),
     InvalidOperationError),
    ("report: event id a bool", lambda b: _report(b, completed_store_events={True: 1}), InvalidOperationError),
    ("report: worker count a str", lambda b: _report(b, completed_store_events={b.event: "1"}), InvalidCountError),
    ("report: worker count huge str", lambda b: _report(b, completed_store_events={b.event: HUGE}),
     InvalidCountError),
    ("report: good event, bad id beside it", lambda b: _report(b, completed_store_events={b.event: 1, "x": 1}),
     InvalidOperationError),
]

REQUEST_CASES: list[Case] = [
    ("lookup: None request", lambda b: b.target.get_num_new_matched_tokens(None, 0), InvalidOperationError),
    ("lookup: request id an int", lambda b: b.target.get_num_new_matched_tokens(FakeRequest(request_id=5), 0),
     InvalidOperationError),
    ("lookup: hashes None", lambda b: b.target.get_num_new_matched_tokens(FakeRequest(block_hashes=None), 0),
     InvalidOperationError),
    ("lookup: a hash not a str", lambda b: b.target.get_num_new_matched_tokens(
        FakeRequest(block_hashes=["ab", 3]), 0), InvalidOperationError),
    ("lookup: num_tokens a str", lambda b: b.target.get_num_new_matched_tokens(FakeRequest(num_tokens="40"), 0),
     InvalidCountError),
    ("lookup: skip flag a str", lambda b: b.target.get_num_new_matched_tokens(
        FakeRequest(skip_reading_prefix_cache="no"), 0), InvalidOperationError),
    ("lookup: computed tokens a str", lambda b: b.target.get_num_new_matched_tokens(b.req("a"), "0"),
     InvalidCountError),
    ("lookup: computed tokens huge str", lambda b: b.target.get_num_new_matched_tokens(b.req("a"), HUGE),
     InvalidCountError),
    ("lookup: huge id, bad num_tokens", lambda b: b.target.get_num_new_matched_tokens(
        FakeRequest(request_id=HUGE, num_tokens=-1), 0), InvalidCountError),
    ("alloc: None request", lambda b: b.target.update_state_after_alloc(None, ([], []), 0), InvalidOperationError),
    ("alloc: huge id, bad flag", lambda b: b.target.update_state_after_alloc(
        FakeRequest(request_id=HUGE, skip_reading_prefix_cache=None), ([], []), 0), InvalidOperationError),
    ("alloc: group not a list", lambda b: b.target.update_state_after_alloc(FakeRequest(), ([1], 5), 0),
     GroupCountError),
    ("alloc: huge block id", lambda b: b.target.update_state_after_alloc(FakeRequest(), ([HUGE], []), 0),
     InvalidBlockError),
    ("alloc: external tokens a float", lambda b: b.target.update_state_after_alloc(FakeRequest(), ([], []), 16.0),
     InvalidCountError),
    ("finish: None request", lambda b: b.target.request_finished(None), InvalidOperationError),
    ("finish: unhashable request id", lambda b: b.target.request_finished(FakeRequest(request_id=[])),
     InvalidOperationError),
    ("finish all: None request", lambda b: b.target.request_finished_all_groups(None, ([], [])),
     InvalidOperationError),
    ("finish all: block id a str", lambda b: b.target.request_finished_all_groups(b.req("a"), (["1"], [])),
     InvalidBlockError),
    ("finish all: table None", lambda b: b.target.request_finished_all_groups(b.req("a"), None), GroupCountError),
]

POOL_CASES: list[Case] = [
    ("pool: free None", lambda b: b.pool.free_blocks(None), InvalidBlockError),
    ("pool: free a string", lambda b: b.pool.free_blocks("12"), InvalidBlockError),
    ("pool: touch None", lambda b: b.pool.touch(None), InvalidBlockError),
    ("pool: touch an int", lambda b: b.pool.touch(5), InvalidBlockError),
    ("pool: touch a dict", lambda b: b.pool.touch({1: 1}), InvalidBlockError),
    ("pool: touch a huge id", lambda b: b.pool.touch([1, HUGE]), InvalidBlockError),
    ("pool: touch a bool id", lambda b: b.pool.touch([True]), InvalidBlockError),
    ("pool: evict None", lambda b: b.pool.evict_blocks(None), InvalidBlockError),
    ("pool: alloc a str", lambda b: b.pool.get_new_blocks("3"), InvalidCountError),
    ("pool: alloc negative", lambda b: b.pool.get_new_blocks(-1), InvalidCountError),
    ("pool: alloc True", lambda b: b.pool.get_new_blocks(True), InvalidCountError),
    ("pool: alloc a float", lambda b: b.pool.get_new_blocks(2.0), InvalidCountError),
    ("pool: alloc None", lambda b: b.pool.get_new_blocks(None), InvalidCountError),
    ("pool: alloc a huge str", lambda b: b.pool.get_new_blocks(HUGE), InvalidCountError),
    ("pool: alloc 10**30", lambda b: b.pool.get_new_blocks(10**30), OutOfBlocksError),
    ("pool: register a bare string key", lambda b: b.pool.insert_block_hash("nokey", 3), InvalidBlockError),
    ("pool: register group 5 of 2", lambda b: b.pool.insert_block_hash(("h", 5), 14), InvalidBlockError),
    ("pool: register group 2 of 2", lambda b: b.pool.insert_block_hash(("h", 2), b.unhashed_block()),
     InvalidBlockError),
    ("pool: register group -1", lambda b: b.pool.insert_block_hash(("h", -1), b.unhashed_block()),
     InvalidBlockError),
    ("pool: register group a bool", lambda b: b.pool.insert_block_hash(("h", True), b.unhashed_block()),
     InvalidBlockError),
    ("pool: register hash an int", lambda b: b.pool.insert_block_hash((3, 0), b.unhashed_block()),
     InvalidBlockError),
    ("pool: register empty hash", lambda b: b.pool.insert_block_hash(("", 0), b.unhashed_block()),
     InvalidBlockError),
    ("pool: register two-line hash", lambda b: b.pool.insert_block_hash(("a\nb", 0), b.unhashed_block()),
     InvalidBlockError),
    ("pool: register a list key", lambda b: b.pool.insert_block_hash(["h", 0], b.unhashed_block()),
     InvalidBlockError),
    ("pool: register a 3-tuple key", lambda b: b.pool.insert_block_hash(("h", 0, 0), b.unhashed_block()),
     InvalidBlockError),
    ("pool: register block a str", lambda b: b.pool.insert_block_hash(("h", 0), "14"), InvalidBlockError),
    ("pool: register huge hash, bad group", lambda b: b.pool.insert_block_hash((HUGE, 9), b.unhashed_block()),
     InvalidBlockError),
    ("pool: lookup hash None", lambda b: b.pool.get_cached_block(None, [0]), InvalidBlockError),
    ("pool: lookup groups None", lambda b: b.pool.get_cached_block("h", None), InvalidBlockError),
    ("pool: lookup group 5 of 2", lambda b: b.pool.get_cached_block("h", [0, 5]), InvalidBlockError),
    ("pool: lookup groups a string", lambda b: b.pool.get_cached_block("h", "0"), InvalidBlockError),
    ("pool: lookup group a float", lambda b: b.pool.get_cached_block("h", [0.0]), InvalidBlockError),
    ("pool: one block of a bare string", lambda b: b.pool.get_one_block("nokey"), InvalidBlockError),
    ("pool: one block of group 7", lambda b: b.pool.get_one_block(("h", 7)), InvalidBlockError),
]

CASES = SCHEDULER_OUTPUT_CASES + CONNECTOR_OUTPUT_CASES + REQUEST_CASES + POOL_CASES


def _pool_view(b: Busy) -> Any:
    p = b.pool
    return p.snapshot(), list(p.ref_cnt), list(p.block_hash), list(p.free_queue), p.get_num_free_blocks()


def _rejected(side: str, policy: str, call: Callable[[Busy], Any]) -> tuple[type[BaseException], str]:
    b = Busy(side, policy)
    before, pool_before = copy.deepcopy(b.target.snapshot()), copy.deepcopy(_pool_view(b))
    with pytest.raises(KVSpecError) as info:
        call(b)
    assert b.target.snapshot() == before, f"{side}: the rejected call changed the state"
    assert _pool_view(b) == pool_before, f"{side}: the rejected call changed the GPU pool"
    assert snapshot_issues(b.engine.snapshot()) == [], f"{side}: the state no longer validates"
    return info.type, str(info.value)


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 35
    assert len({name for name, _, _ in CASES}) == len(CASES)
    assert all(issubclass(err, KVSpecError) for _, _, err in CASES)


@pytest.mark.parametrize(("name", "call", "err"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("policy", POLICIES)
def test_bad_call_rejected_alike(policy: str, name: str, call: Callable[[Busy], Any], err: type[KVSpecError]) -> None:
    outcomes = {side: _rejected(side, policy, call) for side in ("model", "impl")}
    for side, (got, message) in outcomes.items():
        assert got is err, f"{side} raised {got.__name__}: {message[:200]}"
        assert 0 < len(message) < MAX_MESSAGE, f"{side}: message of {len(message)} characters"
    assert outcomes["model"][0] is outcomes["impl"][0]


def test_messages_name_what_was_wrong() -> None:
    """A few messages in full: they name the field and quote the bad value, bounded."""
    b = Busy("impl", "repair")
    with pytest.raises(InvalidOperationError, match=r"build_connector_meta: expected a SchedulerOutput, got None"):
        b.target.build_connector_meta(None)
    with pytest.raises(InvalidOperationError, match=r"finished_req_ids: a request id must be a str, got 1"):
        _meta(b, finished_req_ids=[1, 2])
    with pytest.raises(InvalidBlockError, match=r"gpu: cannot register key \('h', 5\): group id 5 out of range 0\.\.1"):
        b.pool.insert_block_hash(("h", 5), 14)
    with pytest.raises(UnknownRequestError, match=r"finished_recving names 'rrrr.*\(5000000 chars\), which has no"):
        _report(b, finished_recving={HUGE})
    with pytest.raises(InvalidCountError, match=r"gpu: cannot allocate True blocks"):
        b.pool.get_new_blocks(True)
    with pytest.raises(InvalidBlockError, match=r"gpu: cannot free None: expected an iterable of block ids"):
        b.pool.free_blocks(None)


def test_good_calls_still_accepted() -> None:
    """The checks refuse only what is wrong: the same shapes, well formed, go through alike."""
    for side in ("model", "impl"):
        b = Busy(side, "baseline")
        blk = b.unhashed_block()
        b.pool.insert_block_hash(("feed", 1), blk)  # group 1 of 2
        assert b.pool.get_cached_block("feed", [1]) == [blk]
        assert b.pool.get_cached_block("feed", (0, 1)) is None
        assert b.pool.get_one_block(("feed", 1)) == blk
        b.pool.touch(x for x in [blk])  # any iterable
        b.pool.free_blocks((blk,))
        b.target.build_connector_meta(SchedulerOutput(preempted_req_ids=frozenset(), finished_req_ids=["gone"]))
        b.target.update_connector_output(KVConnectorOutput(finished_recving=[], completed_store_events={}))
        assert b.target.get_num_new_matched_tokens(FakeRequest(block_hashes=("x", "y")), 0) == (0, False)


def test_pool_without_num_groups_bounds_no_group() -> None:
    """A pool built without ``num_groups`` (the tests' own pools) accepts any group id >= 0."""
    p = BlockPool(8, "gpu")
    (blk,) = p.get_new_blocks(1)
    p.insert_block_hash(("h", 5), blk)
    with pytest.raises(InvalidBlockError, match="group id -1"):
        p.insert_block_hash(("h", -1), blk)
    with pytest.raises(InvalidCountError, match="num_groups must be None or an int >= 1"):
        BlockPool(8, "gpu", 0)


# -- the command line: exit 2 before any work ------------------------------------------------------


def _exit_code(argv: list[str]) -> int:
    """``kvspec.cli.main``'s exit code: returned (a ``KVSpecError`` from the command) or raised
    by argparse as ``SystemExit``."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


BENCH_CASES = [
    (["--scale", "bad"], r"--scale 'bad': expected R,BPR,CPU"),
    (["--scale", "1,2"], r"--scale '1,2': expected R,BPR,CPU \(three integers\), got 2 field"),
    (["--scale", "0,0,0"], r"requests must be >= 1, got 0"),
    (["--scale", "4,0,100"], r"blocks per request must be >= 1, got 0"),
    (["--scale", "4,4,1"], r"CPU blocks must be >= 2, got 1"),
    (["--scale", "4,x,100"], r"three integers"),
    (["--scale", "100000,100,10"], r"--scale 100000,100,10 \(chat\): num_gpu_blocks"),
    (["--scale", "4,4,100", "--scale", HUGE], r"\(5000000 chars\)"),
    (["--device", "banana"], r"--device 'banana': not a device"),
    (["--device", "cuda:x"], r"not a device"),
    (["--device", "meta"], r"unsupported device type 'meta'"),
    (["--runs", "0"], r"--runs must be >= 1, got 0"),
    (["--steps", "-1"], r"--steps must be >= 1, got -1"),
    (["--threads", "0"], r"--threads must be 1\.\.1024, got 0"),
    (["--threads", str(1 << 40)], r"--threads must be"),
    (["--target", "nonsense"], r"unknown bench target 'nonsense'"),
    (["--target", "vllm", "--policy", "repair"], r"vLLM implements only the baseline policy"),
]


@pytest.mark.parametrize(("argv", "match"), BENCH_CASES, ids=[" ".join(a)[:40] for a, _ in BENCH_CASES])
def test_bench_bad_arguments_exit_2(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", *argv]) == 2
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvspec bench: "), cap.err[:300]
    assert len(lines[0]) < MAX_MESSAGE
    assert re.search(match, lines[0]), lines[0]
    assert cap.out == ""  # nothing measured


def test_bench_cuda_without_a_gpu_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    if _cuda_available():
        pytest.skip("this machine has a CUDA device")
    assert _exit_code(["bench", "--device", "cuda", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvspec bench: --device 'cuda': no CUDA device here (torch.cuda.is_available() is False)")


@pytest.mark.parametrize("argv", [["--runs", "x"], ["--steps", "1.5"], ["--workload", "nope"], ["--policy", "yolo"]])
def test_bench_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", *argv]) == 2
    assert "kvspec bench: error: argument" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["-k", "no-such-obligation"], r"kvspec prove: -k 'no-such-obligation' matches no obligation"),
    (["--list", "-k", "no-such-obligation"], r"matches no obligation"),
    (["--quick", "-k", "G=2"], r"matches no obligation \(of the --quick catalogue\)"),
    (["-k", ""], r"-k needs a non-empty TEXT"),
    (["-k", HUGE], r"\(5000000 chars\) matches no obligation"),
])
def test_prove_bad_selection_exits_2(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["prove", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    (line,) = cap.err.splitlines()
    assert len(line) < MAX_MESSAGE
    assert re.search(match, line), line


def test_prove_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["prove", "--list", "--json", "-k", "no-lookback"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all("no-lookback" in r["name"] for r in rows)
    assert {"name", "policy", "kind", "statement"} <= set(rows[0])
