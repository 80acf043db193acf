"""Incremental checking: after an operation, only the invariants whose inputs it touched.

Every catalogue invariant is a pure function of a few parts of a snapshot (``READS``: the
pools' ref counts, the scheduler's store events, the engine's requests, ...). An operation
touches some parts and leaves the others equal, as values, to what they were after the
previous operation. An invariant none of whose parts changed gives the same verdict it gave
then; since a run stops at its first finding, that verdict was clean, so the invariant need
not run again. ``IncrementalOracle.check`` runs exactly the invariants whose parts changed,
in catalogue order, and returns what ``catalogue.check`` would: the same violations in the
same order, for any snapshot that follows a clean one.

The parts are compared by value (``==``: C-speed list and dict comparison), which is what
"touched" means here: a part rebuilt equal to what it was is untouched. A container that is the
very same object in both snapshots counts as touched (a target could have mutated it in place),
unless the caller vouches that the target's sections are the same kept snapshot, which no call
changed since (``same_target``: an engine with ``keep_snapshots`` that served it twice). The first snapshot
(no predecessor) and any snapshot with a violation are checked in full, so a finding is the
full check's finding; the run loop also checks in full at the end of every trace
(``kvspec.drivers.harness``) and replays with full checking if that ever disagrees.
``tests/test_incremental.py`` checks on random traces that incremental and full checking agree
after every operation, and that dropping one part from one invariant's ``READS`` is caught.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import compress
from operator import is_, ne
from typing import Any

from kvspec.oracle.catalogue import CATALOGUE, Snapshot, Violation

Part = tuple[str, ...]  # a path into a snapshot: ("scheduler", "store_events")

_POOL = ("num_blocks", "ref_cnt", "block_hash", "free_queue", "cached")
_STORES_LIVE = (("scheduler", "store_events"), ("scheduler", "pending_finished_stores"))
_STORES_ALL = (*_STORES_LIVE, ("scheduler", "abandoned_store_events"))
_LOADS = (("scheduler", "reqs_to_load"), ("scheduler", "abandoned_reqs_to_load"))
_REQS = (("engine", "requests"),)
_CONFIG = (("engine", "config"),)
# owned_below_cursor and covered_keys, which C1, C2, C4, C7 and C8 read
_OWNED = (("gpu_pool", "block_hash"), ("scheduler", "reqs_to_store"), *_REQS, *_CONFIG)
_COVERED = (("cpu_pool", "cached"), ("gpu_pool", "block_hash"), *_STORES_LIVE)


def _pools(*fields: str) -> tuple[Part, ...]:
    return tuple((pool, f) for pool in ("gpu_pool", "cpu_pool") for f in fields)


READS: dict[str, tuple[Part, ...]] = {
    "I1": _pools("num_blocks", "ref_cnt", "free_queue", "free_count"),
    "I2": (*_pools("free_queue", "ref_cnt", "block_hash", "cached"), *_STORES_ALL, *_LOADS),
    "I3": (*_pools("cached", "block_hash", "free_queue"), *_STORES_ALL),
    "I4": (("cpu_pool", "ref_cnt"), *_STORES_ALL, *_LOADS, ("scheduler", "pending_cpu_hits")),
    "I5": (("gpu_pool", "ref_cnt"), *_REQS, *_STORES_ALL, *_LOADS, ("engine", "deferred_frees")),
    "I6": (*_pools("ref_cnt"), *_STORES_ALL, *_LOADS),
    "I7": (*_STORES_LIVE, ("scheduler", "in_flight"), ("scheduler", "lazy")),
    "I8": _STORES_ALL,
    "I9": (("scheduler", "reqs_to_store"),),
    "I10": (("engine", "store_selection_confirmed"), ("scheduler", "store_events")),
    "I11": (("engine", "cpu_data"), ("cpu_pool", "cached")),
    "I12": (*_REQS, *_CONFIG, ("scheduler", "reqs_to_load"), *_pools("block_hash"), ("engine", "gpu_data")),
    "I13": (("scheduler", "store_events"), ("scheduler", "abandoned_store_events"),
            ("scheduler", "store_event_counter"), ("scheduler", "load_event_to_reqs"),
            ("scheduler", "load_event_counter"), ("scheduler", "store_event_pending_counts"),
            *_CONFIG, ("engine", "reports_left")),
    "I14": (("scheduler", "reqs_to_store"), *_REQS, ("scheduler", "pending_cpu_hits"), ("scheduler", "reqs_to_load")),
    "I15": (("engine", "last_op"), ("engine", "last_result"), ("scheduler", "abandoned_store_events"),
            ("scheduler", "abandoned_reqs_to_load"), ("cpu_pool", "cached")),
    "C1": (*_OWNED, *_COVERED),
    "C2": (*_OWNED, *_COVERED, ("scheduler", "policy_state")),
    "C3": (("engine", "last_plan"), *_STORES_LIVE, ("gpu_pool", "block_hash")),
    "C4": (("engine", "last_op"), ("engine", "converging_step"), *_OWNED, *_COVERED),
    "C5": (("engine", "last_plan"),),
    "C6": (("engine", "last_plan"),),
    "C7": (("engine", "finishes"),),
    "C8": (("engine", "finishes"),),
}
"""The parts of a snapshot each invariant reads (its incremental form). Keep in step with
``kvspec.oracle.catalogue``: an invariant that reads a part not listed here would be skipped
after an operation that changed only that part (the agreement test catches it on random traces)."""

_MISSING = object()


def engine_parts_read(ids: Iterable[str]) -> frozenset[str] | None:
    """The parts of the engine section that the invariants ``ids`` read (``READS``), or None when
    one of them has no ``READS`` entry (then nothing can be left out). The run loop measures only
    these of the engine's facts (``kvspec.drivers.engine.OBSERVATIONS``). O(parts)."""
    ids = tuple(ids)
    if any(i not in READS for i in ids):
        return None
    return frozenset(p[1] for i in ids for p in READS[i] if p[0] == "engine")


