"""Trace files: versioned JSON Lines.

Line 1 is the header ``{"kvspec_trace": 1, "config": {...}, "target": ..., "seed": ...}``;
every further line is one engine operation ``{"op": name, ...}`` (see
``kvspec.model.engine.Engine``). An operation that is meant to be rejected carries
``"expect": "error"``. Reading checks every line and raises ``TraceError`` with the
1-based line number for anything malformed: the CLI turns it into one line and exit 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.errors import KVSpecError, TraceError
from kvspec.interfaces import OffloadConfig

TRACE_VERSION = 1
MAX_INT = 1 << 20
MAX_LIST = 4096

# op name -> {arg: (type, required)}
OP_ARGS: dict[str, dict[str, tuple[type, bool]]] = {
    "add": {"rid": (str, True), "family": (int, True), "prompt_len": (int, True), "max_tokens": (int, False)},
    "step": {"admit": (list, False), "chunk": (int, False), "preempt": (list, False), "resume": (str, False)},
    "report": {"event": (int, True), "count": (int, False)},
    "load_done": {"rid": (str, True)},
    "finish": {"rid": (str, True)},
    "reset": {},
}


@dataclass
class Trace:
    config: OffloadConfig
    ops: list[dict[str, Any]] = field(default_factory=list)
    target: str = "model"
    seed: int | None = None
    note: str = ""

    def header(self) -> dict[str, Any]:
        return {"kvspec_trace": TRACE_VERSION, "config": self.config.to_json(), "target": self.target,
                "seed": self.seed, "note": self.note}

    def dumps(self) -> str:
        lines = [json.dumps(self.header(), sort_keys=True)]
        lines += [json.dumps(op, sort_keys=True) for op in self.ops]
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.dumps())


def _check_value(value: Any, typ: type, line: int, what: str) -> None:
    if typ is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TraceError(line, f"{what} must be an integer, got {json.dumps(value)}")
        if not -1 <= value <= MAX_INT:
            raise TraceError(line, f"{what} = {value} is outside -1..{MAX_INT}")
    elif typ is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TraceError(line, f"{what} must be a list of request ids (strings)")
        if len(value) > MAX_LIST:
            raise TraceError(line, f"{what} lists {len(value)} requests, more than {MAX_LIST}")
    elif not isinstance(value, typ):
        raise TraceError(line, f"{what} must be a {typ.__name__}, got {json.dumps(value)}")


def parse_op(obj: Any, line: int) -> dict[str, Any]:
    """Check one operation line's shape (names and types, not state)."""
    if not isinstance(obj, dict):
        raise TraceError(line, "an operation must be a JSON object")
    name = obj.get("op")
    if name not in OP_ARGS:
        raise TraceError(line, f"unknown operation {json.dumps(name)}; known: {', '.join(OP_ARGS)}")
    spec = OP_ARGS[name]
    for arg, value in obj.items():
        if arg in ("op", "expect"):
            continue
        if arg not in spec:
            raise TraceError(line, f"operation {name} has no argument {arg!r}")
        _check_value(value, spec[arg][0], line, f"{name}.{arg}")
    for arg, (_, required) in spec.items():
        if required and arg not in obj:
            raise TraceError(line, f"operation {name} needs argument {arg!r}")
    if obj.get("expect", "ok") not in ("ok", "error"):
        raise TraceError(line, "expect must be \"ok\" or \"error\"")
    return dict(obj)


def loads(text: str) -> Trace:
    """Parse a whole trace; ``TraceError`` names the first bad line."""
    lines = text.split("\n")
    records: list[tuple[int, Any]] = []
    for i, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            records.append((i, json.loads(raw)))
        except json.JSONDecodeError as exc:
            why = "truncated or invalid JSON" if i == len(lines) or i == len(lines) - 1 else "invalid JSON"
            raise TraceError(i, f"{why}: {exc.msg} at column {exc.colno}") from None
    if not records:
        raise TraceError(1, "empty trace: expected a header line")
    line, header = records[0]
    if not isinstance(header, dict) or "kvspec_trace" not in header:
        raise TraceError(line, "the first line must be a header with \"kvspec_trace\"")
    version = header["kvspec_trace"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceError(line, f"trace version must be an integer, got {json.dumps(version)}")
    if version > TRACE_VERSION:
        raise TraceError(line, f"trace format version {version} is newer than this kvspec reads "
                         f"({TRACE_VERSION}); upgrade kvspec")
    cfg = header.get("config")
    if not isinstance(cfg, dict):
        raise TraceError(line, "header.config must be an object")
    for k in ("num_gpu_blocks", "num_cpu_blocks", "block_size", "world_size", "max_num_batched_tokens"):
        if k in cfg:
            _check_value(cfg[k], int, line, f"config.{k}")
    try:
        config = OffloadConfig.from_json(cfg)
    except KVSpecError as exc:
        raise TraceError(line, f"bad config: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(line, f"bad config: {type(exc).__name__}: {exc}") from None
    seed = header.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TraceError(line, "header.seed must be an integer or null")
    ops = [parse_op(obj, i) for i, obj in records[1:]]
    return Trace(config, ops, str(header.get("target", "model")), seed, str(header.get("note", "")))


def read(path: str | Path) -> Trace:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(0, f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(0, f"{path} is not UTF-8 text") from None
    return loads(text)
