"""Reading and validating snapshot files against ``kvspec/contract/schema/snapshot.schema.json``.

A snapshot is what ``OffloadTarget.snapshot()`` (and the engine model's
``Engine.snapshot()``) returns; ``kvspec check-snapshot`` reads one from a file so
that any engine able to dump its state in this format can be checked against the
invariant catalogue. Validation runs in three passes, and the first problem found is
raised as :class:`~kvspec.contract.errors.SnapshotFormatError` naming the field path and why,
e.g. ``scheduler.reqs_to_store.R1.num_stored_blocks: expected a list of integers,
got "x"``:

0. **Depth.** No list or object nests deeper than :data:`MAX_DEPTH` levels (the format
   itself needs six); deeper input is refused as "nesting too deep", naming the path,
   whether the JSON parser or the checks would have hit Python's recursion limit.
1. **Schema.** A small validator for the subset of JSON Schema (draft 2020-12) the
   schema file uses; it refuses a schema with any other keyword, so it can never
   silently ignore a rule (no dependency is added for this).
2. **Cross-field rules** JSON Schema cannot state: per-block lists as long as the
   pool, every block id in range for its pool, parallel lists of equal length, one
   list per KV group, and (with an ``engine`` section) agreement with its config.
   After these passes every invariant of ``kvspec.oracle.catalogue`` can be evaluated
   on the snapshot without an index or key error.

Speed: each schema node is compiled once into an exact predicate (valid or not); the
message-producing walk runs only below nodes that fail it, so a valid snapshot costs one
predicate pass. Lists whose items are simple scalars (block ids, counts, nullable keys and
strings) are checked with one C-level pass over their element types, then per-type
constraint passes (``min``/``max``, ``len``, the pattern) instead of one call per element:
a snapshot with 10^6-block pools validates in well under a second.

Messages are bounded: values are shown as at most 60 characters of JSON, and keys and
paths are cut (``scheduler.reqs_to_store["rrrr…" (5000000 chars)].finished``), so a
huge input is never echoed whole.

Paths are written ``a.b[3].c``; a key that is not a plain word is quoted
(``scheduler.reqs_to_store["req 1"]``); the root is ``(root)``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from itertools import chain
from pathlib import Path
from typing import Any, Literal

from kvspec.contract.errors import KVSpecError, SnapshotFormatError

SCHEMA_RESOURCE = "snapshot.schema.json"

MAX_DEPTH = 64  # levels of nested lists/objects, the root object counting as 1
SHOW_LIMIT = 60  # characters of JSON a message shows of a value
KEY_LIMIT = 40  # characters a path shows of one key
PATH_LIMIT = 160  # characters a path shows in all
_TOO_DEEP = f"nesting too deep (more than {MAX_DEPTH} levels of lists and objects)"

# Keywords the validator implements (assertions and applicators) or may ignore (annotations).
_ANNOTATIONS = frozenset({"$schema", "$id", "$defs", "$comment", "title", "description", "default", "examples"})
_ASSERTIONS = frozenset({
    "$ref", "type", "enum", "const", "pattern", "minLength", "minimum", "maximum",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "dependentRequired", "items", "prefixItems", "minItems", "maxItems", "anyOf", "oneOf", "allOf",
    "if", "then", "else",
})
SUPPORTED_KEYWORDS = _ANNOTATIONS | _ASSERTIONS

# How a referenced definition reads in an error message: (singular, plural).
_DEF_NOUNS = {
    "block_id": ("a block id (integer)", "block ids (integers)"),
    "block_ids": ("a list of block ids (integers)", "lists of block ids (integers)"),
    "block_ids_per_group": ("a list of block-id lists, one per KV group",
                            "lists of block-id lists, one per KV group"),
    "key": ('a cache key "<hash>:<group>"', 'cache keys "<hash>:<group>"'),
    "event_id": ("an event id (a decimal string)", "event ids (decimal strings)"),
    "request_id": ("a request id (a non-empty string)", "request ids (non-empty strings)"),
    "count": ("a non-negative integer", "non-negative integers"),
}
_TYPE_NOUNS = {
    "object": ("an object", "objects"),
    "array": ("a list", "lists"),
    "string": ("a string", "strings"),
    "integer": ("an integer", "integers"),
    "number": ("a number", "numbers"),
    "boolean": ("a boolean", "booleans"),
    "null": ("null", "nulls"),
}


@dataclass(frozen=True)
class FormatIssue:
    """One problem: where (a field path) and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


# -- public API ------------------------------------------------------------------------------


@cache
def load_schema() -> dict[str, Any]:
    """The snapshot schema shipped with kvspec (checked to use only supported keywords)."""
    text = resources.files("kvspec.contract").joinpath("schema", SCHEMA_RESOURCE).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    unsupported = sorted(_unsupported_keywords(schema))
    if unsupported:
        raise RuntimeError(f"snapshot schema uses keywords the validator does not implement: {unsupported}")
    return schema


@cache
def _validator() -> _Validator:
    return _Validator(load_schema())


