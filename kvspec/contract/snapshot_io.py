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
1. **Schema.** The schema file, checked by the general validator of
   ``kvspec.contract.schema_check`` (a compiled subset of JSON Schema; it refuses a schema
   with any other keyword, so it can never silently ignore a rule).
2. **Cross-field rules** JSON Schema cannot state: per-block lists as long as the
   pool, every block id in range for its pool, parallel lists of equal length, one
   list per KV group, and (with an ``engine`` section) agreement with its config.
   After these passes every invariant of ``kvspec.oracle.catalogue`` can be evaluated
   on the snapshot without an index or key error.

Speed: a valid snapshot costs one compiled predicate pass plus the cross-field rules, each
one C-level pass over a long list (``min``/``max``): a snapshot with 10^6-block pools validates
in well under a second. Messages are bounded (``schema_check``), so a huge input is never
echoed whole.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Iterator
from functools import cache
from itertools import chain
from pathlib import Path
from typing import Any

from kvspec.contract.errors import KVSpecError, SnapshotFormatError
from kvspec.contract.offloading_snapshot_io import offloading_snapshot_issues
from kvspec.contract.schema_check import (
    FormatIssue,
    SchemaValidator,
    deep_path_in_text,
    depth_issue,
    fmt_path,
    no_constant,
    no_duplicate_keys,
    packaged_schema,
    show,
    too_deep,
)

SCHEMA_RESOURCE = "snapshot.schema.json"
FORMAT_VERSION = 1  # written by dump_snapshot as "format_version"; read: this one, and none (below)
VERSION_FIELD = "format_version"
# Snapshots written before the format had a version carry no "format_version": they are read as
# version 1, the format they follow. An older draft of that format (before C7/C8 judged every
# finish flush) recorded an abort's flush as engine.last_finish, replaced by engine.finishes: the
# old field lacks what the new one records, so such a snapshot is refused by name.
OLDER_FIELDS = {("engine", "last_finish"): "engine.finishes (the draft before version 1 recorded one abort's "
                                            "flush, without the facts C7 and C8 now read)"}
MAX_SNAPSHOT_BYTES = 256 << 20  # a file larger than this is refused before it is parsed
MAX_DEPTH = 64  # levels of nested lists/objects, the root object counting as 1
FILE_NAME_LIMIT = 200  # characters of a file name a message shows whole

# How a referenced definition of the snapshot schema reads in an error message: (singular, plural).
DEF_NOUNS = {
    "block_id": ("a block id (integer)", "block ids (integers)"),
    "block_ids": ("a list of block ids (integers)", "lists of block ids (integers)"),
    "block_ids_per_group": ("a list of block-id lists, one per KV group",
                            "lists of block-id lists, one per KV group"),
    "key": ('a cache key "<hash>:<group>"', 'cache keys "<hash>:<group>"'),
    "event_id": ("an event id (a decimal string)", "event ids (decimal strings)"),
    "request_id": ("a request id (a non-empty string)", "request ids (non-empty strings)"),
    "count": ("a non-negative integer", "non-negative integers"),
}


# -- public API ------------------------------------------------------------------------------


@cache
def load_schema() -> dict[str, Any]:
    """The snapshot schema shipped with kvspec (checked to use only supported keywords)."""
    return packaged_schema(SCHEMA_RESOURCE)


@cache
def _validator() -> SchemaValidator:
    return SchemaValidator(load_schema(), DEF_NOUNS, "snapshot schema")


def snapshot_issues(snapshot: object) -> list[FormatIssue]:
    """Every schema problem of ``snapshot``; if there is none, every cross-field problem.
    A value nested deeper than :data:`MAX_DEPTH` is the only problem reported."""
    deep = depth_issue(snapshot, MAX_DEPTH)
    if deep is not None:
        return [deep]
    version = version_issue(snapshot)
    if version is not None:
        return [version]
    if isinstance(snapshot, dict) and "manager" in snapshot:
        return _manager_issues(snapshot)
    try:
        issues = _validator().issues(snapshot)
        if issues:
            return issues
        assert isinstance(snapshot, dict)
        return list(_consistency_issues(snapshot))
    except RecursionError:  # not reachable after the depth pass; kept so that it never shows as a traceback
        return [FormatIssue("(root)", too_deep(MAX_DEPTH))]


