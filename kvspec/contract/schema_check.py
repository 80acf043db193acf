"""A compiled validator for the subset of JSON Schema (draft 2020-12) that kvspec's schemas use.

It knows JSON and JSON Schema, nothing of what a schema describes (the snapshot rules live in
``kvspec.contract.snapshot_io``). Problems are ``FormatIssue``s: a field path and why, e.g.
``scheduler.reqs_to_store.R1.num_stored_blocks: expected a list of integers, got "x"``.

* **Keywords.** ``SUPPORTED_KEYWORDS`` are the assertions and applicators it implements and the
  annotations it may ignore; ``unsupported_keywords`` finds any other, so that a schema can be
  refused rather than silently half-checked (no dependency is added for this).
* **Speed.** Each schema node is compiled once into an exact predicate (valid or not); the
  message-producing walk runs only below nodes that fail it, so a valid document costs one
  predicate pass. Lists whose items are simple scalars (ids, counts, nullable strings) are
  checked with one C-level pass over their element types, then per-type constraint passes
  (``min``/``max``, ``len``, the pattern) instead of one call per element: 10^6-element lists
  validate in well under a second.
* **Depth.** ``depth_issue`` (a Python value) and ``deep_path_in_text`` (JSON text) find a list
  or object nested deeper than a limit without recursion, so that neither the JSON parser nor
  the validator can hit Python's recursion limit.
* **Messages** are bounded: values are shown as at most ``SHOW_LIMIT`` characters of JSON, keys
  and paths are cut (``a.b["rrrr…" (5000000 chars)].c``). Paths are written ``a.b[3].c``; a key
  that is not a plain word is quoted (``a["req 1"]``); the root is ``(root)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

SHOW_LIMIT = 60  # characters of JSON a message shows of a value
KEY_LIMIT = 40  # characters a path shows of one key
PATH_LIMIT = 160  # characters a path shows in all
SCALAR_RUN = 32  # containers up to this size are looked at together by the depth pass
FAST_LIST_MIN = 16  # lists longer than this try the one-pass scalar check first
FAST_MAP_MIN = 8  # maps larger than this try the one-pass key and value checks first

# Keywords the validator implements (assertions and applicators) or may ignore (annotations).
ANNOTATIONS = frozenset({"$schema", "$id", "$defs", "$comment", "title", "description", "default", "examples"})
ASSERTIONS = frozenset({
    "$ref", "type", "enum", "const", "pattern", "minLength", "minimum", "maximum",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "dependentRequired", "items", "prefixItems", "minItems", "maxItems", "anyOf", "oneOf", "allOf",
    "if", "then", "else",
})
SUPPORTED_KEYWORDS = ANNOTATIONS | ASSERTIONS
_ARRAY_ONLY_KEYS = frozenset({"type", "items", "prefixItems", "minItems", "maxItems"})

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


# -- keywords --------------------------------------------------------------------------------


def unsupported_keywords(schema: object) -> Iterator[str]:
    """Keywords anywhere in ``schema`` that the validator does not implement."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k not in SUPPORTED_KEYWORDS:
                yield k
            if k in ("properties", "patternProperties", "$defs", "dependentRequired"):
                if k != "dependentRequired":
                    for sub in v.values():
                        yield from unsupported_keywords(sub)
            elif k in ("enum", "const", "required", "default", "examples"):
                continue
            elif isinstance(v, (dict, list)):
                yield from unsupported_keywords(v)
    elif isinstance(schema, list):
        for sub in schema:
            yield from unsupported_keywords(sub)