def snapshot_issues(snapshot: object) -> list[FormatIssue]:
    """Every schema problem of ``snapshot``; if there is none, every cross-field problem.
    A value nested deeper than :data:`MAX_DEPTH` is the only problem reported."""
    deep = _depth_issue(snapshot)
    if deep is not None:
        return [deep]
    validator = _validator()
    try:
        issues = list(validator.validate(snapshot, validator.root, ()))
        if issues:
            return issues
        assert isinstance(snapshot, dict)
        return list(_consistency_issues(snapshot))
    except RecursionError:  # not reachable after the depth pass; kept so that it never shows as a traceback
        return [FormatIssue("(root)", _TOO_DEEP)]


def validate_snapshot(snapshot: object) -> dict[str, Any]:
    """Return ``snapshot`` if it follows the format; else raise ``SnapshotFormatError``
    for the first problem (the exception's ``issues`` holds them all)."""
    issues = snapshot_issues(snapshot)
    if issues:
        more = f" (and {len(issues) - 1} more problem(s))" if len(issues) > 1 else ""
        err = SnapshotFormatError(f"{issues[0]}{more}")
        err.issues = issues
        err.path = issues[0].path
        raise err
    assert isinstance(snapshot, dict)
    return snapshot


def parse_snapshot(text: str, source: str = "snapshot") -> dict[str, Any]:
    """Parse JSON text (duplicate keys refused) and validate it."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise SnapshotFormatError(
            f"{source}: not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except ValueError as exc:
        limit = sys.get_int_max_str_digits()
        long_int = (re.compile(rf"(?<=[\[:,\s])-?[0-9]{{{limit + 1},}}").search(text)
                    if limit and "integer string conversion" in str(exc) else None)
        if long_int is not None:
            line = text.count("\n", 0, long_int.start()) + 1
            col = long_int.start() - (text.rfind("\n", 0, long_int.start()) + 1) + 1
            raise SnapshotFormatError(f"{source}: line {line} column {col}: an integer of "
                                      f"{long_int.end() - long_int.start()} digits (kvspec reads at most "
                                      f"{limit})") from None
        raise SnapshotFormatError(f"{source}: {exc}") from None
    except RecursionError:
        path = _deep_path_in_text(text)
        where = _fmt_path(path) if path is not None else "(root)"
        raise SnapshotFormatError(f"{where}: {_TOO_DEEP}") from None
    return validate_snapshot(data)


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Read a snapshot file and validate it; ``SnapshotFormatError`` names what is wrong."""
    p = Path(path)
    name = _show_name(str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SnapshotFormatError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SnapshotFormatError(f"{name}: cannot read: {exc.strerror or type(exc).__name__}") from None
    except ValueError as exc:  # e.g. a NUL byte in the path
        raise SnapshotFormatError(f"{name}: cannot read: {exc}") from None
    return parse_snapshot(text, name)


def dump_snapshot(snapshot: dict[str, Any], path: str | Path) -> None:
    """Write ``snapshot`` as JSON (keys in the snapshot's own order); validates first, so
    that only well-formed files are written."""
    validate_snapshot(snapshot)
    Path(path).write_text(json.dumps(snapshot, indent=1) + "\n", encoding="utf-8")


# -- JSON parsing helpers --------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {_show(k)} in one JSON object")
            seen.add(k)
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.DOTALL)


def _deep_path_in_text(text: str) -> tuple[str | int, ...] | None:
    """The path of the first list or object nested deeper than MAX_DEPTH in JSON ``text``
    (read with a token scan, no recursion); None if there is none."""
    stack: list[list[Any]] = []  # per open container: [is_object, current key or index, expecting a key]
    for m in _TOKEN.finditer(text):
        tok = m.group()
        c = tok[0]
        if c == '"':
            if stack and stack[-1][0] and stack[-1][2]:
                try:
                    stack[-1][1] = json.loads(tok)
                except ValueError:
                    stack[-1][1] = tok[1:-1]
                stack[-1][2] = False
        elif c in "[{":
            if len(stack) >= MAX_DEPTH:
                return tuple(frame[1] for frame in stack)
            stack.append([c == "{", 0, c == "{"])
        elif c in "]}":
            if stack:
                stack.pop()
        elif c == "," and stack:
            if stack[-1][0]:
                stack[-1][2] = True
            else:
                stack[-1][1] += 1
    return None


_CONTAINERS = (dict, list)


def _containers(obj: dict[str, Any] | list[Any]) -> list[Any]:
    """The lists and objects directly inside ``obj``; a long run of scalars costs one C-level
    pass over the element types."""
    items = obj.values() if isinstance(obj, dict) else obj
    if len(obj) > 32 and not any(issubclass(t, _CONTAINERS) for t in set(map(type, items))):
        return []
    return [v for v in items if isinstance(v, _CONTAINERS)]


def _depth_issue(value: object) -> FormatIssue | None:
    """A FormatIssue for the first list or object nested deeper than MAX_DEPTH, else None.
    Iterative, level by level: visits containers only; the path is looked up only when one
    is too deep."""
    if not isinstance(value, _CONTAINERS):
        return None
    level, depth = [value], 1
    while True:
        below, small = [], []
        for obj in level:
            if type(obj) is list and len(obj) <= 32:
                small.append(obj)  # e.g. a million one-block lists of a prefix map: looked at together
            else:
                below.extend(_containers(obj))
        if small:
            flat = list(chain.from_iterable(small))
            if any(issubclass(t, _CONTAINERS) for t in set(map(type, flat))):
                below.extend(c for c in flat if isinstance(c, _CONTAINERS))
        if not below:
            return None
        if depth >= MAX_DEPTH:
            return FormatIssue(_fmt_path(_path_to_depth(value, depth + 1)), _TOO_DEEP)
        level, depth = below, depth + 1


