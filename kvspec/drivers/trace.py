"""Trace files: versioned JSON Lines, read as a stream.

Line 1 is the header ``{"kvspec_trace": 3, "config": {...}, "target": ..., "seed": ..., "note": ...,
"oracle": [...], "finding": {...}}``; every further line is one engine operation
``{"op": name, ...}`` (see ``kvspec.drivers.engine.Engine``). An operation that is meant to be
rejected carries ``"expect": "error"``. Blank lines are skipped (and counted).

Header keys (every one but ``kvspec_trace`` and ``config`` optional):

- ``kvspec_trace``: the format version, 1 to 4. Version 1 files are read as they always were
  (unknown header keys ignored); versions 2 to 4 refuse unknown header keys. Versions 1 and 2
  were written before the engine modelled async scheduling: their operations ran under
  synchronous scheduling, so a config without ``async_scheduling`` is read as ``false`` there
  (version 3 writes the key; absent, it takes the constructor's default, true). Versions 1 to 3
  allowed ``add`` with ``max_tokens: 0``, a request that samples no token (synchronous
  scheduling holds it, blocks and all, until ``finish``), which vLLM's ``SamplingParams`` refuses
  (at least 1). Version 4 refuses it, unless the line says it comes from an older format:
  the reader marks each such line of a version 1-3 file ``"format": 3`` (so a trace shrunk
  from it and written as version 4 keeps the request's meaning), and the engine accepts
  ``max_tokens: 0`` only with that mark.
- ``config``: an ``OffloadConfig`` as ``to_json`` writes it, read strictly (``from_json``).
- ``target``: a string of at most 200 characters (default ``"model"``); ``seed``: an integer or
  null; ``note``: a string of at most 10,000 characters.
- versions 2 and 3: ``oracle``: null or a list of invariant ids (``I3``, ``C1``: the shape only is
  checked here; the caller checks that the ids are known), and ``finding``: null or
  ``{"kind": "violation"|"crash", "op_index": int >= 0, "invariant": str|null, "exception": str|null}``.

``open_trace(path)`` parses the header and then yields one checked operation at a time
(``TraceStream.ops()``), so a trace of any size is read in bounded memory and a bad line is
reported when it is reached. ``read``/``loads`` return a whole ``Trace``. Every malformed input
raises ``TraceError`` with the 1-based line number (0: the file itself cannot be read); the CLI
turns it into one line and exit 2. A line longer than ``MAX_LINE`` characters or nested deeper
than ``MAX_NESTING`` is refused before it is parsed; messages never quote a value whole.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import ConfigError, TraceError, echo
from kvspec.contract.schema_check import no_duplicate_keys

TRACE_VERSION = 4  # written; versions 1..TRACE_VERSION are read
SYNC_ONLY_VERSION = 2  # the last version written before async scheduling was modelled
ZERO_OUTPUT_VERSION = 3  # the last version that allowed ``add`` with ``max_tokens: 0``
MAX_INT = 1 << 20
MAX_LIST = 4096
MAX_LINE = 1 << 20  # characters in one line, newline excluded
MAX_NESTING = 16  # levels of JSON arrays/objects in one line (a header needs 4, an operation 2)
MAX_TARGET = 200
MAX_NOTE = 10_000
MAX_ORACLE = 256  # invariant ids in a header's oracle
MAX_EXCEPTION = 200  # characters of a finding's exception name
MAX_OP_INDEX = 1 << 40
INVARIANT_ID = re.compile(r"[ICR][0-9]{1,6}")  # I and C: the catalogue; R1: refinement (kvspec.specs)
FINDING_KINDS = ("violation", "crash", "divergence", "expectation")
HEADER_KEYS = {1: ("kvspec_trace", "config", "target", "seed", "note"),
               2: ("kvspec_trace", "config", "target", "seed", "note", "oracle", "finding"),
               3: ("kvspec_trace", "config", "target", "seed", "note", "oracle", "finding"),
               4: ("kvspec_trace", "config", "target", "seed", "note", "oracle", "finding")}
_FINDING_KEYS = ("kind", "op_index", "invariant", "exception")

# op name -> {arg: (type, required)}
OP_ARGS: dict[str, dict[str, tuple[type, bool]]] = {
    "add": {"rid": (str, True), "family": (int, True), "prompt_len": (int, True), "max_tokens": (int, False),
            "format": (int, False)},
    "step": {"admit": (list, False), "chunk": (int, False), "preempt": (list, False), "resume": (str, False),
             "budget": (int, False), "accept": (int, False)},
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
    oracle: tuple[str, ...] | None = None
    finding: dict[str, Any] | None = None

    def header(self) -> dict[str, Any]:
        """The version-2 header line. The note is cut to ``MAX_NOTE`` characters; any other field
        that a reader would refuse raises ``TraceError`` (line 1) here, before anything is written."""
        note = self.note if len(self.note) <= MAX_NOTE else self.note[: MAX_NOTE - 1] + "…"
        head = {"kvspec_trace": TRACE_VERSION, "config": self.config.to_json(), "target": self.target,
                "seed": self.seed, "note": note,
                "oracle": list(self.oracle) if self.oracle is not None else None,
                "finding": dict(self.finding) if self.finding is not None else None}
        _parse_header(head, 1)
        return head

    def dumps(self) -> str:
        lines = [json.dumps(self.header(), sort_keys=True)]
        lines += [json.dumps(op, sort_keys=True) for op in self.ops]
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.dumps())


# -- checks ------------------------------------------------------------------------------------


def _check_value(value: Any, typ: type, line: int, what: str) -> None:
    if typ is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TraceError(line, f"{what} must be an integer, got {echo(value)}")
        if not -1 <= value <= MAX_INT:
            raise TraceError(line, f"{what} = {echo(value)} is outside -1..{MAX_INT}")
    elif typ is list:
        if not isinstance(value, list):
            raise TraceError(line, f"{what} must be a list of request ids (strings), got {echo(value)}")
        if len(value) > MAX_LIST:
            raise TraceError(line, f"{what} lists {len(value)} requests, more than {MAX_LIST}")
        for v in value:
            if not isinstance(v, str):
                raise TraceError(line, f"{what} must be a list of request ids (strings), has {echo(v)}")
    elif not isinstance(value, typ):
        raise TraceError(line, f"{what} must be a {typ.__name__}, got {echo(value)}")


def parse_op(obj: Any, line: int, version: int = TRACE_VERSION) -> dict[str, Any]:
    """Check one operation line's shape (names and types, not state) as format ``version`` has it.
    An ``add`` with ``max_tokens: 0`` is marked ``"format": 3`` in a version 1-3 file and refused
    in a version 4 line without that mark (see the module doc)."""
    if not isinstance(obj, dict):
        raise TraceError(line, f"an operation must be a JSON object, got {echo(obj)}")
    if "op" not in obj:
        raise TraceError(line, "an operation needs an \"op\" name")
    name = obj["op"]
    if not isinstance(name, str):
        raise TraceError(line, f"op must be an operation name (a string), got {echo(name)}")
    if name not in OP_ARGS:
        raise TraceError(line, f"unknown operation {echo(name)}; known: {', '.join(OP_ARGS)}")
    spec = OP_ARGS[name]
    for arg, value in obj.items():
        if arg in ("op", "expect"):
            continue
        if arg not in spec:
            raise TraceError(line, f"operation {name} has no argument {echo(arg)}")
        _check_value(value, spec[arg][0], line, f"{name}.{arg}")
    for arg, (_, required) in spec.items():
        if required and arg not in obj:
            raise TraceError(line, f"operation {name} needs argument {arg!r}")
    if "expect" in obj and (not isinstance(obj["expect"], str) or obj["expect"] not in ("ok", "error")):
        raise TraceError(line, f"expect must be \"ok\" or \"error\", got {echo(obj['expect'])}")
    op = dict(obj)
    if name == "add":
        _check_add_format(op, line, version)
    return op


def _check_add_format(op: dict[str, Any], line: int, version: int) -> None:
    """``add.format``: 1..ZERO_OUTPUT_VERSION, and only on a ``max_tokens: 0`` line; a version 1-3
    file's ``max_tokens: 0`` gains the mark, a version 4 line without it is refused (in place)."""
    mark = op.get("format")
    if mark is not None and not 1 <= mark <= ZERO_OUTPUT_VERSION:
        raise TraceError(line, f"add.format = {echo(mark)}: only a line from trace format 1..{ZERO_OUTPUT_VERSION} "
                         "carries it")
    if op.get("max_tokens", 1) != 0:
        if mark is not None:
            raise TraceError(line, "add.format marks only a request with max_tokens 0 (formats 1-3)")
        return
    if version <= ZERO_OUTPUT_VERSION:
        op.setdefault("format", version)
    elif mark is None:
        raise TraceError(line, "add.max_tokens = 0: vLLM needs at least 1 (SamplingParams); trace formats 1-3 "
                         "allowed 0 for a request that samples no token, which a version 4 line marks "
                         "with \"format\": 3")


