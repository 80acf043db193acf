"""Reading and validating snapshot files against ``kvspec/schema/snapshot.schema.json``.

A snapshot is what ``OffloadTarget.snapshot()`` (and the engine model's
``Engine.snapshot()``) returns; ``kvspec check-snapshot`` reads one from a file so
that any engine able to dump its state in this format can be checked against the
invariant catalogue. Validation runs in two passes, and the first problem found is
raised as :class:`~kvspec.errors.SnapshotFormatError` naming the field path and why,
e.g. ``scheduler.reqs_to_store.R1.num_stored_blocks: expected a list of integers,
got "x"``:

1. **Schema.** A small validator for the subset of JSON Schema (draft 2020-12) the
   schema file uses; it refuses a schema with any other keyword, so it can never
   silently ignore a rule (no dependency is added for this).
2. **Cross-field rules** JSON Schema cannot state: per-block lists as long as the
   pool, every block id in range for its pool, parallel lists of equal length, one
   list per KV group, and (with an ``engine`` section) agreement with its config.
   After both passes every invariant of ``kvspec.model.invariants`` can be evaluated
   on the snapshot without an index or key error.

Paths are written ``a.b[3].c``; a key that is not a plain word is quoted
(``scheduler.reqs_to_store["req 1"]``); the root is ``(root)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from kvspec.errors import SnapshotFormatError

SCHEMA_RESOURCE = "snapshot.schema.json"

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
    text = resources.files("kvspec").joinpath("schema", SCHEMA_RESOURCE).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    unsupported = sorted(_unsupported_keywords(schema))
    if unsupported:
        raise RuntimeError(f"snapshot schema uses keywords the validator does not implement: {unsupported}")
    return schema


def snapshot_issues(snapshot: object) -> list[FormatIssue]:
    """Every schema problem of ``snapshot``; if there is none, every cross-field problem."""
    schema = load_schema()
    issues = list(_Validator(schema).validate(snapshot, schema, ()))
    if issues:
        return issues
    assert isinstance(snapshot, dict)
    return list(_consistency_issues(snapshot))


def validate_snapshot(snapshot: object) -> dict[str, Any]:
    """Return ``snapshot`` if it follows the format; else raise ``SnapshotFormatError``
    for the first problem (the exception's ``issues`` holds them all)."""
    issues = snapshot_issues(snapshot)
    if issues:
        more = f" (and {len(issues) - 1} more problem(s))" if len(issues) > 1 else ""
        err = SnapshotFormatError(f"{issues[0]}{more}")
        err.issues = issues  # type: ignore[attr-defined]
        err.path = issues[0].path  # type: ignore[attr-defined]
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
        raise SnapshotFormatError(f"{source}: {exc}") from None
    return validate_snapshot(data)


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Read a snapshot file and validate it; ``SnapshotFormatError`` names what is wrong."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SnapshotFormatError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SnapshotFormatError(f"{p}: cannot read: {exc.strerror or exc}") from None
    return parse_snapshot(text, str(p))


def dump_snapshot(snapshot: dict[str, Any], path: str | Path) -> None:
    """Write ``snapshot`` as JSON (keys in the snapshot's own order); validates first, so
    that only well-formed files are written."""
    validate_snapshot(snapshot)
    Path(path).write_text(json.dumps(snapshot, indent=1) + "\n", encoding="utf-8")


# -- JSON parsing helpers --------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {json.dumps(k)} in one JSON object")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# -- paths and values in messages ------------------------------------------------------------

_WORD = re.compile(r"^[A-Za-z0-9_\-]+$")


def _fmt_path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _WORD.match(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out or "(root)"


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


def _is_type(value: object, t: str) -> bool:
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    if t == "string":
        return isinstance(value, str)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    raise RuntimeError(f"unknown JSON Schema type {t!r}")


class _Validator:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

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

    # -- checking ----------------------------------------------------------------------------

    def validate(self, value: object, schema: dict[str, Any], path: tuple[str | int, ...],
                 label: str | None = None) -> Iterator[FormatIssue]:
        """Problems of ``value`` against ``schema``; ``label`` names what is expected there."""
        if "$ref" in schema:
            _, target = self.resolve(schema["$ref"])
            yield from self.validate(value, target, path, label or self.noun(schema))
            rest = {k: v for k, v in schema.items() if k != "$ref" and k not in _ANNOTATIONS}
            if rest:
                yield from self.validate(value, rest, path, label)
            return
        expected = label or self.noun(schema)
        bad = FormatIssue(_fmt_path(path), f"expected {expected}, got {_show(value)}")

        types = schema.get("type")
        if types is not None:
            if not any(_is_type(value, t) for t in ([types] if isinstance(types, str) else types)):
                yield bad
                return
        if "enum" in schema and value not in schema["enum"]:
            yield bad
            return
        if "const" in schema and value != schema["const"]:
            yield bad
            return
        if isinstance(value, str):
            if len(value) < schema.get("minLength", 0) or (
                    "pattern" in schema and re.search(schema["pattern"], value) is None):
                yield bad
                return
        if _is_type(value, "number"):
            assert isinstance(value, (int, float))
            if ("minimum" in schema and value < schema["minimum"]) or (
                    "maximum" in schema and value > schema["maximum"]):
                yield bad
                return
        for comb in ("anyOf", "oneOf"):
            if comb in schema:
                matches = sum(1 for s in schema[comb] if not any(self.validate(value, s, path)))
                if matches == 0 or (comb == "oneOf" and matches > 1):
                    yield bad
                    return
        for sub in schema.get("allOf", ()):
            yield from self.validate(value, sub, path, label)
        if "if" in schema:
            branch = "then" if not any(self.validate(value, schema["if"], path)) else "else"
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
        for key, sub in value.items():
            here = (*path, key)
            if names is not None and any(self.validate(key, names, ())):
                yield FormatIssue(_fmt_path(here), f"invalid key {json.dumps(key)}: expected {self.noun(names)}")
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
        for i, sub in enumerate(value):
            if i < len(prefix):
                yield from self.validate(sub, prefix[i], (*path, i))
            elif "items" in schema:
                yield from self.validate(sub, schema["items"], (*path, i))


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
                yield FormatIssue(f"{pool}.{field}", f"expected one entry per block ({n}), got {len(p[field])}")
        yield from _ids_in_range(p["free_queue"], n, (pool, "free_queue"))
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
                              f"lost record names request {json.dumps(rec[0])}, which has no store state")
    if "engine" in s:
        yield from _engine_issues(s, gpu_n, cpu_n)


def _engine_issues(s: dict[str, Any], gpu_n: int, cpu_n: int) -> Iterator[FormatIssue]:
    eng = s["engine"]
    cfg = eng["config"]
    ep: tuple[str, ...] = ("engine",)
    for field, n in (("num_gpu_blocks", gpu_n), ("num_cpu_blocks", cpu_n)):
        if cfg[field] != n:
            pool = "gpu_pool" if field == "num_gpu_blocks" else "cpu_pool"
            yield FormatIssue(f"engine.config.{field}", f"is {cfg[field]} but {pool}.num_blocks is {n}")
    groups = len(cfg["groups"])
    for field, n in (("gpu_data", gpu_n), ("cpu_data", cpu_n)):
        if len(eng[field]) != n:
            yield FormatIssue(f"engine.{field}", f"expected one entry per block ({n}), got {len(eng[field])}")
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
                              f"{r['num_computed_tokens']} exceeds num_tokens {r['num_tokens']}")
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
                              f"expected one entry per GPU block of store event {e} ({len(t['gpu'])}), "
                              f"got {len(data)}")
    for pool in ("gpu_pool", "cpu_pool"):
        for key in s[pool]["cached"]:
            g = int(key.rpartition(":")[2])
            if g >= groups:
                yield FormatIssue(_fmt_path((pool, "cached", key)), f"key names group {g}, the config has {groups}")


def _ids_in_range(ids: list[int], n: int, path: tuple[str | int, ...],
                  single: bool = False) -> Iterator[FormatIssue]:
    for i, b in enumerate(ids):
        if not 0 <= b < n:
            where = path if single else (*path, i)
            yield FormatIssue(_fmt_path(where), f"block id {b} out of range 0..{n - 1}")


def _transfer_issues(t: dict[str, Any], gpu_n: int, cpu_n: int,
                     path: tuple[str | int, ...]) -> Iterator[FormatIssue]:
    if len(t["gpu"]) != len(t["cpu"]):
        yield FormatIssue(_fmt_path(path), f"gpu and cpu lists differ in length ({len(t['gpu'])} vs {len(t['cpu'])})")
    yield from _ids_in_range(t["gpu"], gpu_n, (*path, "gpu"))
    yield from _ids_in_range(t["cpu"], cpu_n, (*path, "cpu"))