def _path_to_depth(value: Any, depth: int) -> tuple[str | int, ...]:
    """The path of a container at ``depth`` (the root is 1) below ``value``; one exists."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        obj, path = stack.pop()
        if len(path) + 1 == depth:
            return path
        pairs = obj.items() if isinstance(obj, dict) else enumerate(obj)
        stack.extend((v, (*path, k)) for k, v in reversed(list(pairs)) if isinstance(v, _CONTAINERS))
    return ()


# -- paths and values in messages ------------------------------------------------------------

_WORD = re.compile(r"^[A-Za-z0-9_\-]+$")


def _fmt_key(part: str) -> str:
    if len(part) <= KEY_LIMIT:
        return json.dumps(part, ensure_ascii=False)
    head = json.dumps(part[: KEY_LIMIT - 12], ensure_ascii=False)
    if len(head) > KEY_LIMIT:
        head = head[: KEY_LIMIT - 1] + '"'
    return f"{head}… ({len(part)} chars)"


def _fmt_path(path: tuple[str | int, ...]) -> str:
    """``a.b[3]["odd key"]``; keys longer than KEY_LIMIT and paths longer than PATH_LIMIT
    are cut (the head is kept, then the last part, then the depth)."""
    pieces: list[str] = []
    for part in path:
        if isinstance(part, int):
            pieces.append(f"[{part}]")
        elif len(part) <= KEY_LIMIT and _WORD.match(part):
            pieces.append(f".{part}" if pieces else part)
        else:
            pieces.append(f"[{_fmt_key(part)}]")
    out = "".join(pieces)
    if len(out) <= PATH_LIMIT:
        return out or "(root)"
    kept, n = [], 0
    for piece in pieces[:-1]:
        if n + len(piece) > PATH_LIMIT - 60:
            break
        kept.append(piece)
        n += len(piece)
    return f"{''.join(kept)}…{pieces[-1]} ({len(pieces)} levels)"


def _json_pieces(value: object) -> Iterator[str]:
    """``json.dumps(value)`` in pieces, lazily (a caller that needs a prefix stops early);
    a string piece longer than SHOW_LIMIT is cut (without its closing quote)."""
    if isinstance(value, str):
        if len(value) > SHOW_LIMIT:
            yield json.dumps(value[: SHOW_LIMIT + 1])[:-1]
        else:
            yield json.dumps(value)
    elif isinstance(value, dict):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            if i:
                yield ", "
            yield from _json_pieces(k if isinstance(k, str) else str(k))
            yield ": "
            yield from _json_pieces(v)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, v in enumerate(value):
            if i:
                yield ", "
            yield from _json_pieces(v)
        yield "]"
    elif value is None or isinstance(value, (bool, int, float)):
        try:
            yield json.dumps(value)
        except ValueError:  # an int too long to print (Python's digit limit)
            yield f"<integer of {value.bit_length()} bits>" if isinstance(value, int) else repr(value)
    else:
        from kvspec.contract.errors import echo

        yield echo(value, SHOW_LIMIT)


def _show(value: object) -> str:
    """``json.dumps(value)``, cut to at most SHOW_LIMIT characters; O(SHOW_LIMIT) whatever
    the size of ``value``."""
    out: list[str] = []
    n = 0
    for piece in _json_pieces(value):
        out.append(piece)
        n += len(piece)
        if n > SHOW_LIMIT:
            break
    text = "".join(out)
    return text if len(text) <= SHOW_LIMIT else text[: SHOW_LIMIT - 3] + "..."


def _show_name(name: str) -> str:
    """A file name as messages print it: cut when very long."""
    return name if len(name) <= 200 else f"{name[:120]}… ({len(name)} chars)"


# -- the schema-subset validator -------------------------------------------------------------


def _unsupported_keywords(schema: object) -> Iterator[str]:
    """Keywords anywhere in ``schema`` that the validator does not implement."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k not in SUPPORTED_KEYWORDS:
                yield k
            if k in ("properties", "patternProperties", "$defs", "dependentRequired"):
                if k != "dependentRequired":
                    for sub in v.values():
                        yield from _unsupported_keywords(sub)
            elif k in ("enum", "const", "required", "default", "examples"):
                continue
            elif isinstance(v, (dict, list)):
                yield from _unsupported_keywords(v)
    elif isinstance(schema, list):
        for sub in schema:
            yield from _unsupported_keywords(sub)


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(value: object, t: str) -> bool:
    if t not in _PY_TYPES:
        raise RuntimeError(f"unknown JSON Schema type {t!r}")
    if isinstance(value, bool) and t != "boolean":
        return False
    return isinstance(value, _PY_TYPES[t])


Pred = Callable[[Any], bool]