def _manager_issues(snapshot: dict[str, Any]) -> list[FormatIssue]:
    """A snapshot that names its manager: the first manager's format for ``simple``, the
    offloading manager's (``kvspec.contract.offloading_snapshot_io``) for ``offloading``."""
    manager = snapshot["manager"]
    if manager == "offloading":
        return offloading_snapshot_issues(snapshot)
    if manager != "simple":
        return [FormatIssue("manager", f"unknown manager {show(manager)}; known: simple (SimpleCPUOffload, "
                            "snapshot.schema.json), offloading (CPUOffloadingManager, "
                            "offloading-snapshot.schema.json)")]
    rest = {k: v for k, v in snapshot.items() if k != "manager"}
    return snapshot_issues(rest)


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


def version_issue(snapshot: object) -> FormatIssue | None:
    """A snapshot of a format this kvspec does not read, named: a ``format_version`` other than
    ``FORMAT_VERSION``, or a field of the draft before version 1."""
    if not isinstance(snapshot, dict):
        return None
    if VERSION_FIELD in snapshot:
        v = snapshot[VERSION_FIELD]
        if not isinstance(v, int) or isinstance(v, bool):
            return FormatIssue(VERSION_FIELD, f"must be an integer (the snapshot format's version), got {show(v)}")
        if v != FORMAT_VERSION:
            newer = "newer than" if v > FORMAT_VERSION else "not one of the versions"
            return FormatIssue(VERSION_FIELD, f"snapshot format version {show(v)} is {newer} what this kvspec "
                               f"reads (version {FORMAT_VERSION}, and snapshots without a version, which are "
                               f"read as version {FORMAT_VERSION})")
        return None
    for (section, field), replaced in OLDER_FIELDS.items():
        part = snapshot.get(section)
        if isinstance(part, dict) and field in part:
            return FormatIssue(f"{section}.{field}", f"a field of the unversioned draft before snapshot format "
                               f"version {FORMAT_VERSION}, which this kvspec does not read (replaced by "
                               f"{replaced}); write the snapshot again with this kvspec")
    return None


