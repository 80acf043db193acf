"""Bad configurations and bad trace files are refused cleanly (issue 11).

Every case raises the documented ``KVSpecError`` subclass (``ConfigError`` for the Python API,
``TraceError`` with the line number for a file), the message names the field or the line, and it
stays short even when the bad value is huge (a 5 MB string, an integer of thousands of digits).
Traces are read as a stream: a bad line is reported when it is reached, in bounded memory.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvspec.contract.config import MAX_POOL_BLOCKS, KVGroup, OffloadConfig
from kvspec.contract.errors import ConfigError, KVSpecError, TraceError
from kvspec.drivers import trace as trace_io

TRACES = Path(__file__).parent / "traces"
MSG_LIMIT = 300
HUGE = "x" * 5_000_000  # 5 MB
GOOD = OffloadConfig(policy="baseline").to_json()


def cfg_json(**kw: Any) -> dict[str, Any]:
    return {**GOOD, **kw}


def header(version: int = 1, **kw: Any) -> str:
    return json.dumps({"kvspec_trace": version, "config": GOOD, "seed": 0, **kw})


H1 = header()
ADD = json.dumps({"op": "add", "rid": "a", "family": 0, "prompt_len": 16})


def check_message(exc: KVSpecError, *words: str) -> None:
    msg = str(exc)
    assert len(msg) < MSG_LIMIT, f"message of {len(msg)} characters: {msg[:200]}"
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


# -- the configuration, through the Python API --------------------------------------------------

API_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("block_size str", lambda: OffloadConfig(block_size="16"), "block_size"),  # type: ignore[arg-type]
    ("block_size float", lambda: OffloadConfig(block_size=2.5), "block_size"),  # type: ignore[arg-type]
    ("block_size bool", lambda: OffloadConfig(block_size=True), "block_size"),
    ("block_size zero", lambda: OffloadConfig(block_size=0), "block_size"),
    ("block_size too big", lambda: OffloadConfig(block_size=1 << 13), "block_size"),
    ("world_size bool", lambda: OffloadConfig(world_size=True), "world_size"),
    ("world_size too big", lambda: OffloadConfig(world_size=65), "world_size"),
    ("world_size zero", lambda: OffloadConfig(world_size=0), "world_size"),
    ("lazy_offload str", lambda: OffloadConfig(lazy_offload="no", policy="baseline"),  # type: ignore[arg-type]
     "lazy_offload"),
    ("lazy_offload int", lambda: OffloadConfig(lazy_offload=1, policy="baseline"), "lazy_offload"),  # type: ignore[arg-type]
    ("lazy_offload with repair", lambda: OffloadConfig(lazy_offload=True, policy="repair"), "lazy_offload"),
    ("max_num_batched_tokens 0", lambda: OffloadConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
    ("max_num_batched_tokens -1", lambda: OffloadConfig(max_num_batched_tokens=-1), "max_num_batched_tokens"),
    ("max_num_batched_tokens too big", lambda: OffloadConfig(max_num_batched_tokens=(1 << 20) + 1),
     "max_num_batched_tokens"),
    ("num_gpu_blocks 10**12", lambda: OffloadConfig(num_gpu_blocks=10**12), "num_gpu_blocks"),
    ("num_cpu_blocks over the bound", lambda: OffloadConfig(num_cpu_blocks=MAX_POOL_BLOCKS + 1), "num_cpu_blocks"),
    ("num_cpu_blocks 5000 digits", lambda: OffloadConfig(num_cpu_blocks=10**5000), "num_cpu_blocks"),
    ("num_cpu_blocks 1", lambda: OffloadConfig(num_cpu_blocks=1), "num_cpu_blocks"),
    ("num_gpu_blocks float", lambda: OffloadConfig(num_gpu_blocks=16.0), "num_gpu_blocks"),  # type: ignore[arg-type]
    ("sliding_window float", lambda: KVGroup("sliding", 32.5), "sliding_window"),  # type: ignore[arg-type]
    ("sliding_window integral float", lambda: KVGroup("sliding", 32.0), "sliding_window"),  # type: ignore[arg-type]
    ("sliding_window bool", lambda: KVGroup("sliding", True), "sliding_window"),
    ("sliding_window zero", lambda: KVGroup("sliding", 0), "sliding_window"),
    ("sliding_window too big", lambda: KVGroup("sliding", 1 << 30), "sliding_window"),
    ("group kind unknown", lambda: KVGroup("banana"), "kind"),  # type: ignore[arg-type]
    ("group kind 5 MB", lambda: KVGroup(HUGE), "kind"),  # type: ignore[arg-type]
    ("groups a list", lambda: OffloadConfig(groups=[KVGroup()]), "groups"),  # type: ignore[arg-type]
    ("groups hold a str", lambda: OffloadConfig(groups=(KVGroup(), "full")), "groups[1]"),  # type: ignore[arg-type]
    ("groups empty", lambda: OffloadConfig(groups=()), "groups"),
    ("groups no full group", lambda: OffloadConfig(groups=(KVGroup("sliding", 8),)), "groups"),
    ("groups too many", lambda: OffloadConfig(groups=(KVGroup(),) * 9), "groups"),
    ("policy not a str", lambda: OffloadConfig(policy=5), "policy"),  # type: ignore[arg-type]
    ("policy unknown", lambda: OffloadConfig(policy="yolo"), "policy"),
    ("policy 5 MB", lambda: OffloadConfig(policy=HUGE), "policy"),
    ("replace re-validates", lambda: replace(OffloadConfig(), block_size="16"), "block_size"),
    # the strict reader
    ("json lazy_offload 'false'", lambda: OffloadConfig.from_json(cfg_json(lazy_offload="false")),
     "config.lazy_offload"),
    ("json sliding_window 32.5", lambda: OffloadConfig.from_json(
        cfg_json(groups=[{"kind": "full"}, {"kind": "sliding", "sliding_window": 32.5}])),
     "config.groups[1].sliding_window: expected an integer, got 32.5"),
    ("json block_size str", lambda: OffloadConfig.from_json(cfg_json(block_size="16")), "config.block_size"),
    ("json world_size float", lambda: OffloadConfig.from_json(cfg_json(world_size=1.0)), "config.world_size"),
    ("json unknown key", lambda: OffloadConfig.from_json(cfg_json(colour="blue")), "colour"),
    ("json unknown key 5 MB", lambda: OffloadConfig.from_json(cfg_json(**{HUGE: 1})), "unknown key"),
    ("json policy 5 MB", lambda: OffloadConfig.from_json(cfg_json(policy=HUGE)), "config.policy"),
    ("json not an object", lambda: OffloadConfig.from_json([1, 2]), "config"),  # type: ignore[arg-type]
    ("json missing block_size", lambda: OffloadConfig.from_json({"num_gpu_blocks": 16, "num_cpu_blocks": 5}),
     "config.block_size"),
    ("json groups an object", lambda: OffloadConfig.from_json(cfg_json(groups={"kind": "full"})), "config.groups"),
    ("json group not an object", lambda: OffloadConfig.from_json(cfg_json(groups=["full"])), "config.groups[0]"),
    ("json group unknown key", lambda: OffloadConfig.from_json(cfg_json(groups=[{"kind": "full", "w": 1}])),
     "config.groups[0]"),
    ("json group without kind", lambda: OffloadConfig.from_json(cfg_json(groups=[{"sliding_window": 4}])),
     "config.groups[0].kind"),
    ("json group kind a list", lambda: OffloadConfig.from_json(cfg_json(groups=[{"kind": []}])),
     "config.groups[0].kind"),
    ("json too many groups", lambda: OffloadConfig.from_json(cfg_json(groups=[{"kind": "full"}] * 10_000)),
     "config.groups"),
    ("json max_num_batched_tokens 0", lambda: OffloadConfig.from_json(cfg_json(max_num_batched_tokens=0)),
     "config.max_num_batched_tokens"),
]


@pytest.mark.parametrize(("make", "words"), [pytest.param(m, w, id=i) for i, m, w in API_CASES])
def test_bad_config_api(make: Callable[[], object], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        make()
    check_message(err.value, words)


def test_valid_configs_stay_valid() -> None:
    big = OffloadConfig(block_size=1 << 12, num_gpu_blocks=264_208, num_cpu_blocks=1_100_000, world_size=64,
                        max_num_batched_tokens=1 << 20, groups=(KVGroup(),) * 7 + (KVGroup("sliding", 1 << 20),))
    assert OffloadConfig.from_json(big.to_json()) == big
    lazy = OffloadConfig(lazy_offload=True, policy="baseline", groups=(KVGroup(), KVGroup("sliding", 6)))
    assert OffloadConfig.from_json(lazy.to_json()) == lazy
    # missing optional keys keep their defaults; an empty group list is one full-attention group
    assert OffloadConfig.from_json({"block_size": 16, "num_gpu_blocks": 16, "num_cpu_blocks": 5,
                                    "groups": []}) == OffloadConfig()
    assert OffloadConfig(groups=(KVGroup("full", 5),)).groups[0].sliding_window == 5  # ignored, as before


# -- the configuration and the rest of the header, in a trace file ------------------------------

HEADER_CASES: list[tuple[str, str, str]] = [
    ("version 0", json.dumps({"kvspec_trace": 0, "config": GOOD}), "version 0"),
    ("version -1", json.dumps({"kvspec_trace": -1, "config": GOOD}), "version -1"),
    ("version too new", json.dumps({"kvspec_trace": trace_io.TRACE_VERSION + 1, "config": GOOD}), "newer"),
    ("version str", json.dumps({"kvspec_trace": "1", "config": GOOD}), "version"),
    ("version bool", json.dumps({"kvspec_trace": True, "config": GOOD}), "version"),
    ("version 5000 digits", '{"kvspec_trace": ' + "9" * 4000 + ', "config": {}}', "version"),
    ("no header", json.dumps({"config": GOOD}), "header"),
    ("header a list", "[1, 2, 3]", "header"),
    ("config missing", json.dumps({"kvspec_trace": 1}), "config"),
    ("config a list", json.dumps({"kvspec_trace": 1, "config": [1]}), "config"),
    ("lazy_offload 'false'", header(config=cfg_json(lazy_offload="false")), "config.lazy_offload"),
    ("sliding_window 32.5", header(config=cfg_json(groups=[{"kind": "full"}, {"kind": "sliding",
                                                                              "sliding_window": 32.5}])),
     "config.groups[1].sliding_window: expected an integer, got 32.5"),
    ("block_size 10**12", header(config=cfg_json(num_gpu_blocks=10**12)), "config.num_gpu_blocks"),
    ("policy unknown", header(config=cfg_json(policy="magic")), "unknown policy"),
    ("config unknown key", header(config=cfg_json(extra=1)), "extra"),
    ("max_num_batched_tokens -1", header(config=cfg_json(max_num_batched_tokens=-1)),
     "config.max_num_batched_tokens"),
    ("target not a str", header(target=5), "header.target"),
    ("target too long", header(target="t" * 201), "header.target"),
    ("note not a str", header(note=["a"]), "header.note"),
    ("note too long", header(note="n" * 20_000), "header.note"),
    ("seed float", header(seed=1.5), "header.seed"),
    ("seed bool", header(seed=True), "header.seed"),
    ("v1 with oracle", header(1, oracle=["I1"]), "oracle"),
    ("v2 unknown key", header(2, colour="blue"), "colour"),
    ("v2 unknown key 500 kB", header(2, **{"k" * 500_000: 1}), "header has no key"),
    ("oracle not a list", header(2, oracle="I1"), "header.oracle"),
    ("oracle bad id", header(2, oracle=["I1", "X2"]), "header.oracle[1]"),
    ("oracle id 500 kB", header(2, oracle=["I" + "1" * 500_000]), "header.oracle[0]"),
    ("oracle id not a str", header(2, oracle=[3]), "header.oracle[0]"),
    ("finding not an object", header(2, finding="violation"), "header.finding"),
    ("finding bad kind", header(2, finding={"kind": "oops", "op_index": 0, "invariant": "I1"}),
     "header.finding.kind"),
    ("finding negative op_index", header(2, finding={"kind": "crash", "op_index": -1, "exception": "E"}),
     "header.finding.op_index"),
    ("finding op_index float", header(2, finding={"kind": "crash", "op_index": 1.0, "exception": "E"}),
     "header.finding.op_index"),
    ("finding without op_index", header(2, finding={"kind": "crash", "exception": "E"}),
     "header.finding.op_index"),
    ("finding unknown key", header(2, finding={"kind": "crash", "op_index": 0, "exception": "E", "x": 1}),
     "header.finding"),
    ("finding invariant bad", header(2, finding={"kind": "violation", "op_index": 0, "invariant": "nope"}),
     "header.finding.invariant"),
    ("violation without invariant", header(2, finding={"kind": "violation", "op_index": 0}),
     "header.finding.invariant"),
    ("crash without exception", header(2, finding={"kind": "crash", "op_index": 0}), "header.finding.exception"),
    ("crash exception 500 kB", header(2, finding={"kind": "crash", "op_index": 0, "exception": "E" * 500_000}),
     "header.finding.exception"),
]


@pytest.mark.parametrize(("text", "words"), [pytest.param(t, w, id=i) for i, t, w in HEADER_CASES])
def test_bad_header(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text + "\n" + ADD + "\n")
    for load in (lambda: trace_io.read(path), lambda: trace_io.loads(text + "\n"), lambda: trace_io.open_trace(path)):
        with pytest.raises(TraceError) as err:
            load()
        assert err.value.line == 1
        check_message(err.value, "line 1", words)


# -- operation lines --------------------------------------------------------------------------

LINE_CASES: list[tuple[str, str, str]] = [
    ("op a list", '{"op": []}', "op must be an operation name"),
    ("op an object", '{"op": {"a": 1}}', "op must be an operation name"),
    ("op missing", '{"rid": "a"}', "\"op\""),
    ("op unknown", '{"op": "explode"}', "unknown operation"),
    ("op 500 kB", json.dumps({"op": "x" * 500_000}), "unknown operation"),
    ("deep arrays", "[" * 1000 + "]" * 1000, "nesting too deep"),
    ("deep objects", '{"op": ' + '{"a": ' * 1000 + "1" + "}" * 1001, "nesting too deep"),
    ("deep arrays unclosed", "[" * 100_000, "nesting too deep"),
    ("5 MB rid", json.dumps({"op": "add", "rid": HUGE, "family": 0, "prompt_len": 16}), "longer than"),
    ("5 MB line of spaces", " " * 5_000_000, "longer than"),
    ("invalid JSON", '{"op": "add", "rid": "a"', "invalid JSON"),
    ("integer of 5000 digits", '{"op": "report", "event": ' + "9" * 5000 + "}", "invalid JSON"),
    ("integer of 4000 digits", '{"op": "report", "event": ' + "9" * 4000 + "}", "report.event"),
    ("int arg a float", '{"op": "report", "event": 1.5}', "report.event"),
    ("int arg a bool", '{"op": "report", "event": true}', "report.event"),
    ("int arg a str", '{"op": "add", "rid": "a", "family": "x", "prompt_len": 16}', "add.family"),
    ("int arg too big", '{"op": "add", "rid": "a", "family": 0, "prompt_len": 99999999999}', "add.prompt_len"),
    ("rid not a str", '{"op": "finish", "rid": 7}', "finish.rid"),
    ("admit not a list", '{"op": "step", "admit": "abc"}', "step.admit"),
    ("admit ints", '{"op": "step", "admit": [1, 2]}', "step.admit"),
    ("admit too long", json.dumps({"op": "step", "admit": ["r"] * 5000}), "step.admit"),
    ("arg missing", '{"op": "report"}', "needs argument 'event'"),
    ("arg unknown", '{"op": "reset", "force": true}', "no argument 'force'"),
    ("arg unknown 500 kB", json.dumps({"op": "reset", "f" * 500_000: 1}), "has no argument"),
    ("expect bad", '{"op": "reset", "expect": "maybe"}', "expect"),
    ("expect a list", '{"op": "reset", "expect": []}', "expect"),
    ("line a list", "[1, 2]", "JSON object"),
    ("line a number", "5", "JSON object"),
    ("NaN for an int", '{"op": "report", "event": NaN}', "report.event"),
]


@pytest.mark.parametrize(("bad", "words"), [pytest.param(b, w, id=i) for i, b, w in LINE_CASES])
def test_bad_operation_line(tmp_path: Path, bad: str, words: str) -> None:
    text = "\n".join([H1, ADD, "", ADD, bad, ADD]) + "\n"  # the bad line is line 5
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    for load in (lambda: trace_io.read(path), lambda: trace_io.loads(text)):
        with pytest.raises(TraceError) as err:
            load()
        assert err.value.line == 5
        check_message(err.value, "line 5", words)


def test_recursion_error_of_the_parser_is_a_trace_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_io, "MAX_NESTING", 10**9)  # past the cheap check, into json.loads
    with pytest.raises(TraceError) as err:
        trace_io.loads(H1 + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    assert err.value.line == 2
    check_message(err.value, "nesting too deep")


def test_file_errors_are_line_0(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as err:
        trace_io.read(tmp_path / "missing.jsonl")
    assert err.value.line == 0 and "cannot read" in str(err.value)
    with pytest.raises(TraceError) as err:
        trace_io.read(tmp_path)
    assert err.value.line == 0 and "cannot read" in str(err.value)
    path = tmp_path / "latin1.jsonl"
    path.write_bytes((H1 + "\n" + ADD + "\n").encode() + b'{"op": "finish", "rid": "\xe9"}\n')
    with pytest.raises(TraceError) as err:
        trace_io.read(path)
    assert err.value.line == 0 and "not UTF-8" in str(err.value)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError) as err:
        trace_io.read(tmp_path / "empty.jsonl")
    assert err.value.line == 1 and "empty" in str(err.value)


def test_truncated_last_line_says_so(tmp_path: Path) -> None:
    text = (TRACES / "vllm-fixme.jsonl").read_text()
    with pytest.raises(TraceError) as err:
        trace_io.loads(text[:-20])
    assert err.value.line == len(text.splitlines()) and "truncated" in str(err.value)
    with pytest.raises(TraceError) as err:  # a cut line followed by a newline, at the end
        trace_io.loads(text[:-20] + "\n")
    assert "truncated" in str(err.value)
    with pytest.raises(TraceError) as err:  # not the last line: plainly invalid
        trace_io.loads(H1 + "\n{\"op\": \n" + ADD + "\n")
    assert err.value.line == 2 and "truncated" not in str(err.value) and "invalid JSON" in str(err.value)


# -- version 2 headers, version 1 files -------------------------------------------------------


V1_TRACE = "\n".join([  # tests/traces/vllm-fixme.jsonl as kvspec wrote it in format version 1
    json.dumps({"config": {"block_size": 16, "groups": [{"kind": "full", "sliding_window": 0},
                                                        {"kind": "sliding", "sliding_window": 16}],
                           "lazy_offload": False, "max_num_batched_tokens": 64, "num_cpu_blocks": 4,
                           "num_gpu_blocks": 16, "policy": "baseline", "world_size": 1},
                "kvspec_trace": 1, "note": "finding: operation 6: C1: group 0 position 1: ...", "seed": 1,
                "target": "bug:vllm-fixme"}),
    '{"family": 2, "max_tokens": 32, "op": "add", "prompt_len": 56, "rid": "r2"}',
    '{"admit": ["r2"], "chunk": 16, "op": "step", "preempt": [], "resume": "mrv2"}',
    '{"admit": [], "chunk": 64, "op": "step", "preempt": [], "resume": "mrv2"}',
    '{"family": 2, "max_tokens": 2, "op": "add", "prompt_len": 96, "rid": "r3"}',
    '{"admit": ["r3"], "chunk": 16, "op": "step", "preempt": [], "resume": "mrv2"}',
    '{"count": 1, "event": 1, "op": "report"}',
    '{"op": "finish", "rid": "r2"}',
]) + "\n"


def test_version_1_files_read_as_before() -> None:
    tr = trace_io.loads(V1_TRACE)
    assert tr.target == "bug:vllm-fixme" and tr.seed == 1 and tr.note.startswith("finding: operation 6: C1")
    assert tr.config.policy == "baseline" and tr.config.groups[1] == KVGroup("sliding", 16)
    assert tr.oracle is None and tr.finding is None
    assert len(tr.ops) == 7 and tr.ops[-1] == {"op": "finish", "rid": "r2"}
    # version 1 ignores header keys it does not know, as it always did
    head, rest = V1_TRACE.split("\n", 1)
    extra = json.dumps({**json.loads(head), "comment": "hand-written"}) + "\n" + rest
    assert trace_io.loads(extra) == tr


def test_shipped_traces_read_whole_and_streamed_alike() -> None:
    for path in sorted(TRACES.glob("*.jsonl")):
        first = json.loads(path.read_text().split("\n", 1)[0])
        tr = trace_io.read(path)
        assert tr.target == first["target"] and tr.seed == first["seed"] and tr.note == first["note"]
        # versions 1 and 2 were written before async scheduling was modelled: read as synchronous;
        # traces written before speculative decoding was modelled have none
        recorded = {"num_speculative_tokens": 0, **first["config"]}
        assert tr.config.to_json() == ({"async_scheduling": False, **recorded}
                                       if first["kvspec_trace"] <= 2 else recorded)
        with trace_io.open_trace(path) as stream:
            assert stream.version == first["kvspec_trace"] and stream.config == tr.config
            assert stream.oracle == tr.oracle and stream.finding == tr.finding
            assert list(stream.ops()) == tr.ops
        assert len(tr.ops) == len([ln for ln in path.read_text().splitlines()[1:] if ln.strip()])


def test_version_4_round_trip(tmp_path: Path) -> None:
    tr = trace_io.read(TRACES / "vllm-fixme.jsonl")  # a version 2 file: synchronous scheduling
    tr.oracle = ("C1", "I3")
    tr.finding = {"kind": "violation", "op_index": len(tr.ops) - 1, "invariant": "C1", "exception": None}
    head = tr.header()
    assert head["kvspec_trace"] == trace_io.TRACE_VERSION == 4
    assert head["config"]["async_scheduling"] is False  # written out, so it stays what it was
    assert head["oracle"] == ["C1", "I3"] and head["finding"]["invariant"] == "C1"
    tr.write(tmp_path / "t.jsonl")
    again = trace_io.read(tmp_path / "t.jsonl")
    assert again == tr
    crash = replace(tr, oracle=None, finding={"kind": "crash", "op_index": 0, "exception": "TypeError"})
    assert trace_io.loads(crash.dumps()).finding == {"kind": "crash", "op_index": 0, "invariant": None,
                                                    "exception": "TypeError"}


def test_traces_before_version_3_ran_under_synchronous_scheduling() -> None:
    """A config without ``async_scheduling`` is synchronous in versions 1 and 2 (written before async
    scheduling was modelled) and takes the default, async, in version 3; a config that says so is
    read as it says in every version."""
    bare = {k: v for k, v in GOOD.items() if k != "async_scheduling"}
    for version, expected in ((1, False), (2, False), (3, True)):
        head = json.dumps({"kvspec_trace": version, "config": bare})
        assert trace_io.loads(head + "\n" + ADD + "\n").config.async_scheduling is expected
        for said in (False, True):
            head = json.dumps({"kvspec_trace": version, "config": {**bare, "async_scheduling": said}})
            assert trace_io.loads(head + "\n" + ADD + "\n").config.async_scheduling is said


def _zero(**extra: Any) -> str:
    return json.dumps({"op": "add", "rid": "z", "family": 1, "prompt_len": 8, "max_tokens": 0, **extra})


def test_max_tokens_zero_is_refused_from_version_4_and_marked_before() -> None:
    """vLLM's SamplingParams needs max_tokens >= 1. Formats 1-3 allowed 0 (a request that samples no
    token): their lines are read with the mark ``"format": <version>``; a version 4 line needs it."""
    for version in (1, 2, 3):
        head = json.dumps({"kvspec_trace": version, "config": GOOD})
        assert trace_io.loads(head + "\n" + _zero() + "\n").ops[0]["format"] == version
        assert "format" not in trace_io.loads(head + "\n" + ADD + "\n").ops[0]
    head = json.dumps({"kvspec_trace": 4, "config": GOOD})
    with pytest.raises(TraceError, match=r"line 2: add.max_tokens = 0: vLLM needs at least 1"):
        trace_io.loads(head + "\n" + _zero() + "\n")
    assert trace_io.loads(head + "\n" + _zero(format=3) + "\n").ops[0]["format"] == 3
    with pytest.raises(TraceError, match=r"line 2: add.format = 4: only a line from trace format 1..3"):
        trace_io.loads(head + "\n" + _zero(format=4) + "\n")
    with pytest.raises(TraceError, match=r"line 2: add.format marks only a request with max_tokens 0"):
        trace_io.loads(head + "\n" + json.dumps({**json.loads(ADD), "format": 3}) + "\n")


def test_an_old_trace_with_max_tokens_zero_keeps_its_meaning_written_as_version_4(tmp_path: Path) -> None:
    """A version 2 trace with max_tokens 0 is written back as version 4 with the mark, and reads
    back the same; the shipped traces that use it still reach their recorded finding (elsewhere)."""
    tr = trace_io.read(TRACES / "reset-releases-inflight.jsonl")
    zero = [op for op in tr.ops if op["op"] == "add" and op.get("max_tokens") == 0]
    assert zero and all(op["format"] == 2 for op in zero)  # a version 2 file
    tr.write(tmp_path / "t.jsonl")
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["kvspec_trace"] == 4
    assert trace_io.read(tmp_path / "t.jsonl") == tr


def test_writing_refuses_what_reading_would_refuse() -> None:
    tr = trace_io.Trace(OffloadConfig(), [], oracle=("not-an-id",))
    with pytest.raises(TraceError):
        tr.dumps()
    long_note = trace_io.Trace(OffloadConfig(), [], note="n" * 50_000)
    assert len(trace_io.loads(long_note.dumps()).note) == trace_io.MAX_NOTE


# -- streaming --------------------------------------------------------------------------------


def _step(i: int, width: int) -> str:
    return json.dumps({"op": "step", "admit": [f"r{i}-{j:06d}" for j in range(width)], "chunk": 16})


def test_stream_yields_good_ops_then_raises_at_the_bad_line(tmp_path: Path) -> None:
    n = 5000
    path = tmp_path / "long.jsonl"
    with path.open("w") as f:
        f.write(H1 + "\n")
        for i in range(n):
            f.write(json.dumps({"op": "add", "rid": f"r{i}", "family": i % 7, "prompt_len": 16}) + "\n")
        f.write('{"op": "add", "rid": []}\n')  # line n + 2
        for _ in range(10):
            f.write(ADD + "\n")
    seen = []
    with trace_io.open_trace(path) as tr:
        assert tr.config == OffloadConfig(policy="baseline") and tr.seed == 0 and tr.oracle is None
        with pytest.raises(TraceError) as err:
            for op in tr.ops():
                seen.append(op)
    assert err.value.line == n + 2 and "add.rid" in str(err.value)
    assert len(seen) == n and seen[-1]["rid"] == f"r{n - 1}"


def test_stream_memory_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        f.write(header(2, oracle=["I1"]) + "\n")
        size = 0
        i = 0
        while size < 20_000_000:
            line = _step(i, 200) + "\n"
            f.write(line)
            size += len(line)
            i += 1
    assert path.stat().st_size >= 20_000_000
    tracemalloc.start()
    try:
        count = 0
        with trace_io.open_trace(path) as tr:
            for op in tr.ops():
                count += len(op["admit"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 200 * i
    assert peak < 10_000_000, f"peak {peak} bytes while streaming a {path.stat().st_size}-byte trace"


def test_long_line_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "long-line.jsonl"
    with path.open("w") as f:
        f.write(H1 + "\n" + ADD + "\n")
        f.write('{"op": "add", "rid": "' + "r" * 30_000_000)  # 30 MB, no newline
    tracemalloc.start()
    try:
        with trace_io.open_trace(path) as tr, pytest.raises(TraceError) as err:
            list(tr.ops())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.line == 3 and "longer than" in str(err.value)
    assert peak < 10_000_000