# A simple scalar schema, as the fast list check sees it: Python type -> constraint (or None).
_Scalar = dict[type, "Callable[[list[Any]], bool] | None"]
_SCALAR_KEYS = frozenset({"type", "minimum", "maximum", "minLength", "pattern"})
_TYPE_EXACT: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "string": (str,), "null": (type(None),), "boolean": (bool,),
}


_STR_OR_NONE = frozenset({str, type(None)})


def _always(_: object) -> bool:
    return True


class _Validator:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self._preds: dict[int, tuple[dict[str, Any], Pred]] = {}

    def resolve(self, ref: str) -> tuple[str, dict[str, Any]]:
        if not ref.startswith("#/$defs/"):
            raise RuntimeError(f"only local '#/$defs/...' references are supported, got {ref!r}")
        name = ref[len("#/$defs/") :]
        return name, self.root["$defs"][name]

    # -- describing what a schema expects ----------------------------------------------------

    def noun(self, schema: dict[str, Any], plural: bool = False) -> str:
        if "$ref" in schema:
            name, target = self.resolve(schema["$ref"])
            if name in _DEF_NOUNS:
                return _DEF_NOUNS[name][plural]
            return self.noun(target, plural)
        if "const" in schema:
            return json.dumps(schema["const"])
        if "enum" in schema:
            return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
        for comb in ("anyOf", "oneOf"):
            if comb in schema:
                return " or ".join(self.noun(s, plural) for s in schema[comb])
        types = schema.get("type")
        if types is None:
            return "a value" if not plural else "values"
        if isinstance(types, str):
            types = [types]
        words = []
        for t in types:
            if t == "array" and "items" in schema and len(types) == 1:
                words.append(("lists of " if plural else "a list of ") + self.noun(schema["items"], True))
            elif t == "integer" and "minimum" in schema:
                lo = schema["minimum"]
                words.append(("non-negative integers" if plural else "a non-negative integer") if lo == 0
                             else (f"integers >= {lo}" if plural else f"an integer >= {lo}"))
            elif t == "string" and "pattern" in schema:
                words.append(f"{_TYPE_NOUNS[t][plural]} matching /{schema['pattern']}/")
            elif t == "string" and schema.get("minLength") == 1:
                words.append("non-empty strings" if plural else "a non-empty string")
            else:
                words.append(_TYPE_NOUNS[t][plural])
        return " or ".join(words)

    # -- compiled predicates: exactly "validate() yields nothing", fast -----------------------

    def ok(self, schema: dict[str, Any]) -> Pred:
        """The predicate of ``schema``: ``ok(schema)(v)`` is True iff ``validate(v, schema)``
        yields no issue. Compiled once per schema node (memoised; recursion-safe)."""
        hit = self._preds.get(id(schema))
        if hit is not None:
            return hit[1]
        cell: list[Pred] = []
        self._preds[id(schema)] = (schema, lambda v: cell[0](v))  # a $ref cycle calls through the cell
        fn = self._build(schema)
        cell.append(fn)
        self._preds[id(schema)] = (schema, fn)
        return fn

    def _build(self, schema: dict[str, Any]) -> Pred:
        if "$ref" in schema:
            _, target = self.resolve(schema["$ref"])
            t = self.ok(target)
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
            if not rest:
                return t
            r = self._build(rest)
            return lambda v: t(v) and r(v)
        checks: list[Pred] = []
        types = schema.get("type")
        if types == "array" and set(schema) - _ANNOTATIONS <= {"type", "items", "prefixItems", "minItems", "maxItems"}:
            arr_only = self._build_array(schema)  # the common case, one call per value
            if arr_only is None:
                return lambda v: isinstance(v, list)
            return lambda v: isinstance(v, list) and arr_only(v)
        if types is not None:
            names = [types] if isinstance(types, str) else list(types)
            for name in names:
                _is_type(None, name)  # refuses an unknown type name now
            pytypes = tuple(pt for name in names for pt in _PY_TYPES[name])
            allow_bool = "boolean" in names
            if allow_bool:
                checks.append(lambda v: isinstance(v, pytypes))
            else:
                checks.append(lambda v: isinstance(v, pytypes) and not isinstance(v, bool))
        if "enum" in schema:
            enum = schema["enum"]
            checks.append(lambda v: v in enum)
        if "const" in schema:
            const = schema["const"]
            checks.append(lambda v: v == const)
        min_len = schema.get("minLength", 0)
        pattern = re.compile(schema["pattern"]).search if "pattern" in schema else None
        if min_len or pattern is not None:
            def string_ok(v: object) -> bool:
                if not isinstance(v, str):
                    return True
                return len(v) >= min_len and (pattern is None or pattern(v) is not None)
            checks.append(string_ok)
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None or hi is not None:
            def number_ok(v: object) -> bool:
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    return True
                return not ((lo is not None and v < lo) or (hi is not None and v > hi))
            checks.append(number_ok)
        if "anyOf" in schema:
            subs = [self.ok(s) for s in schema["anyOf"]]
            checks.append(lambda v: any(p(v) for p in subs))
        if "oneOf" in schema:
            one = [self.ok(s) for s in schema["oneOf"]]
            checks.append(lambda v: sum(1 for p in one if p(v)) == 1)
        checks.extend(self.ok(s) for s in schema.get("allOf", ()))
        if "if" in schema:
            cond = self.ok(schema["if"])
            then = self.ok(schema["then"]) if "then" in schema else _always
            other = self.ok(schema["else"]) if "else" in schema else _always
            checks.append(lambda v: then(v) if cond(v) else other(v))
        obj = self._build_object(schema)
        if obj is not None:
            checks.append(lambda v: not isinstance(v, dict) or obj(v))
        arr = self._build_array(schema)
        if arr is not None:
            checks.append(lambda v: not isinstance(v, list) or arr(v))
        if not checks:
            return _always
        if len(checks) == 1:
            return checks[0]
        preds = tuple(checks)

        def all_ok(v: object) -> bool:
            for p in preds:
                if not p(v):
                    return False
            return True
        return all_ok

    def _build_object(self, schema: dict[str, Any]) -> Callable[[dict[str, Any]], bool] | None:
        required = tuple(schema.get("required", ()))
        dependent = tuple(schema.get("dependentRequired", {}).items())
        props = {k: self.ok(v) for k, v in schema.get("properties", {}).items()}
        patterns = [(re.compile(p).search, self.ok(s)) for p, s in schema.get("patternProperties", {}).items()]
        extra_schema = schema.get("additionalProperties", True)
        extra: Pred | Literal[False] | None
        if extra_schema is False:
            extra = False
        elif isinstance(extra_schema, dict):
            extra = self.ok(extra_schema)
        else:
            extra = None
        names = self.ok(schema["propertyNames"]) if "propertyNames" in schema else None
        if not (required or dependent or props or patterns or extra is not None or names is not None):
            return None
        per_key = bool(props or patterns or extra is not None or names is not None)
        # A map (no named properties): keys checked in one pass when their schema is a simple
        # string schema, values with one map() call; any failure re-runs the exact loop below.
        is_map = not props and not patterns and extra is not False
        keys_fast = self._fast_list(schema["propertyNames"]) if is_map and names is not None else None
        values_ok: Pred | None = extra if callable(extra) else None
        values_fast = self._fast_values(extra_schema) if is_map and isinstance(extra_schema, dict) else None

        def object_ok(value: dict[str, Any]) -> bool:
            for name in required:
                if name not in value:
                    return False
            for trigger, needed in dependent:
                if trigger in value and any(name not in value for name in needed):
                    return False
            if not per_key:
                return True
            if is_map and (names is None or keys_fast is not None) and len(value) > 8:
                if ((keys_fast is None or keys_fast(list(value)))
                        and (values_ok is None
                             or (values_fast is not None and values_fast(list(value.values())))
                             or all(map(values_ok, value.values())))):
                    return True
            for key, sub in value.items():
                if names is not None and not names(key):
                    return False
                matched = False
                p = props.get(key)
                if p is not None:
                    matched = True
                    if not p(sub):
                        return False
                for search, psub in patterns:
                    if search(key):
                        matched = True
                        if not psub(sub):
                            return False
                if matched:
                    continue
                if extra is False:
                    return False
                if extra is not None and not extra(sub):
                    return False
            return True
        return object_ok

    def _build_array(self, schema: dict[str, Any]) -> Callable[[list[Any]], bool] | None:
        lo, hi = schema.get("minItems"), schema.get("maxItems")
        prefix = [self.ok(s) for s in schema.get("prefixItems", [])]
        item = self.ok(schema["items"]) if "items" in schema else None
        if lo is None and hi is None and not prefix and item is None:
            return None
        fast = self._fast_list(schema["items"]) if item is not None and not prefix else None

        def array_ok(value: list[Any]) -> bool:
            n = len(value)
            if (lo is not None and n < lo) or (hi is not None and n > hi):
                return False
            for p, v in zip(prefix, value, strict=False):
                if not p(v):
                    return False
            if item is None:
                return True
            if fast is not None and n > 16 and fast(value):
                return True
            rest = value[len(prefix):] if prefix else value
            return all(map(item, rest))
        return array_ok

    # -- the fast path for long lists of scalars ---------------------------------------------

    def _scalar(self, schema: dict[str, Any]) -> _Scalar | None:
        """``schema`` as {Python type: constraint on a list of values of that type}, when it
        is a simple scalar schema (type with numeric/string bounds, a bare $ref to one, or an
        anyOf of ones with disjoint types); else None."""
        keys = {k for k in schema if k not in _ANNOTATIONS}
        if keys == {"$ref"}:
            return self._scalar(self.resolve(schema["$ref"])[1])
        if keys == {"anyOf"}:
            merged: _Scalar = {}
            for sub in schema["anyOf"]:
                part = self._scalar(sub)
                if part is None or merged.keys() & part.keys():
                    return None
                merged.update(part)
            return merged
        if "type" not in keys or not keys <= _SCALAR_KEYS:
            return None
        names = [schema["type"]] if isinstance(schema["type"], str) else list(schema["type"])
        if any(t not in _TYPE_EXACT for t in names):
            return None
        lo, hi = schema.get("minimum"), schema.get("maximum")
        min_len = schema.get("minLength", 0)
        pattern = re.compile(schema["pattern"]).search if "pattern" in schema else None

        def numbers(part: list[Any]) -> bool:
            return (lo is None or min(part) >= lo) and (hi is None or max(part) <= hi)

        def strings(part: list[Any]) -> bool:
            if min_len and min(map(len, part)) < min_len:
                return False
            return pattern is None or all(map(pattern, part))

        out: _Scalar = {}
        for t in names:
            for pt in _TYPE_EXACT[t]:
                if pt in (int, float):
                    out[pt] = numbers if (lo is not None or hi is not None) else None
                elif pt is str:
                    out[pt] = strings if (min_len or pattern is not None) else None
                else:
                    out[pt] = None
        return out

    def _fast_list(self, items: dict[str, Any]) -> Callable[[list[Any]], bool] | None:
        """A sufficient check that every item of a list is valid (False: run the exact path),
        for items that are simple scalars: one pass over the element types, then one
        C-level pass per constrained type."""
        spec = self._scalar(items)
        if spec is None:
            return None
        allowed = frozenset(spec)
        single = next(iter(spec.values())) if len(spec) == 1 else None

        def fast(value: list[Any]) -> bool:
            kinds = set(map(type, value))
            if not kinds <= allowed:
                return False
            if len(kinds) == 1:
                cons = single if single is not None else spec[next(iter(kinds))]
                return cons is None or cons(value)
            for t in kinds:
                cons = spec[t]
                if cons is None:
                    continue
                if t is str and kinds == _STR_OR_NONE:  # nullable strings: partition at C speed
                    part = list(filter(None, value))
                    if "" in value:
                        part.append("")
                else:
                    part = [x for x in value if type(x) is t]
                if not cons(part):
                    return False
            return True
        return fast

    def _fast_values(self, schema: dict[str, Any]) -> Callable[[list[Any]], bool] | None:
        """A sufficient check for many values at once (a map's values) when ``schema`` is a
        list of simple scalars: all values lists within the length bounds, their items
        flattened through the fast list check; None when ``schema`` is not of that shape."""
        while set(schema) - _ANNOTATIONS == {"$ref"}:
            schema = self.resolve(schema["$ref"])[1]
        if schema.get("type") != "array" or not set(schema) - _ANNOTATIONS <= {"type", "items", "minItems", "maxItems"}:
            return None
        inner = self._fast_list(schema["items"]) if "items" in schema else None
        if "items" in schema and inner is None:
            return None
        lo, hi = schema.get("minItems"), schema.get("maxItems")

        def fast(values: list[Any]) -> bool:
            if not values:
                return True
            if set(map(type, values)) != {list}:
                return False
            if (lo is not None and min(map(len, values)) < lo) or (hi is not None and max(map(len, values)) > hi):
                return False
            return inner is None or inner(list(chain.from_iterable(values)))
        return fast

    # -- checking ----------------------------------------------------------------------------

    def validate(self, value: object, schema: dict[str, Any], path: tuple[str | int, ...],
                 label: str | None = None) -> Iterator[FormatIssue]:
        """Problems of ``value`` against ``schema``; ``label`` names what is expected there.
        Only values that fail the compiled predicate are walked."""
        if self.ok(schema)(value):
            return
        yield from self._issues(value, schema, path, label)

    def _issues(self, value: object, schema: dict[str, Any], path: tuple[str | int, ...],
                label: str | None) -> Iterator[FormatIssue]:
        if "$ref" in schema:
            _, target = self.resolve(schema["$ref"])
            yield from self.validate(value, target, path, label or self.noun(schema))
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
            if rest and not self._build(rest)(value):  # not memoised: ``rest`` is a new dict each time
                yield from self._issues(value, rest, path, label)
            return

        def bad() -> FormatIssue:
            return FormatIssue(_fmt_path(path), f"expected {label or self.noun(schema)}, got {_show(value)}")

        types = schema.get("type")
        if types is not None:
            if not any(_is_type(value, t) for t in ([types] if isinstance(types, str) else types)):
                yield bad()
                return
        if "enum" in schema and value not in schema["enum"]:
            yield bad()
            return
        if "const" in schema and value != schema["const"]:
            yield bad()
            return
        if isinstance(value, str):
            if len(value) < schema.get("minLength", 0) or (
                    "pattern" in schema and re.search(schema["pattern"], value) is None):
                yield bad()
                return
        if _is_type(value, "number"):
            assert isinstance(value, (int, float))
            if ("minimum" in schema and value < schema["minimum"]) or (
                    "maximum" in schema and value > schema["maximum"]):
                yield bad()
                return
        for comb in ("anyOf", "oneOf"):
            if comb in schema:
                matches = sum(1 for s in schema[comb] if self.ok(s)(value))
                if matches == 0 or (comb == "oneOf" and matches > 1):
                    yield bad()
                    return
        for sub in schema.get("allOf", ()):
            yield from self.validate(value, sub, path, label)
        if "if" in schema:
            branch = "then" if self.ok(schema["if"])(value) else "else"
            if branch in schema:
                yield from self.validate(value, schema[branch], path)
        if isinstance(value, dict):
            yield from self._object(value, schema, path)
        if isinstance(value, list):
            yield from self._array(value, schema, path)

    def _object(self, value: dict[str, Any], schema: dict[str, Any],
                path: tuple[str | int, ...]) -> Iterator[FormatIssue]:
        for name in schema.get("required", ()):
            if name not in value:
                yield FormatIssue(_fmt_path((*path, name)), "required field is missing")
        for trigger, needed in schema.get("dependentRequired", {}).items():
            if trigger in value:
                for name in needed:
                    if name not in value:
                        yield FormatIssue(_fmt_path((*path, name)), f"required when {trigger!r} is present")
        props = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        extra = schema.get("additionalProperties", True)
        names = schema.get("propertyNames")
        names_ok = self.ok(names) if names is not None else None
        for key, sub in value.items():
            here = (*path, key)
            if names is not None and names_ok is not None and not names_ok(key):
                yield FormatIssue(_fmt_path(here), f"invalid key {_show(key)}: expected {self.noun(names)}")
                continue
            matched = False
            if key in props:
                matched = True
                yield from self.validate(sub, props[key], here)
            for pat, psub in patterns.items():
                if re.search(pat, key):
                    matched = True
                    yield from self.validate(sub, psub, here)
            if matched:
                continue
            if extra is False:
                yield FormatIssue(_fmt_path(here), "unknown field (the snapshot schema does not allow it)")
            elif isinstance(extra, dict):
                yield from self.validate(sub, extra, here)

    def _array(self, value: list[Any], schema: dict[str, Any],
               path: tuple[str | int, ...]) -> Iterator[FormatIssue]:
        lo, hi = schema.get("minItems"), schema.get("maxItems")
        if lo is not None and hi is not None and lo == hi and len(value) != lo:
            yield FormatIssue(_fmt_path(path), f"expected exactly {lo} items, got {len(value)}")
            return
        if lo is not None and len(value) < lo:
            yield FormatIssue(_fmt_path(path), f"expected at least {lo} item(s), got {len(value)}")
            return
        if hi is not None and len(value) > hi:
            yield FormatIssue(_fmt_path(path), f"expected at most {hi} item(s), got {len(value)}")
            return
        prefix = schema.get("prefixItems", [])
        items = schema.get("items")
        item_ok = self.ok(items) if items is not None else None
        for i, sub in enumerate(value):
            if i < len(prefix):
                yield from self.validate(sub, prefix[i], (*path, i))
            elif item_ok is not None and not item_ok(sub):
                assert items is not None
                yield from self._issues(sub, items, (*path, i), None)