def _check_string(value: Any, line: int, what: str, limit: int) -> str:
    if not isinstance(value, str):
        raise TraceError(line, f"{what} must be a string, got {echo(value)}")
    if len(value) > limit:
        raise TraceError(line, f"{what} has {len(value)} characters, more than {limit}")
    return value


def _check_invariant_id(value: Any, line: int, what: str) -> str:
    if not isinstance(value, str) or not INVARIANT_ID.fullmatch(value):
        raise TraceError(line, f"{what} must be an invariant id like \"I3\" or \"C1\", got {echo(value)}")
    return value


def _parse_oracle(value: Any, line: int) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceError(line, f"header.oracle must be null or a list of invariant ids, got {echo(value)}")
    if len(value) > MAX_ORACLE:
        raise TraceError(line, f"header.oracle lists {len(value)} ids, more than {MAX_ORACLE}")
    return tuple(_check_invariant_id(v, line, f"header.oracle[{i}]") for i, v in enumerate(value))


def _parse_finding(value: Any, line: int) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TraceError(line, f"header.finding must be null or an object, got {echo(value)}")
    for key in value:
        if key not in _FINDING_KEYS:
            raise TraceError(line, f"header.finding has no key {echo(key)}; known: {', '.join(_FINDING_KEYS)}")
    for key in ("kind", "op_index"):
        if key not in value:
            raise TraceError(line, f"header.finding.{key} is missing (required)")
    kind = value["kind"]
    if not isinstance(kind, str) or kind not in FINDING_KINDS:
        raise TraceError(line, f"header.finding.kind must be one of {', '.join(FINDING_KINDS)}, got {echo(kind)}")
    op_index = value["op_index"]  # null: the target crashed while being built, before any operation
    if op_index is not None and (not isinstance(op_index, int) or isinstance(op_index, bool)
                                 or not 0 <= op_index <= MAX_OP_INDEX):
        raise TraceError(line, f"header.finding.op_index must be null or an integer in 0..{MAX_OP_INDEX}, "
                         f"got {echo(op_index)}")
    invariant = value.get("invariant")
    if invariant is not None:
        _check_invariant_id(invariant, line, "header.finding.invariant")
    exception = value.get("exception")
    if exception is not None:
        _check_string(exception, line, "header.finding.exception", MAX_EXCEPTION)
    if kind == "violation" and invariant is None:
        raise TraceError(line, "header.finding.invariant is required for a violation")
    if kind == "crash" and exception is None:
        raise TraceError(line, "header.finding.exception is required for a crash")
    return {"kind": kind, "op_index": op_index, "invariant": invariant, "exception": exception}


