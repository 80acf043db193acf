"""``kvspec check-snapshot FILE``: validate a snapshot file and check an oracle's invariants on it.

Any engine that can dump its state in kvspec's snapshot format can be checked this way,
without kvspec's model: the first manager's (SimpleCPUOffload,
``kvspec/contract/schema/snapshot.schema.json``) or, for a snapshot with ``"manager":
"offloading"``, the second manager's (vLLM's CPUOffloadingManager,
``offloading-snapshot.schema.json``; its oracle is O1-O10, and the invariants that read what a
driver observed, O2-O6 and O8, are skipped without the ``observed`` section).

For the first manager the oracle (``--oracle``; ``kvspec.oracle.oracles``,
``kvspec.adapters.claims``) is by default what the snapshot's policy (``scheduler.policy``)
claims under the configuration in ``engine.config``; without an ``engine`` section, the claims
that hold under every configuration and need no engine view.
``--oracle all`` is the whole catalogue; ``--oracle I1,I3`` (or ``--ids I1,I3``) exactly those.

The file is read whole, up to ``--max-mb`` megabytes (256 by default; a larger file, or an
endless one such as ``/dev/zero``, is refused without reading further). Snapshots carry
``format_version`` (``kvspec.contract.snapshot_io``); one without it is read as version 1.

Exit codes: 0 nothing violated; 1 violations (one line each: id, message, requests and
blocks involved); 2 the file is unreadable, too large or malformed (one line naming the field and
why), or the arguments are wrong, or an explicitly named invariant needs the ``engine``
(``observed``) section the snapshot lacks (``claims`` and ``all`` skip those and say so), or
belongs to the other manager.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvspec.adapters import claims as claimed
from kvspec.contract.errors import (
    EXIT_BAD_INPUT,
    EXIT_CLEAN,
    EXIT_FINDING,
    ConfigError,
    KVSpecError,
    SnapshotFormatError,
    exit_codes,
)
from kvspec.contract.snapshot_io import MAX_SNAPSHOT_BYTES, load_snapshot
from kvspec.oracle import oracles
from kvspec.oracle.catalogue import (
    CATALOGUE,
    CATALOGUES,
    CONNECTOR_INVARIANTS,
    MANAGER_INVARIANTS,
    Violation,
    manager_of,
)

NAME = "check-snapshot"
HELP = "validate a snapshot file and check an oracle's invariants on it (exit 0 clean, 1 violations, 2 bad input)"

LINE_LIMIT = 400  # characters of a violation's message printed in text mode
SHOWN_IDS = 10  # requests, and blocks x2, printed per violation in text mode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = exit_codes("no invariant of the oracle violated", "violations",
                               "bad input or usage (unreadable, too large or malformed file, unknown oracle, "
                               "engine-only ids on a snapshot without an engine section)")
    parser.add_argument("file", metavar="FILE", help="snapshot JSON file (what OffloadTarget.snapshot() returns)")
    parser.add_argument("--json", action="store_true",
                        help='print {"ok": bool, "oracle": {"name", "ids"}, "violations": [...], '
                             '"checked": [...], "skipped": [...]}')
    parser.add_argument("--oracle", metavar="SPEC", default=None,
                        help="which invariants judge the snapshot: 'claims' (default: what scheduler.policy "
                             "claims under engine.config), 'all' (the whole catalogue), or comma-separated "
                             "catalogue ids")
    parser.add_argument("--ids", metavar="ID,ID", default=None,
                        help="same as --oracle ID,ID: check only these invariants (e.g. I1,I3)")
    parser.add_argument("--max-mb", type=_megabytes, default=MAX_SNAPSHOT_BYTES >> 20, metavar="MB",
                        help=f"refuse (exit 2) a file larger than MB megabytes, read no further "
                             f"(default {MAX_SNAPSHOT_BYTES >> 20}; a 10^6-block snapshot is about 50-70)")


def _megabytes(text: str) -> int:
    """An argparse type: a whole number of megabytes, 1..2^20."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of megabytes, got {text[:40]!r}") from None
    if not 1 <= value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"must be in 1..{1 << 20}, got {value}")
    return value


# -- choosing the oracle ---------------------------------------------------------------------


def _claims_without_engine(policy: str) -> oracles.Oracle:
    """The claims of ``policy`` that hold under every configuration (a policy may claim an id
    only for some configurations, e.g. baseline's I8 and I10 for full attention only): the
    intersection over representative configurations."""
    from kvspec.contract.config import KVGroup, OffloadConfig

    candidates: list[dict[str, Any]] = [
        {"policy": policy},
        {"policy": policy, "groups": (KVGroup(), KVGroup("sliding", 32))},
        {"policy": policy, "lazy_offload": True},
        {"policy": policy, "world_size": 2},
    ]
    common: set[str] | None = None
    for kwargs in candidates:
        try:
            cfg = OffloadConfig(**kwargs)
            cfg.validate()
        except KVSpecError:  # e.g. lazy offload is baseline-only
            continue
        ids = set(claimed.claims(cfg).ids)
        common = ids if common is None else common & ids
    ids_t = tuple(i for i in CATALOGUE if common is not None and i in common)
    return oracles.Oracle(f"claims of {policy} (any configuration: no engine section)", ids_t)


def _view(snapshot: dict[str, Any]) -> str:
    """The optional section that the invariants with ``needs_engine`` read: ``engine`` for the
    first manager, ``observed`` (what a driver saw) for the offloading manager."""
    return "observed" if manager_of(snapshot) == "offloading" else "engine"