# -- cross-field rules -----------------------------------------------------------------------


def _consistency_issues(s: dict[str, Any]) -> Iterator[FormatIssue]:
    """Rules between fields: lengths, id ranges, group counts (schema already passed)."""
    sizes = {}
    for pool in ("gpu_pool", "cpu_pool"):
        p = s[pool]
        n = p["num_blocks"]
        sizes[pool] = n
        for field in ("ref_cnt", "block_hash"):
            if len(p[field]) != n:
                yield FormatIssue(f"{pool}.{field}", f"expected one entry per block ({_show(n)}), got {len(p[field])}")
        yield from _ids_in_range(p["free_queue"], n, (pool, "free_queue"))
        every = list(chain.from_iterable(p["cached"].values()))  # one pass for the whole map first
        if every and not (0 <= min(every) and max(every) < n):
            for key, ids in p["cached"].items():
                yield from _ids_in_range(ids, n, (pool, "cached", key))
    gpu_n, cpu_n = sizes["gpu_pool"], sizes["cpu_pool"]

    sched = s["scheduler"]
    sp: tuple[str, ...] = ("scheduler",)
    if sched["lazy_cursor"] is not None:
        yield from _ids_in_range([sched["lazy_cursor"]], gpu_n, (*sp, "lazy_cursor"), single=True)
    for rid, pin in sched["pending_cpu_hits"].items():
        for g, ids in enumerate(pin["blocks"]):
            yield from _ids_in_range(ids, cpu_n, (*sp, "pending_cpu_hits", rid, "blocks", g))
    for section in ("reqs_to_load", "abandoned_reqs_to_load"):
        for rid, ls in sched[section].items():
            yield from _transfer_issues(ls, gpu_n, cpu_n, (*sp, section, rid))
    for section in ("store_events", "abandoned_store_events"):
        for e, t in sched[section].items():
            yield from _transfer_issues(t, gpu_n, cpu_n, (*sp, section, e))
    for i, t in enumerate(sched["pending_finished_stores"]):
        yield from _transfer_issues(t, gpu_n, cpu_n, (*sp, "pending_finished_stores", i))
    for rid, st in sched["reqs_to_store"].items():
        here = (*sp, "reqs_to_store", rid)
        if len(st["num_stored_blocks"]) != len(st["block_ids"]):
            yield FormatIssue(_fmt_path((*here, "num_stored_blocks")),
                              f"expected one cursor per group ({len(st['block_ids'])}), "
                              f"got {len(st['num_stored_blocks'])}")
        for g, ids in enumerate(st["block_ids"]):
            yield from _ids_in_range(ids, gpu_n, (*here, "block_ids", g))
    yield from _ids_in_range(sched["in_flight"], gpu_n, (*sp, "in_flight"))
    lost = sched["policy_state"].get("lost", [])
    for i, rec in enumerate(lost):
        if rec[0] not in sched["reqs_to_store"]:
            yield FormatIssue(_fmt_path((*sp, "policy_state", "lost", i, 0)),
                              f"lost record names request {_show(rec[0])}, which has no store state")
    if "engine" in s:
        yield from _engine_issues(s, gpu_n, cpu_n)