def parse_snapshot(text: str, source: str = "snapshot") -> dict[str, Any]:
    """Parse JSON text (duplicate keys refused) and validate it."""
    try:
        data = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise SnapshotFormatError(
            f"{source}: not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except ValueError as exc:
        raise SnapshotFormatError(_value_error_text(text, source, exc)) from None
    except RecursionError:
        path = deep_path_in_text(text, MAX_DEPTH)
        where = fmt_path(path) if path is not None else "(root)"
        raise SnapshotFormatError(f"{where}: {too_deep(MAX_DEPTH)}") from None
    return validate_snapshot(data)


def _value_error_text(text: str, source: str, exc: ValueError) -> str:
    """What a ``ValueError`` of the JSON parser means: an integer longer than Python reads (named
    by its position), a duplicate key or a non-finite number."""
    limit = sys.get_int_max_str_digits()
    long_int = (re.compile(rf"(?<=[\[:,\s])-?[0-9]{{{limit + 1},}}").search(text)
                if limit and "integer string conversion" in str(exc) else None)
    if long_int is None:
        return f"{source}: {exc}"
    line = text.count("\n", 0, long_int.start()) + 1
    col = long_int.start() - (text.rfind("\n", 0, long_int.start()) + 1) + 1
    return (f"{source}: line {line} column {col}: an integer of {long_int.end() - long_int.start()} digits "
            f"(kvspec reads at most {limit})")


def load_snapshot(path: str | Path, limit: int = MAX_SNAPSHOT_BYTES) -> dict[str, Any]:
    """Read a snapshot file and validate it; ``SnapshotFormatError`` names what is wrong."""
    return parse_snapshot(read_snapshot_text(path, limit), _show_name(str(path)))


def read_snapshot_text(path: str | Path, limit: int = MAX_SNAPSHOT_BYTES) -> str:
    """A snapshot file's text; ``SnapshotFormatError`` when it cannot be read, is not UTF-8, or
    holds more than ``limit`` bytes (never read further than that: ``/dev/zero`` is refused
    after ``limit + 1`` bytes, a large regular file from its size alone)."""
    p = Path(path)
    name = _show_name(str(p))
    too_big = (f"{name}: larger than {limit:,} bytes, the most check-snapshot reads "
               f"(a 10^6-block snapshot is about 50-70 MB; --max-mb raises the limit)")
    try:
        with p.open("rb") as f:
            info = os.fstat(f.fileno())
            if stat.S_ISREG(info.st_mode) and info.st_size > limit:
                raise SnapshotFormatError(too_big)
            data = f.read(limit + 1)
        if len(data) > limit:
            raise SnapshotFormatError(too_big)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SnapshotFormatError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise SnapshotFormatError(f"{name}: cannot read: {exc.strerror or type(exc).__name__}") from None
    except ValueError as exc:  # e.g. a NUL byte in the path
        raise SnapshotFormatError(f"{name}: cannot read: {exc}") from None


def dump_snapshot(snapshot: dict[str, Any], path: str | Path) -> None:
    """Write ``snapshot`` as JSON (``format_version`` first, then the snapshot's keys in its own
    order); validates first, so that only well-formed files are written."""
    snapshot = {VERSION_FIELD: FORMAT_VERSION, **snapshot}
    validate_snapshot(snapshot)
    Path(path).write_text(json.dumps(snapshot, indent=1) + "\n", encoding="utf-8")


def _show_name(name: str) -> str:
    """A file name as messages print it: cut when very long."""
    return name if len(name) <= FILE_NAME_LIMIT else f"{name[:120]}… ({len(name)} chars)"


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
                yield FormatIssue(f"{pool}.{field}", f"expected one entry per block ({show(n)}), got {len(p[field])}")
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
            yield FormatIssue(fmt_path((*here, "num_stored_blocks")),
                              f"expected one cursor per group ({len(st['block_ids'])}), "
                              f"got {len(st['num_stored_blocks'])}")
        for g, ids in enumerate(st["block_ids"]):
            yield from _ids_in_range(ids, gpu_n, (*here, "block_ids", g))
    yield from _ids_in_range(sched["in_flight"], gpu_n, (*sp, "in_flight"))
    lost = sched["policy_state"].get("lost", [])
    for i, rec in enumerate(lost):
        if rec[0] not in sched["reqs_to_store"]:
            yield FormatIssue(fmt_path((*sp, "policy_state", "lost", i, 0)),
                              f"lost record names request {show(rec[0])}, which has no store state")
    if "engine" in s:
        yield from _engine_issues(s, gpu_n, cpu_n)


def _engine_issues(s: dict[str, Any], gpu_n: int, cpu_n: int) -> Iterator[FormatIssue]:
    eng = s["engine"]
    cfg = eng["config"]
    ep: tuple[str, ...] = ("engine",)
    for field, n in (("num_gpu_blocks", gpu_n), ("num_cpu_blocks", cpu_n)):
        if cfg[field] != n:
            pool = "gpu_pool" if field == "num_gpu_blocks" else "cpu_pool"
            yield FormatIssue(f"engine.config.{field}", f"is {show(cfg[field])} but {pool}.num_blocks is {show(n)}")
    if cfg["policy"] != s["scheduler"]["policy"]:
        yield FormatIssue("engine.config.policy",
                          f"is {show(cfg['policy'])} but scheduler.policy is {show(s['scheduler']['policy'])}")
    groups = len(cfg["groups"])
    for field, n in (("gpu_data", gpu_n), ("cpu_data", cpu_n)):
        if len(eng[field]) != n:
            yield FormatIssue(f"engine.{field}", f"expected one entry per block ({show(n)}), got {len(eng[field])}")
    for rid, r in eng["requests"].items():
        yield from _request_issues(r, (*ep, "requests", rid), groups, gpu_n, cfg["block_size"])
    sched = s["scheduler"]
    for rid, st in sched["reqs_to_store"].items():
        if len(st["block_ids"]) != groups:
            yield FormatIssue(fmt_path(("scheduler", "reqs_to_store", rid, "block_ids")),
                              f"expected one list per group ({groups}), got {len(st['block_ids'])}")
    for rid, pin in sched["pending_cpu_hits"].items():
        if len(pin["blocks"]) != groups:
            yield FormatIssue(fmt_path(("scheduler", "pending_cpu_hits", rid, "blocks")),
                              f"expected one list per group ({groups}), got {len(pin['blocks'])}")
    for e, data in eng["store_selection_confirmed"].items():
        t = sched["store_events"].get(e)
        if t is not None and len(data) != len(t["gpu"]):
            yield FormatIssue(fmt_path((*ep, "store_selection_confirmed", e)),
                              f"expected one entry per GPU block of store event {show(e)} ({len(t['gpu'])}), "
                              f"got {len(data)}")
    for pool in ("gpu_pool", "cpu_pool"):
        for key in s[pool]["cached"]:
            g = int(key.rpartition(":")[2])  # the schema's key pattern bounds the group to 9 digits
            if g >= groups:
                yield FormatIssue(fmt_path((pool, "cached", key)), f"key names group {g}, the config has {groups}")
    try:
        from kvspec.contract.config import OffloadConfig

        OffloadConfig.from_json(cfg)
    except KVSpecError as exc:
        yield FormatIssue("engine.config", f"not a valid configuration: {exc}")


def _request_issues(r: dict[str, Any], here: tuple[str, ...], groups: int, gpu_n: int,
                    bs: int) -> Iterator[FormatIssue]:
    """One engine request's tables, token counts and hashes against the configuration."""
    if len(r["table"]) != groups:
        yield FormatIssue(fmt_path((*here, "table")), f"expected one table per group ({groups}), "
                          f"got {len(r['table'])}")
    for g, ids in enumerate(r["table"]):
        yield from _ids_in_range(ids, gpu_n, (*here, "table", g))
    # under async scheduling the computed tokens include the output placeholders (tokens being
    # sampled, not yet appended); only the appended tokens are hashed
    placeholders = r.get("num_output_placeholders", 0)
    if r["num_computed_tokens"] > r["num_tokens"] + placeholders:
        yield FormatIssue(fmt_path((*here, "num_computed_tokens")),
                          f"{show(r['num_computed_tokens'])} exceeds num_tokens {show(r['num_tokens'])}"
                          + (f" + {show(placeholders)} output placeholders" if placeholders else ""))
    elif r["status"] in ("running", "loaded"):
        hashed = min(r["num_computed_tokens"], r["num_tokens"])
        need = max((min(hashed // bs, len(t)) for t in r["table"]), default=0)
        if len(r["block_hashes"]) < need:
            yield FormatIssue(fmt_path((*here, "block_hashes")),
                              f"has {len(r['block_hashes'])} hashes, the computed blocks need {need}")


def _ids_in_range(ids: list[int], n: int, path: tuple[str | int, ...],
                  single: bool = False) -> Iterator[FormatIssue]:
    if not ids or (0 <= min(ids) and max(ids) < n):  # one C-level pass each for long lists
        return
    for i, b in enumerate(ids):
        if not 0 <= b < n:
            where = path if single else (*path, i)
            yield FormatIssue(fmt_path(where), f"block id {show(b)} out of range 0..{show(n - 1)}")


def _transfer_issues(t: dict[str, Any], gpu_n: int, cpu_n: int,
                     path: tuple[str | int, ...]) -> Iterator[FormatIssue]:
    if len(t["gpu"]) != len(t["cpu"]):
        yield FormatIssue(fmt_path(path), f"gpu and cpu lists differ in length ({len(t['gpu'])} vs {len(t['cpu'])})")
    yield from _ids_in_range(t["gpu"], gpu_n, (*path, "gpu"))
    yield from _ids_in_range(t["cpu"], cpu_n, (*path, "cpu"))
