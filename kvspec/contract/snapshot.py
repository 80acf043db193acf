"""The canonical snapshot: the one place that fixes its sections, keys, order and types.

Every target (the model, the implementation, the vLLM adapter) turns its own state into
plain values and builds its snapshot with these functions, so snapshots of conformant
targets are equal as values and as JSON text. Keys of the prefix map, request ids and
event ids are sorted; event ids become strings (JSON object keys). The format is
described for engine authors by ``kvspec/contract/schema/snapshot.schema.json``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Transfer = tuple[Sequence[int], Sequence[int]]  # (GPU ids, CPU ids)


def pool_section(num_blocks: int, ref_cnt: Iterable[int], block_hash: Iterable[str | None],
                 free_queue: Iterable[int], cached: Mapping[str, Sequence[int]],
                 free_count: int | None = None, fresh_sorted: bool = False) -> dict[str, Any]:
    """One pool: ref counts and key text per block, the free queue head first, the prefix map
    (keys sorted by hash then group, each key's blocks in insertion order). ``free_count``: the
    pool's own count of free blocks, where it keeps one; shown (as ``free_count``) only when it
    differs from the queue's length, so a consistent pool's snapshot is the same either way.
    ``fresh_sorted``: ``cached`` is a new dict of new lists that already lists its keys in that
    order (a pool that sorts its ``(hash, group)`` tuples gets it for less than sorting the text
    here), taken as it is. O(N log N)."""
    section: dict[str, Any] = {
        "num_blocks": num_blocks,
        "ref_cnt": list(ref_cnt),
        "block_hash": list(block_hash),
        "free_queue": list(free_queue),
        "cached": (cached if fresh_sorted and isinstance(cached, dict)
                   else {k: list(cached[k]) for k in sorted(cached, key=_key_order)}),
    }
    if free_count is not None and free_count != len(section["free_queue"]):
        section["free_count"] = free_count
    return section


def _key_order(key: str) -> tuple[str, int]:
    """Keys ``"<hash>:<group>"`` sort by hash, then by group as a number."""
    h, _, g = key.rpartition(":")
    return h, int(g)


def _in_order(mapping: Mapping[Any, Any]) -> Iterable[tuple[Any, Any]]:
    """``mapping``'s items sorted by key (most of a snapshot's maps hold 0 or 1 item, which need
    no sort)."""
    return sorted(mapping.items()) if len(mapping) > 1 else mapping.items()


def transfer_json(t: Transfer) -> dict[str, list[int]]:
    return {"gpu": list(t[0]), "cpu": list(t[1])}


def _load(t: Transfer, load_event: int | None, finished: bool) -> dict[str, Any]:
    return {**transfer_json(t), "load_event": load_event, "finished": finished}


def scheduler_section(
    *,
    policy: str,
    lazy: bool,
    lazy_cursor: int | None,
    pending_cpu_hits: Mapping[str, tuple[Sequence[Sequence[int]], int, int]],
    reqs_to_load: Mapping[str, tuple[Transfer, int | None, bool]],
    abandoned_reqs_to_load: Mapping[str, tuple[Transfer, int | None, bool]],
    load_event_to_reqs: Mapping[int, Sequence[str]],
    store_events: Mapping[int, Transfer],
    abandoned_store_events: Mapping[int, Transfer],
    pending_finished_stores: Iterable[Transfer],
    reqs_to_store: Mapping[str, tuple[Sequence[Sequence[int]], Sequence[int], Iterable[int], bool]],
    store_event_to_reqs: Mapping[int, Sequence[str]],
    in_flight: Iterable[int],
    load_event_counter: int,
    store_event_counter: int,
    store_event_pending_counts: Mapping[int, int],
    policy_state: dict[str, Any],
) -> dict[str, Any]:
    """The scheduler: pins, loads, stores, per-request store state, counters, policy state.

    ``pending_cpu_hits``: request -> (CPU blocks per group, hit length, local tokens);
    loads: request -> (transfer, load event or None, finished); ``reqs_to_store``:
    request -> (GPU ids per group, cursor per group, store events, finished)."""
    return {
        "policy": policy,
        "lazy": bool(lazy),
        "lazy_cursor": lazy_cursor,
        "pending_cpu_hits": {
            r: {"blocks": [list(g) for g in blocks], "hit_len": hit_len, "num_computed_tokens": local}
            for r, (blocks, hit_len, local) in _in_order(pending_cpu_hits)
        },
        "reqs_to_load": {r: _load(*v) for r, v in _in_order(reqs_to_load)},
        "abandoned_reqs_to_load": {r: _load(*v) for r, v in _in_order(abandoned_reqs_to_load)},
        "load_event_to_reqs": {str(e): list(rs) for e, rs in _in_order(load_event_to_reqs)},
        "store_events": {str(e): transfer_json(t) for e, t in _in_order(store_events)},
        "abandoned_store_events": {str(e): transfer_json(t) for e, t in _in_order(abandoned_store_events)},
        "pending_finished_stores": [transfer_json(t) for t in pending_finished_stores],
        "reqs_to_store": {
            r: {"block_ids": [list(g) for g in ids], "num_stored_blocks": list(cursors),
                "store_events": sorted(events), "finished": finished}
            for r, (ids, cursors, events, finished) in _in_order(reqs_to_store)
        },
        "store_event_to_reqs": {str(e): list(rs) for e, rs in _in_order(store_event_to_reqs)},
        "in_flight": sorted(in_flight),
        "load_event_counter": load_event_counter,
        "store_event_counter": store_event_counter,
        "store_event_pending_counts": {str(e): c for e, c in _in_order(store_event_pending_counts)},
        "policy_state": policy_state,
    }