def _parse_header(header: Any, line: int) -> dict[str, Any]:
    """The checked header fields: version, config, target, seed, note, oracle, finding."""
    if not isinstance(header, dict) or "kvspec_trace" not in header:
        raise TraceError(line, "the first line must be a header with \"kvspec_trace\"")
    version = header["kvspec_trace"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceError(line, f"trace version must be an integer, got {echo(version)}")
    if version > TRACE_VERSION:
        raise TraceError(line, f"trace format version {echo(version)} is newer than this kvspec reads "
                         f"({TRACE_VERSION}); upgrade kvspec")
    if version < 1:
        raise TraceError(line, f"trace format version {echo(version)} is not a version (they start at 1)")
    known = HEADER_KEYS[version]
    for key in header:
        if key in known:
            continue
        if version == 1 and key not in HEADER_KEYS[TRACE_VERSION]:
            continue  # version 1 ignores keys it does not know, as it always did
        raise TraceError(line, f"header has no key {echo(key)} in version {version}; known: {', '.join(known)}")
    if "config" not in header:
        raise TraceError(line, "header.config is missing (required)")
    raw_config = header["config"]
    if version <= SYNC_ONLY_VERSION and isinstance(raw_config, dict) and "async_scheduling" not in raw_config:
        raw_config = {**raw_config, "async_scheduling": False}  # recorded under synchronous scheduling
    try:
        config = OffloadConfig.from_json(raw_config, "config")
    except ConfigError as exc:
        raise TraceError(line, f"bad config: {exc}") from None
    target = _check_string(header.get("target", "model"), line, "header.target", MAX_TARGET)
    seed = header.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TraceError(line, f"header.seed must be an integer or null, got {echo(seed)}")
    note = _check_string(header.get("note", ""), line, "header.note", MAX_NOTE)
    return {"version": version, "config": config, "target": target, "seed": seed, "note": note,
            "oracle": _parse_oracle(header.get("oracle"), line),
            "finding": _parse_finding(header.get("finding"), line)}


_STRUCTURE = re.compile(r'[\[\]{}"\\]')


def _too_deep(raw: str) -> bool:
    """Whether a JSON text nests arrays/objects deeper than ``MAX_NESTING`` (brackets inside
    strings do not count). O(1) Python work for ordinary lines: only a line with more than
    ``MAX_NESTING`` opening brackets is scanned, and then only its brackets, quotes and backslashes."""
    if raw.count("[") + raw.count("{") <= MAX_NESTING:
        return False
    depth = 0
    in_string = False
    escaped = -1  # position of a character escaped by a backslash
    for m in _STRUCTURE.finditer(raw):
        pos = m.start()
        if pos == escaped:
            continue
        ch = raw[pos]
        if in_string:
            if ch == "\\":
                escaped = pos + 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif ch in "]}":
            depth -= 1
    return False


# -- the stream --------------------------------------------------------------------------------


class TraceStream:
    """An open trace: the header's fields as attributes (``version``, ``config``, ``target``,
    ``seed``, ``note``, ``oracle``, ``finding``) and ``ops()``, which yields the checked operations
    one line at a time. A context manager; ``open_trace`` makes one."""

    version: int
    config: OffloadConfig
    target: str
    seed: int | None
    note: str
    oracle: tuple[str, ...] | None
    finding: dict[str, Any] | None

    def __init__(self, stream: IO[str], name: str) -> None:
        self._stream = stream
        self.name = name
        self.line = 0  # the number of the last line read
        self.ops_read = 0  # operations read so far
        try:
            first = self._next_record()
            if first is None:
                raise TraceError(1, "empty trace: expected a header line")
            line, header = first
            for key, value in _parse_header(header, line).items():
                setattr(self, key, value)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TraceStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stream.close()

    def ops(self) -> Iterator[dict[str, Any]]:
        """The operations still unread, each checked (``parse_op``) as its line is read; a bad line
        raises ``TraceError`` when it is reached. One pass: the lines are not kept. At the end, a
        header finding whose operation index is past the last operation raises ``TraceError``
        (line 1, the header's)."""
        while True:
            record = self._next_record()
            if record is None:
                self._check_finding_index()
                return
            op = parse_op(record[1], record[0], self.version)
            self.ops_read += 1
            yield op

    def _check_finding_index(self) -> None:
        index = self.finding.get("op_index") if self.finding is not None else None
        if index is not None and index >= self.ops_read:
            raise TraceError(1, f"header.finding.op_index is {index}, but the trace has {self.ops_read} "
                             f"operation(s) (indices 0..{self.ops_read - 1})")

    def finish(self) -> None:
        """Read the operations not read yet (checking each, and the finding's index at the end):
        for a reader that stopped early, e.g. at a finding, so that the whole file is judged."""
        for _ in self.ops():
            pass

    def _readline(self) -> str:
        try:
            return self._stream.readline(MAX_LINE + 1)
        except UnicodeDecodeError:
            raise TraceError(0, f"{self.name} is not UTF-8 text (at line {self.line + 1})") from None
        except OSError as exc:
            raise TraceError(0, f"cannot read {self.name}: {exc.strerror or exc}") from None

    def _next_record(self) -> tuple[int, Any] | None:
        """The next non-blank line, parsed: (line number, JSON value); None at the end."""
        while True:
            raw = self._readline()
            if raw == "":
                return None
            self.line += 1
            if len(raw) > MAX_LINE and not raw.endswith("\n"):
                raise TraceError(self.line, f"line is longer than {MAX_LINE} characters")
            if raw.strip():
                return self.line, self._parse_json(raw)

    def _parse_json(self, raw: str) -> Any:
        line = self.line
        if _too_deep(raw):
            raise TraceError(line, f"nesting too deep: more than {MAX_NESTING} levels of arrays/objects")
        try:
            return json.loads(raw, object_pairs_hook=no_duplicate_keys)
        except RecursionError:
            raise TraceError(line, "nesting too deep for the JSON parser") from None
        except json.JSONDecodeError as exc:
            last = not raw.endswith("\n") or self._at_end()
            why = "truncated or invalid JSON (the last line)" if last else "invalid JSON"
            raise TraceError(line, f"{why}: {exc.msg} at column {exc.colno}") from None
        except ValueError as exc:  # e.g. an integer of more than 4300 digits
            why = str(exc)
            raise TraceError(line, f"invalid JSON: {why if len(why) <= 120 else why[:119] + '…'}") from None

    def _at_end(self) -> bool:
        try:
            return self._stream.read(1) == ""
        except (OSError, UnicodeDecodeError):
            return False


def open_trace(path: str | Path) -> TraceStream:
    """Open a trace file and parse its header; iterate ``.ops()`` for the operations.

    ``with open_trace(p) as tr: for op in tr.ops(): ...``. ``TraceError`` (line 0) when the file
    cannot be opened or is not UTF-8; a bad header raises here, a bad operation line when reached."""
    try:
        stream = open(path, encoding="utf-8")  # closed by the TraceStream
    except OSError as exc:
        raise TraceError(0, f"cannot read {path}: {exc.strerror or exc}") from None
    return TraceStream(stream, str(path))


def _whole(stream: TraceStream) -> Trace:
    with stream:
        ops = list(stream.ops())
    return Trace(stream.config, ops, stream.target, stream.seed, stream.note, stream.oracle, stream.finding)


def loads(text: str) -> Trace:
    """Parse a whole trace; ``TraceError`` names the first bad line."""
    return _whole(TraceStream(io.StringIO(text, newline="\n"), "<trace>"))


def read(path: str | Path) -> Trace:
    """Read a whole (small) trace file; for a large one use ``open_trace``."""
    return _whole(open_trace(path))