def choose_oracle(snapshot: dict[str, Any], spec: str | None, option: str = "--oracle") -> oracles.Oracle:
    """The oracle ``spec`` names for ``snapshot`` (already validated). ``ConfigError`` for an
    explicit id list with ids of the other manager, or that need the section the snapshot lacks."""
    manager = manager_of(snapshot)
    if manager == "offloading":
        if spec in (None, "claims", "all"):
            return oracles.Oracle(f"{spec or 'claims'} of the offloading manager", MANAGER_INVARIANTS)
        ids = oracles.parse_ids(spec, option, "offloading")
        connector = [i for i in ids if i in CONNECTOR_INVARIANTS]
        if connector:
            raise ConfigError(f"{option}: {', '.join(connector)} judge the OffloadingConnector harness's connector "
                              "section, which a snapshot file does not carry")
    elif spec is None or spec == "claims":
        if "engine" in snapshot:
            from kvspec.contract.config import OffloadConfig

            try:
                cfg = OffloadConfig.from_json(snapshot["engine"]["config"])
            except KVSpecError as exc:  # validation already checks it; kept so that it never crashes
                raise SnapshotFormatError(f"engine.config: not a valid configuration: {exc}") from None
            return claimed.resolve(None, cfg)
        return _claims_without_engine(snapshot["scheduler"]["policy"])
    elif spec == "all":
        return oracles.Oracle("all", oracles.catalogue_ids())
    else:
        ids = oracles.parse_ids(spec, option)
    view, catalogue = _view(snapshot), CATALOGUES[manager]
    if view not in snapshot:
        need = [i for i in ids if catalogue[i].needs_engine]
        if need:
            raise ConfigError(f"{option}: {', '.join(need)} need(s) the {view} section, which this snapshot "
                              "does not have (give a snapshot with it, or leave them out)")
    return oracles.Oracle(",".join(ids), ids)


def check_snapshot(snapshot: dict[str, Any], ids: list[str] | tuple[str, ...]
                   ) -> tuple[list[Violation], list[str], list[str]]:
    """(violations, ids checked, ids skipped because they need the section the snapshot lacks:
    ``engine``, or ``observed`` for the offloading manager).

    Each invariant runs on its own; one that cannot evaluate the snapshot (a rule the
    format validation does not cover) is reported as a format error, not a traceback.
    """
    has_engine = _view(snapshot) in snapshot
    catalogue = CATALOGUES[manager_of(snapshot)]
    violations: list[Violation] = []
    checked: list[str] = []
    skipped: list[str] = []
    for id_ in ids:
        inv = catalogue[id_]
        if inv.needs_engine and not has_engine:
            skipped.append(id_)
            continue
        try:
            violations.extend(inv.fn(snapshot))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise SnapshotFormatError(
                f"invariant {id_} cannot be evaluated on this snapshot ({type(exc).__name__}: {_cut(str(exc), 120)})"
            ) from None
        checked.append(id_)
    return violations, checked, skipped


# -- output ----------------------------------------------------------------------------------


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 20]}… ({len(text)} chars)"


def _line(v: Violation) -> str:
    """``str(v)`` with every part bounded (a 5 MB request id or key is not printed whole)."""
    where = []
    if v.requests:
        shown = [_cut(r, 40) for r in v.requests[:SHOWN_IDS]]
        more = f",… ({len(v.requests)} requests)" if len(v.requests) > SHOWN_IDS else ""
        where.append("requests " + ",".join(shown) + more)
    if v.blocks:
        more = f",… ({len(v.blocks)} blocks)" if len(v.blocks) > 2 * SHOWN_IDS else ""
        where.append("blocks " + ",".join(map(str, v.blocks[: 2 * SHOWN_IDS])) + more)
    return f"{v.id}: {_cut(v.message, LINE_LIMIT)}" + (f" [{'; '.join(where)}]" if where else "")


def _show_file(name: str) -> str:
    return _cut(name, 200)


def run(args: argparse.Namespace) -> int:
    try:
        if args.ids is not None and args.oracle is not None:
            raise ConfigError("--ids and --oracle: give one of them (--ids I1,I3 is --oracle I1,I3)")
        spec, option = (args.ids, "--ids") if args.ids is not None else (args.oracle, "--oracle")
        if args.ids is not None:
            oracles.parse_ids(args.ids, "--ids", None)  # ids of either manager; matched to the snapshot's below
        elif spec not in (None, "claims", "all"):
            oracles.parse_ids(spec, "--oracle", None)
        snapshot = load_snapshot(args.file, args.max_mb << 20)
        oracle = choose_oracle(snapshot, spec, option)
        violations, checked, skipped = check_snapshot(snapshot, oracle.ids)
    except KVSpecError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc), "violations": []}))
        print(f"kvspec {NAME}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({"ok": not violations, "oracle": oracle.to_json(),
                          "violations": [v.to_json() for v in violations],
                          "checked": checked, "skipped": skipped}))
        return EXIT_FINDING if violations else EXIT_CLEAN
    for v in violations:
        print(_line(v))
    note = f"; skipped {', '.join(skipped)} (they need the {_view(snapshot)} section)" if skipped else ""
    summary = f"oracle {oracle.name}: {len(checked)} invariant(s) checked{note}"
    where = _show_file(str(args.file))
    if violations:
        broken = ", ".join(dict.fromkeys(v.id for v in violations))
        print(f"FAIL: {len(violations)} violation(s) of {broken} in {where} ({summary})")
        return EXIT_FINDING
    print(f"ok: no invariant violated in {where} ({summary})")
    return EXIT_CLEAN