def _engine_issues(s: dict[str, Any], gpu_n: int, cpu_n: int) -> Iterator[FormatIssue]:
    eng = s["engine"]
    cfg = eng["config"]
    ep: tuple[str, ...] = ("engine",)
    for field, n in (("num_gpu_blocks", gpu_n), ("num_cpu_blocks", cpu_n)):
        if cfg[field] != n:
            pool = "gpu_pool" if field == "num_gpu_blocks" else "cpu_pool"
            yield FormatIssue(f"engine.config.{field}", f"is {_show(cfg[field])} but {pool}.num_blocks is {_show(n)}")
    if cfg["policy"] != s["scheduler"]["policy"]:
        yield FormatIssue("engine.config.policy",
                          f"is {_show(cfg['policy'])} but scheduler.policy is {_show(s['scheduler']['policy'])}")
    groups = len(cfg["groups"])
    for field, n in (("gpu_data", gpu_n), ("cpu_data", cpu_n)):
        if len(eng[field]) != n:
            yield FormatIssue(f"engine.{field}", f"expected one entry per block ({_show(n)}), got {len(eng[field])}")
    bs = cfg["block_size"]
    for rid, r in eng["requests"].items():
        here = (*ep, "requests", rid)
        if len(r["table"]) != groups:
            yield FormatIssue(_fmt_path((*here, "table")), f"expected one table per group ({groups}), "
                              f"got {len(r['table'])}")
        for g, ids in enumerate(r["table"]):
            yield from _ids_in_range(ids, gpu_n, (*here, "table", g))
        if r["num_computed_tokens"] > r["num_tokens"]:
            yield FormatIssue(_fmt_path((*here, "num_computed_tokens")),
                              f"{_show(r['num_computed_tokens'])} exceeds num_tokens {_show(r['num_tokens'])}")
        elif r["status"] in ("running", "loaded"):
            need = max((min(r["num_computed_tokens"] // bs, len(t)) for t in r["table"]), default=0)
            if len(r["block_hashes"]) < need:
                yield FormatIssue(_fmt_path((*here, "block_hashes")),
                                  f"has {len(r['block_hashes'])} hashes, the computed blocks need {need}")
    sched = s["scheduler"]
    for rid, st in sched["reqs_to_store"].items():
        if len(st["block_ids"]) != groups:
            yield FormatIssue(_fmt_path(("scheduler", "reqs_to_store", rid, "block_ids")),
                              f"expected one list per group ({groups}), got {len(st['block_ids'])}")
    for rid, pin in sched["pending_cpu_hits"].items():
        if len(pin["blocks"]) != groups:
            yield FormatIssue(_fmt_path(("scheduler", "pending_cpu_hits", rid, "blocks")),
                              f"expected one list per group ({groups}), got {len(pin['blocks'])}")
    for e, data in eng["store_selection_confirmed"].items():
        t = sched["store_events"].get(e)
        if t is not None and len(data) != len(t["gpu"]):
            yield FormatIssue(_fmt_path((*ep, "store_selection_confirmed", e)),
                              f"expected one entry per GPU block of store event {_show(e)} ({len(t['gpu'])}), "
                              f"got {len(data)}")
    for pool in ("gpu_pool", "cpu_pool"):
        for key in s[pool]["cached"]:
            g = int(key.rpartition(":")[2])  # the schema's key pattern bounds the group to 9 digits
            if g >= groups:
                yield FormatIssue(_fmt_path((pool, "cached", key)), f"key names group {g}, the config has {groups}")
    try:
        from kvspec.contract.config import OffloadConfig

        OffloadConfig.from_json(cfg)
    except KVSpecError as exc:
        yield FormatIssue("engine.config", f"not a valid configuration: {exc}")


def _ids_in_range(ids: list[int], n: int, path: tuple[str | int, ...],
                  single: bool = False) -> Iterator[FormatIssue]:
    if not ids or (0 <= min(ids) and max(ids) < n):  # one C-level pass each for long lists
        return
    for i, b in enumerate(ids):
        if not 0 <= b < n:
            where = path if single else (*path, i)
            yield FormatIssue(_fmt_path(where), f"block id {_show(b)} out of range 0..{_show(n - 1)}")


def _transfer_issues(t: dict[str, Any], gpu_n: int, cpu_n: int,
                     path: tuple[str | int, ...]) -> Iterator[FormatIssue]:
    if len(t["gpu"]) != len(t["cpu"]):
        yield FormatIssue(_fmt_path(path), f"gpu and cpu lists differ in length ({len(t['gpu'])} vs {len(t['cpu'])})")
    yield from _ids_in_range(t["gpu"], gpu_n, (*path, "gpu"))
    yield from _ids_in_range(t["cpu"], cpu_n, (*path, "cpu"))