class IncrementalOracle:
    """The invariants ``ids``, checked after each operation from what it changed; ``reads``
    (default ``READS``) names each one's parts. ``check(snap)`` judges a snapshot that follows
    the last one given (which must have been clean, or the next check is full); ``reset()``
    forgets it, so the next check is full. ``ran`` and ``skipped`` count invariant evaluations."""

    def __init__(self, ids: Iterable[str], reads: Mapping[str, tuple[Part, ...]] | None = None) -> None:
        self.ids = tuple(ids)
        table = READS if reads is None else reads
        parts = dict.fromkeys(p for i in self.ids for p in table[i])
        # the parts grouped by the path that leads to their section, read one section at a time
        sections: dict[Part, list[str]] = {}
        for p in parts:
            sections.setdefault(p[:-1], []).append(p[-1])
        self._sections = tuple((path, tuple(keys)) for path, keys in sections.items())
        self._parts: tuple[Part, ...] = tuple((*path, k) for path, keys in self._sections for k in keys)
        index = {p: n for n, p in enumerate(self._parts)}
        # each part once: a part listed twice for an invariant (C1 reads the GPU hashes for what it
        # owns and for what is covered) must not add its bit twice, which carried into the next part's
        self._masks = tuple(sum(1 << index[p] for p in dict.fromkeys(table[i])) for i in self.ids)
        self._index = range(len(self._parts))
        self._invariants = tuple(zip((CATALOGUE[i] for i in self.ids), self._masks, strict=True))
        self._target_parts = sum(1 << n for n, p in enumerate(self._parts) if p[0] != "engine")
        self._last: list[Any] | None = None
        self.ran = 0
        self.skipped = 0

    def reset(self) -> None:
        self._last = None

    def _values(self, snap: Snapshot) -> list[Any]:
        """The parts' values in ``snap`` (a missing one as ``_MISSING``). O(parts)."""
        values: list[Any] = []
        for path, keys in self._sections:
            section: Any = snap
            for key in path:
                section = section.get(key) if isinstance(section, dict) else None
            if isinstance(section, dict):
                values.extend([section.get(k, _MISSING) for k in keys])
            else:
                values.extend([_MISSING] * len(keys))
        return values

    def _changed(self, values: list[Any], last: list[Any], vouched: int) -> int:
        """The bits of the parts that differ from ``last``: unequal values, and the very same
        container in both (a target may have mutated it in place) unless ``vouched`` has its bit.
        The identity and equality tests run at C speed (``map``, ``compress``); Python only visits
        the parts that are the same object or unequal. O(parts + size of the unequal ones)."""
        changed = 0
        index = self._index
        for n in compress(index, map(is_, values, last)):
            if isinstance(values[n], (dict, list)) and not vouched >> n & 1:
                changed |= 1 << n
        for n in compress(index, map(ne, values, last)):
            if values[n] is not last[n]:
                changed |= 1 << n
        return changed

    def check(self, snap: Snapshot, same_target: bool = False) -> list[Violation]:
        """``catalogue.check(snap, ids)`` for a snapshot that follows the last clean one.
        ``same_target``: the caller vouches that the target's sections are the very ones of the
        last snapshot and nothing changed them since (an engine that kept its target snapshot:
        ``kvspec.drivers.engine.Engine.keep_snapshots``); then only the engine's parts are
        compared."""
        values = self._values(snap)
        last = self._last
        changed = -1 if last is None else self._changed(values, last, self._target_parts if same_target else 0)
        has_engine = "engine" in snap
        out: list[Violation] = []
        ran = 0
        for inv, mask in self._invariants:
            if mask & changed and (has_engine or not inv.needs_engine):
                ran += 1
                out.extend(inv.fn(snap))
        self.ran += ran
        self.skipped += len(self.ids) - ran
        self._last = None if out else values
        return out
