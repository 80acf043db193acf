"""``kvspec check-snapshot FILE``: validate a snapshot file and run the invariant catalogue on it.

Any engine that can dump its state in kvspec's snapshot format
(``kvspec/schema/snapshot.schema.json``) can be checked this way, without kvspec's
model. Exit codes: 0 nothing violated, 1 violations (one line each: id, message,
requests and blocks involved), 2 the file is unreadable or malformed (one line naming
the field and why) or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvspec.errors import ConfigError, KVSpecError, SnapshotFormatError
from kvspec.model.invariants import CATALOGUE, Violation
from kvspec.snapshot_io import load_snapshot

NAME = "check-snapshot"
HELP = "validate a snapshot file and check the invariant catalogue on it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="snapshot JSON file (what OffloadTarget.snapshot() returns)")
    parser.add_argument("--json", action="store_true", help='print {"ok": bool, "violations": [...]}')
    parser.add_argument("--ids", metavar="ID,ID", default=None,
                        help="check only these invariants (comma-separated catalogue ids, e.g. I1,I3)")


def _parse_ids(text: str | None) -> list[str]:
    if text is None:
        return list(CATALOGUE)
    ids = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [i for i in ids if i not in CATALOGUE]
    if not ids or unknown:
        what = f"unknown invariant id(s) {', '.join(unknown)}" if unknown else "no invariant ids given"
        raise ConfigError(f"--ids: {what}; known: {', '.join(CATALOGUE)}")
    return list(dict.fromkeys(ids))


def check_snapshot(snapshot: dict[str, Any], ids: list[str]) -> tuple[list[Violation], list[str], list[str]]:
    """(violations, ids checked, ids skipped because they need the engine section).

    Each invariant runs on its own; one that cannot evaluate the snapshot (a rule the
    format validation does not cover) is reported as a format error, not a traceback.
    """
    has_engine = "engine" in snapshot
    violations: list[Violation] = []
    checked: list[str] = []
    skipped: list[str] = []
    for id_ in ids:
        inv = CATALOGUE[id_]
        if inv.needs_engine and not has_engine:
            skipped.append(id_)
            continue
        try:
            violations.extend(inv.fn(snapshot))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotFormatError(
                f"invariant {id_} cannot be evaluated on this snapshot ({type(exc).__name__}: {exc})"
            ) from None
        checked.append(id_)
    return violations, checked, skipped


def run(args: argparse.Namespace) -> int:
    try:
        ids = _parse_ids(args.ids)
        snapshot = load_snapshot(args.file)
        violations, checked, skipped = check_snapshot(snapshot, ids)
    except KVSpecError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc), "violations": []}))
        print(f"kvspec {NAME}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"ok": not violations, "violations": [v.to_json() for v in violations],
                          "checked": checked, "skipped": skipped}))
        return 1 if violations else 0
    for v in violations:
        print(v)
    note = f"; skipped {', '.join(skipped)} (they need the engine section)" if skipped else ""
    if violations:
        broken = ", ".join(dict.fromkeys(v.id for v in violations))
        print(f"FAIL: {len(violations)} violation(s) of {broken} in {args.file} "
              f"({len(checked)} invariant(s) checked{note})")
        return 1
    print(f"ok: no invariant violated in {args.file} ({len(checked)} invariant(s) checked{note})")
    return 0