# -- JSON parsing helpers --------------------------------------------------------------------


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` refusing a key given twice in one object."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {show(k)} in one JSON object")
            seen.add(k)
    return out


def no_constant(name: str) -> Any:
    """``json.loads``' ``parse_constant`` refusing ``NaN`` and the infinities."""
    raise ValueError(f"{name} is not a JSON number")


# -- depth -----------------------------------------------------------------------------------

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.DOTALL)
_CONTAINERS = (dict, list)


def too_deep(max_depth: int) -> str:
    """The reason a value nested deeper than ``max_depth`` is refused."""
    return f"nesting too deep (more than {max_depth} levels of lists and objects)"


def deep_path_in_text(text: str, max_depth: int) -> tuple[str | int, ...] | None:
    """The path of the first list or object nested deeper than ``max_depth`` in JSON ``text``
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
            if len(stack) >= max_depth:
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


def _containers(obj: dict[str, Any] | list[Any]) -> list[Any]:
    """The lists and objects directly inside ``obj``; a long run of scalars costs one C-level
    pass over the element types."""
    items = obj.values() if isinstance(obj, dict) else obj
    if len(obj) > SCALAR_RUN and not any(issubclass(t, _CONTAINERS) for t in set(map(type, items))):
        return []
    return [v for v in items if isinstance(v, _CONTAINERS)]


def depth_issue(value: object, max_depth: int) -> FormatIssue | None:
    """A FormatIssue for the first list or object nested deeper than ``max_depth`` (the root
    counting as 1), else None. Iterative, level by level: visits containers only; the path is
    looked up only when one is too deep."""
    if not isinstance(value, _CONTAINERS):
        return None
    level, depth = [value], 1
    while True:
        below, small = [], []
        for obj in level:
            if type(obj) is list and len(obj) <= SCALAR_RUN:
                small.append(obj)  # e.g. a million one-block lists of a prefix map: looked at together
            else:
                below.extend(_containers(obj))
        if small:
            flat = list(chain.from_iterable(small))
            if any(issubclass(t, _CONTAINERS) for t in set(map(type, flat))):
                below.extend(c for c in flat if isinstance(c, _CONTAINERS))
        if not below:
            return None
        if depth >= max_depth:
            return FormatIssue(fmt_path(_path_to_depth(value, depth + 1)), too_deep(max_depth))
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


def fmt_path(path: tuple[str | int, ...]) -> str:
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


def show(value: object) -> str:
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


# -- types -----------------------------------------------------------------------------------

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
ListPred = Callable[[list[Any]], bool]

# A simple scalar schema, as the fast list check sees it: Python type -> constraint (or None).
_Scalar = dict[type, "ListPred | None"]
_SCALAR_KEYS = frozenset({"type", "minimum", "maximum", "minLength", "pattern"})
_TYPE_EXACT: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "string": (str,), "null": (type(None),), "boolean": (bool,),
}
_STR_OR_NONE = frozenset({str, type(None)})


def _always(_: object) -> bool:
    return True


def _all_of(checks: list[Pred]) -> Pred:
    """One predicate for a conjunction of checks (the common small cases without a loop)."""
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


@dataclass(frozen=True)
class _ObjectRules:
    """An object schema, compiled: ``ok(value)`` is its exact predicate on a dict."""

    required: tuple[str, ...]
    dependent: tuple[tuple[str, Any], ...]
    props: dict[str, Pred]
    patterns: tuple[tuple[Callable[[str], object], Pred], ...]
    extra: Pred | Literal[False] | None  # additionalProperties: a schema, refused, or anything
    names: Pred | None  # propertyNames
    keys_fast: ListPred | None  # a map's keys in one pass (sufficient, not necessary)
    values_fast: ListPred | None  # a map's values in one pass (sufficient, not necessary)
    is_map: bool  # no named properties: keys and values may be checked in bulk

    @property
    def per_key(self) -> bool:
        return bool(self.props or self.patterns or self.extra is not None or self.names is not None)

    def ok(self, value: dict[str, Any]) -> bool:
        for name in self.required:
            if name not in value:
                return False
        for trigger, needed in self.dependent:
            if trigger in value and any(name not in value for name in needed):
                return False
        if not self.per_key:
            return True
        if self.is_map and (self.names is None or self.keys_fast is not None) and len(value) > FAST_MAP_MIN \
                and self._map_ok_fast(value):
            return True
        return all(self._entry_ok(key, sub) for key, sub in value.items())

    def _map_ok_fast(self, value: dict[str, Any]) -> bool:
        values_ok = self.extra if callable(self.extra) else None
        return ((self.keys_fast is None or self.keys_fast(list(value)))
                and (values_ok is None
                     or (self.values_fast is not None and self.values_fast(list(value.values())))
                     or all(map(values_ok, value.values()))))

    def _entry_ok(self, key: str, sub: object) -> bool:
        if self.names is not None and not self.names(key):
            return False
        matched = False
        p = self.props.get(key)
        if p is not None:
            matched = True
            if not p(sub):
                return False
        for search, psub in self.patterns:
            if search(key):
                matched = True
                if not psub(sub):
                    return False
        if matched or self.extra is None:
            return True
        return self.extra is not False and self.extra(sub)


def packaged_schema(resource: str) -> dict[str, Any]:
    """The schema file ``resource`` shipped in ``kvspec/contract/schema/``, refused
    (``RuntimeError``) if it uses a keyword the validator does not implement."""
    from importlib import resources

    text = resources.files("kvspec.contract").joinpath("schema", resource).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    unsupported = sorted(unsupported_keywords(schema))
    if unsupported:
        raise RuntimeError(f"{resource} uses keywords the validator does not implement: {unsupported}")
    return schema


class SchemaValidator:
    """Validates values against ``root`` (a schema using only ``SUPPORTED_KEYWORDS``, with local
    ``#/$defs/...`` references). ``def_nouns`` names what a referenced definition expects in
    messages (``{"block_id": ("a block id", "block ids")}``); other definitions are described
    from their own keywords. ``name`` is how messages call the schema."""

    def __init__(self, root: dict[str, Any], def_nouns: Mapping[str, tuple[str, str]] | None = None,
                 name: str = "schema") -> None:
        self.root = root
        self.def_nouns = dict(def_nouns or {})
        self.name = name
        self._preds: dict[int, tuple[dict[str, Any], Pred]] = {}

    def resolve(self, ref: str) -> tuple[str, dict[str, Any]]:
        if not ref.startswith("#/$defs/"):
            raise RuntimeError(f"only local '#/$defs/...' references are supported, got {ref!r}")
        name = ref[len("#/$defs/") :]
        return name, self.root["$defs"][name]

    def issues(self, value: object) -> list[FormatIssue]:
        """Every problem of ``value`` against the root schema (none: valid)."""
        return list(self.validate(value, self.root, ()))

    # -- describing what a schema expects ----------------------------------------------------

    def noun(self, schema: dict[str, Any], plural: bool = False) -> str:
        if "$ref" in schema:
            name, target = self.resolve(schema["$ref"])
            if name in self.def_nouns:
                return self.def_nouns[name][plural]
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
        names = [types] if isinstance(types, str) else list(types)
        return " or ".join(self._type_noun(schema, t, plural, len(names) == 1) for t in names)

    def _type_noun(self, schema: dict[str, Any], t: str, plural: bool, only: bool) -> str:
        """How values of type ``t`` under ``schema`` read (``only``: the schema's one type)."""
        if t == "array" and "items" in schema and only:
            return ("lists of " if plural else "a list of ") + self.noun(schema["items"], True)
        if t == "integer" and "minimum" in schema:
            lo = schema["minimum"]
            if lo == 0:
                return "non-negative integers" if plural else "a non-negative integer"
            return f"integers >= {lo}" if plural else f"an integer >= {lo}"
        if t == "string" and "pattern" in schema:
            return f"{_TYPE_NOUNS[t][plural]} matching /{schema['pattern']}/"
        if t == "string" and schema.get("minLength") == 1:
            return "non-empty strings" if plural else "a non-empty string"
        return _TYPE_NOUNS[t][plural]

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
            return self._build_ref(schema)
        if schema.get("type") == "array" and set(schema) - ANNOTATIONS <= _ARRAY_ONLY_KEYS:
            arr_only = self._build_array(schema)  # the common case, one call per value
            if arr_only is None:
                return lambda v: isinstance(v, list)
            return lambda v: isinstance(v, list) and arr_only(v)
        return _all_of([*self._scalar_checks(schema), *self._applicator_checks(schema),
                        *self._container_checks(schema)])

    def _build_ref(self, schema: dict[str, Any]) -> Pred:
        _, target = self.resolve(schema["$ref"])
        t = self.ok(target)
        rest = {k: v for k, v in schema.items() if k != "$ref" and k not in ANNOTATIONS}
        if not rest:
            return t
        r = self._build(rest)
        return lambda v: t(v) and r(v)

    def _scalar_checks(self, schema: dict[str, Any]) -> list[Pred]:
        """``type``, ``enum``, ``const``, and the string and number bounds."""
        checks: list[Pred] = []
        types = schema.get("type")
        if types is not None:
            names = [types] if isinstance(types, str) else list(types)
            for name in names:
                _is_type(None, name)  # refuses an unknown type name now
            pytypes = tuple(pt for name in names for pt in _PY_TYPES[name])
            if "boolean" in names:
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
            checks.append(lambda v: not isinstance(v, str) or (
                len(v) >= min_len and (pattern is None or pattern(v) is not None)))
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None or hi is not None:
            checks.append(lambda v: not isinstance(v, (int, float)) or isinstance(v, bool) or not (
                (lo is not None and v < lo) or (hi is not None and v > hi)))
        return checks

    def _applicator_checks(self, schema: dict[str, Any]) -> list[Pred]:
        """``anyOf``, ``oneOf``, ``allOf`` and ``if``/``then``/``else``."""
        checks: list[Pred] = []
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
        return checks

    def _container_checks(self, schema: dict[str, Any]) -> list[Pred]:
        """The object and array keywords, each applying to values of its own type only."""
        checks: list[Pred] = []
        obj = self._build_object(schema)
        if obj is not None:
            checks.append(lambda v: not isinstance(v, dict) or obj.ok(v))
        arr = self._build_array(schema)
        if arr is not None:
            checks.append(lambda v: not isinstance(v, list) or arr(v))
        return checks

    def _build_object(self, schema: dict[str, Any]) -> _ObjectRules | None:
        extra_schema = schema.get("additionalProperties", True)
        extra: Pred | Literal[False] | None
        if extra_schema is False:
            extra = False
        elif isinstance(extra_schema, dict):
            extra = self.ok(extra_schema)
        else:
            extra = None
        names = self.ok(schema["propertyNames"]) if "propertyNames" in schema else None
        props = {k: self.ok(v) for k, v in schema.get("properties", {}).items()}
        patterns: tuple[tuple[Callable[[str], object], Pred], ...] = tuple(
            (re.compile(p).search, self.ok(s)) for p, s in schema.get("patternProperties", {}).items())
        # A map (no named properties): keys checked in one pass when their schema is a simple
        # string schema, values in one pass when they are lists of simple scalars.
        is_map = not props and not patterns and extra is not False
        rules = _ObjectRules(
            required=tuple(schema.get("required", ())), dependent=tuple(schema.get("dependentRequired", {}).items()),
            props=props, patterns=patterns, extra=extra, names=names,
            keys_fast=self._fast_list(schema["propertyNames"]) if is_map and names is not None else None,
            values_fast=self._fast_values(extra_schema) if is_map and isinstance(extra_schema, dict) else None,
            is_map=is_map)
        return rules if rules.required or rules.dependent or rules.per_key else None

    def _build_array(self, schema: dict[str, Any]) -> ListPred | None:
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
            if fast is not None and n > FAST_LIST_MIN and fast(value):
                return True
            rest = value[len(prefix):] if prefix else value
            return all(map(item, rest))
        return array_ok

    # -- the fast path for long lists of scalars ---------------------------------------------

    def _scalar(self, schema: dict[str, Any]) -> _Scalar | None:
        """``schema`` as {Python type: constraint on a list of values of that type}, when it
        is a simple scalar schema (type with numeric/string bounds, a bare $ref to one, or an
        anyOf of ones with disjoint types); else None."""
        keys = {k for k in schema if k not in ANNOTATIONS}
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
        return _scalar_constraints(schema, names)

    def _fast_list(self, items: dict[str, Any]) -> ListPred | None:
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

    def _fast_values(self, schema: dict[str, Any]) -> ListPred | None:
        """A sufficient check for many values at once (a map's values) when ``schema`` is a
        list of simple scalars: all values lists within the length bounds, their items
        flattened through the fast list check; None when ``schema`` is not of that shape."""
        while set(schema) - ANNOTATIONS == {"$ref"}:
            schema = self.resolve(schema["$ref"])[1]
        if schema.get("type") != "array" or not set(schema) - ANNOTATIONS <= {"type", "items", "minItems", "maxItems"}:
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
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in ANNOTATIONS}
            if rest and not self._build(rest)(value):  # not memoised: ``rest`` is a new dict each time
                yield from self._issues(value, rest, path, label)
            return
        if not self._scalar_ok(value, schema):
            yield FormatIssue(fmt_path(path), f"expected {label or self.noun(schema)}, got {show(value)}")
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

    def _scalar_ok(self, value: object, schema: dict[str, Any]) -> bool:
        """The keywords whose failure is one "expected X, got Y" issue: type, enum, const, the
        string and number bounds, anyOf and oneOf."""
        types = schema.get("type")
        if types is not None and not any(_is_type(value, t) for t in ([types] if isinstance(types, str) else types)):
            return False
        if ("enum" in schema and value not in schema["enum"]) or ("const" in schema and value != schema["const"]):
            return False
        if isinstance(value, str) and (len(value) < schema.get("minLength", 0) or (
                "pattern" in schema and re.search(schema["pattern"], value) is None)):
            return False
        if _is_type(value, "number"):
            assert isinstance(value, (int, float))
            if ("minimum" in schema and value < schema["minimum"]) or (
                    "maximum" in schema and value > schema["maximum"]):
                return False
        for comb in ("anyOf", "oneOf"):
            if comb in schema:
                matches = sum(1 for s in schema[comb] if self.ok(s)(value))
                if matches == 0 or (comb == "oneOf" and matches > 1):
                    return False
        return True

    def _object(self, value: dict[str, Any], schema: dict[str, Any],
                path: tuple[str | int, ...]) -> Iterator[FormatIssue]:
        for name in schema.get("required", ()):
            if name not in value:
                yield FormatIssue(fmt_path((*path, name)), "required field is missing")
        for trigger, needed in schema.get("dependentRequired", {}).items():
            if trigger in value:
                for name in needed:
                    if name not in value:
                        yield FormatIssue(fmt_path((*path, name)), f"required when {trigger!r} is present")
        names = schema.get("propertyNames")
        names_ok = self.ok(names) if names is not None else None
        for key, sub in value.items():
            if names is not None and names_ok is not None and not names_ok(key):
                yield FormatIssue(fmt_path((*path, key)), f"invalid key {show(key)}: expected {self.noun(names)}")
                continue
            yield from self._entry(key, sub, schema, (*path, key))

    def _entry(self, key: str, sub: object, schema: dict[str, Any],
               here: tuple[str | int, ...]) -> Iterator[FormatIssue]:
        """Problems of one object entry against the properties, patterns and extra schema."""
        matched = False
        props = schema.get("properties", {})
        if key in props:
            matched = True
            yield from self.validate(sub, props[key], here)
        for pat, psub in schema.get("patternProperties", {}).items():
            if re.search(pat, key):
                matched = True
                yield from self.validate(sub, psub, here)
        if matched:
            return
        extra = schema.get("additionalProperties", True)
        if extra is False:
            yield FormatIssue(fmt_path(here), f"unknown field (the {self.name} does not allow it)")
        elif isinstance(extra, dict):
            yield from self.validate(sub, extra, here)

    def _array(self, value: list[Any], schema: dict[str, Any],
               path: tuple[str | int, ...]) -> Iterator[FormatIssue]:
        lo, hi = schema.get("minItems"), schema.get("maxItems")
        if lo is not None and hi is not None and lo == hi and len(value) != lo:
            yield FormatIssue(fmt_path(path), f"expected exactly {lo} items, got {len(value)}")
            return
        if lo is not None and len(value) < lo:
            yield FormatIssue(fmt_path(path), f"expected at least {lo} item(s), got {len(value)}")
            return
        if hi is not None and len(value) > hi:
            yield FormatIssue(fmt_path(path), f"expected at most {hi} item(s), got {len(value)}")
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


def _scalar_constraints(schema: dict[str, Any], names: list[str]) -> _Scalar:
    """{Python type: constraint on a list of its values} for a scalar schema of types ``names``."""
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
