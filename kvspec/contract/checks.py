"""Input checks shared by every target: one function per rule, one message per rule.

The model, the implementation and the vLLM adapter call these at their entry points, so the
same bad input gets the same ``KVSpecError`` subclass and the same words from each of them.

Every public entry point checks the *shape* of what it is given before anything else: a wrong
type or a missing field is an ``InvalidOperationError``, a bad count an ``InvalidCountError``,
a bad block id, key or group id given to a pool an ``InvalidBlockError``, per-group data of the
wrong shape a ``GroupCountError``; then the rules that depend on the target's state (a load's
accepted tokens, a store's keys). Each message quotes a bad value through ``echo`` (bounded),
so a 5 MB request id never reaches a message whole. The fast paths (one C-level pass over the
types, then min/max) keep the checks O(input) and cheap on the implementation's hot path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvspec.contract.errors import (
    ECHO_LIMIT,
    DoubleFreeError,
    GroupCountError,
    InvalidBlockError,
    InvalidCountError,
    InvalidOperationError,
    OutOfBlocksError,
    UnknownEventError,
    UnknownRequestError,
    echo,
)
from kvspec.contract.types import BlockIds

NULL_BLOCK_ID = 0  # block 0 of every pool: the placeholder no request owns

# -- counts ------------------------------------------------------------------------------------


def check_count(value: object, what: str, upper: int | None = None) -> int:
    """A non-negative int (not a bool), at most ``upper`` when given; else ``InvalidCountError``
    quoting the value through ``echo``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidCountError(f"{what} must be a non-negative int, got {echo(value)}")
    if upper is not None and value > upper:
        raise InvalidCountError(f"{what} = {echo(value)} exceeds {echo(upper)}")
    return value


def check_max_tokens(value: object, upper: int, format: int | None = None) -> int:
    """A request's ``max_tokens``: an int of 1..``upper``, as vLLM's ``SamplingParams`` needs at
    least 1. ``format`` 1..3 marks a request from a trace of that format, where 0 was allowed (a
    request that samples no token); ``InvalidCountError`` otherwise."""
    if format is not None and (not isinstance(format, int) or isinstance(format, bool) or not 1 <= format <= 3):
        raise InvalidCountError(f"format must be a trace format of 1..3 (which allowed max_tokens 0), "
                                f"got {echo(format)}")
    count = check_count(value, "max_tokens", upper)
    if count == 0 and format is None:
        raise InvalidCountError("max_tokens must be >= 1 (vLLM's SamplingParams); 0 is read only from a trace "
                                "of format 1-3")
    return count


def check_count_type(value: object, what: str) -> int:
    """An int (not a bool) of any sign: what a count must be to reach a real engine unchecked
    (raw mode). ``InvalidCountError``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidCountError(f"{what} must be an int, got {echo(value)}")
    return value


def check_free_counts(ids: Sequence[int], ref_cnt: Callable[[int], int], pool: str) -> None:
    """No block freed more often than it is referenced (vLLM would leave a negative ref count)."""
    for b, times in Counter(ids).items():
        ref = ref_cnt(b)
        if times > ref:
            raise DoubleFreeError(f"{pool}: block {b} freed {times} time(s) with ref count {ref}")


# -- entry-point shapes ------------------------------------------------------------------------

_MISSING = object()
_ID_COLLECTIONS = (set, frozenset, list, tuple)


def _all_str(items: Iterable[object]) -> bool:
    """Every item a str: one C-level pass (``str.join`` refuses anything else)."""
    try:
        "".join(items)  # type: ignore[arg-type]  # any objects on purpose: the TypeError is the test
    except TypeError:
        return False
    return True


def name_of(value: object) -> str:
    """A request id (or key text) as a message names it: a short string as it is, anything else
    ``echo``'d."""
    if isinstance(value, str) and len(value) <= ECHO_LIMIT:
        return value
    return echo(value)


def check_request_ids(ids: object, what: str) -> None:
    """A collection (set, frozenset, list or tuple) of request ids, each a str."""
    if not isinstance(ids, _ID_COLLECTIONS):
        raise InvalidOperationError(f"{what} must be a set or list of request ids, got {echo(ids)}")
    if ids and not _all_str(ids):
        bad = next(r for r in ids if not isinstance(r, str))
        raise InvalidOperationError(f"{what}: a request id must be a str, got {echo(bad)}")


def check_request(request: object, what: str, *, full: bool = True) -> str:
    """A ``RequestView`` as an entry point reads it; returns its ``request_id`` (a str).

    ``full`` (lookup, registration, finish): also ``num_tokens``, ``num_computed_tokens`` and
    ``num_output_placeholders`` (non-negative ints), ``skip_reading_prefix_cache`` (a bool) and
    ``block_hashes`` (a list or tuple of str). O(hashes)."""
    rid = getattr(request, "request_id", _MISSING)
    if rid is _MISSING:
        raise InvalidOperationError(f"{what}: expected a request (an object with request_id), got {echo(request)}")
    if not isinstance(rid, str):
        raise InvalidOperationError(f"{what}: request_id must be a str, got {echo(rid)}")
    if not full:
        return rid
    label = f"{what}: request {name_of(rid)}"
    values = {}
    for name in ("num_tokens", "num_computed_tokens", "num_output_placeholders", "skip_reading_prefix_cache",
                 "block_hashes"):
        v = getattr(request, name, _MISSING)
        if v is _MISSING:
            raise InvalidOperationError(f"{label} has no field {name}")
        values[name] = v
    for name in ("num_tokens", "num_computed_tokens", "num_output_placeholders"):
        check_count(values[name], f"{label}: {name}")
    if not isinstance(values["skip_reading_prefix_cache"], bool):
        raise InvalidOperationError(f"{label}: skip_reading_prefix_cache must be a bool, "
                                    f"got {echo(values['skip_reading_prefix_cache'])}")
    hashes = values["block_hashes"]
    if not isinstance(hashes, (list, tuple)):
        raise InvalidOperationError(f"{label}: block_hashes must be a list of str, got {echo(hashes)}")
    if hashes and not _all_str(hashes):
        i, bad = next((i, h) for i, h in enumerate(hashes) if not isinstance(h, str))
        raise InvalidOperationError(f"{label}: block_hashes[{i}] must be a str, got {echo(bad)}")
    return rid


def check_block_ids(block_ids: object, num_groups: int, num_blocks: int, what: str, *,
                      none_groups: bool = True) -> BlockIds:
    """Per-group GPU block ids (a scheduler output's or a full table): one list
    (or tuple) of GPU block ids per group, every id an int in ``0..num_blocks-1``; a group may be
    None only when ``none_groups``. ``GroupCountError`` for the shape, ``InvalidBlockError`` for
    an id. O(ids)."""
    if not isinstance(block_ids, (tuple, list)) or len(block_ids) != num_groups:
        got = len(block_ids) if isinstance(block_ids, (tuple, list)) else type(block_ids).__name__
        raise GroupCountError(f"{what}: expected block ids for {num_groups} group(s), got {got}")
    for g, ids in enumerate(block_ids):
        if ids is None:
            if not none_groups:
                raise GroupCountError(f"{what}: group {g} has no block ids (None)")
            continue
        if not isinstance(ids, (list, tuple)):
            raise GroupCountError(f"{what}: group {g} must be a list of block ids, got {echo(ids)}")
        if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < num_blocks):
            continue
        for b in ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks:
                raise InvalidBlockError(f"{what}: group {g} block id {echo(b)} out of range 0..{num_blocks - 1}")
    return tuple(block_ids)


def _field(obj: object, name: str, what: str, expected: str) -> Any:
    v = getattr(obj, name, _MISSING)
    if v is _MISSING:
        raise InvalidOperationError(f"{what}: expected {expected}, got {echo(obj)} (no field {name})")
    return v


def check_scheduler_output(out: object, num_groups: int, num_blocks: int) -> int:
    """Everything ``build_connector_meta`` reads of a ``SchedulerOutput``, shapes first:
    ``scheduled_new_reqs`` a list of ``NewRequestData`` (``req_id`` a str, ``block_ids`` a block
    table); ``scheduled_cached_reqs`` with ``req_ids`` (a list of str), ``new_block_ids`` (a list
    as long, each entry None or a block table whose groups may be None) and ``resumed_req_ids``;
    ``preempted_req_ids`` and ``finished_req_ids`` sets (or lists) of str;
    ``num_scheduled_tokens`` a dict str -> non-negative int. Returns the smallest
    ``num_scheduled_tokens`` value (0 when there is none). O(requests + ids)."""
    what, so = "build_connector_meta", "a SchedulerOutput"
    new = _field(out, "scheduled_new_reqs", what, so)
    cr = _field(out, "scheduled_cached_reqs", what, so)
    counts = _field(out, "num_scheduled_tokens", what, so)
    preempted = _field(out, "preempted_req_ids", what, so)
    finished = _field(out, "finished_req_ids", what, so)
    tables = _new_request_tables(new)
    req_ids, new_ids = _cached_request_fields(cr)
    check_request_ids(preempted, "preempted_req_ids")
    check_request_ids(finished, "finished_req_ids")
    if not isinstance(counts, Mapping):
        raise InvalidOperationError(f"num_scheduled_tokens must be a dict request id -> tokens, got {echo(counts)}")
    if counts and not _all_str(counts):
        bad = next(r for r in counts if not isinstance(r, str))
        raise InvalidOperationError(f"num_scheduled_tokens: a request id must be a str, got {echo(bad)}")
    if len(req_ids) != len(new_ids):
        raise InvalidOperationError(
            f"scheduled_cached_reqs lists {len(req_ids)} request id(s) but {len(new_ids)} block-id entries")
    if new_ids.count(None) != len(new_ids):
        tables += [(r, ids) for r, ids in zip(req_ids, new_ids, strict=True) if ids is not None]
    for rid, ids in tables:
        _check_output_table(rid, ids, num_groups, num_blocks)
    return _smallest_count(counts)


def _new_request_tables(new: object) -> list[tuple[str, Any]]:
    """``scheduled_new_reqs``: a list of records with a str ``req_id``; their (id, table) pairs."""
    if not isinstance(new, list):
        raise InvalidOperationError(f"scheduled_new_reqs must be a list of NewRequestData, got {echo(new)}")
    tables: list[tuple[str, Any]] = []
    for i, nr in enumerate(new):
        rid = _field(nr, "req_id", f"scheduled_new_reqs[{i}]", "a NewRequestData")
        ids = _field(nr, "block_ids", f"scheduled_new_reqs[{i}]", "a NewRequestData")
        if not isinstance(rid, str):
            raise InvalidOperationError(f"scheduled_new_reqs[{i}].req_id must be a str, got {echo(rid)}")
        tables.append((rid, ids))
    return tables


def _cached_request_fields(cr: object) -> tuple[list[str], list[Any]]:
    """``scheduled_cached_reqs``: ``req_ids`` a list of str, ``new_block_ids`` a list and
    ``resumed_req_ids`` request ids; returns (``req_ids``, ``new_block_ids``)."""
    crd = "a CachedRequestData"
    req_ids = _field(cr, "req_ids", "scheduled_cached_reqs", crd)
    new_ids = _field(cr, "new_block_ids", "scheduled_cached_reqs", crd)
    resumed = _field(cr, "resumed_req_ids", "scheduled_cached_reqs", crd)
    if not isinstance(req_ids, list):
        raise InvalidOperationError(f"scheduled_cached_reqs.req_ids must be a list of str, got {echo(req_ids)}")
    check_request_ids(req_ids, "scheduled_cached_reqs.req_ids")
    if not isinstance(new_ids, list):
        raise InvalidOperationError(f"scheduled_cached_reqs.new_block_ids must be a list, got {echo(new_ids)}")
    check_request_ids(resumed, "scheduled_cached_reqs.resumed_req_ids")
    return req_ids, new_ids


def _check_output_table(rid: str, ids: Any, num_groups: int, num_blocks: int) -> None:
    """One block table of a scheduler output (groups may be None): one C-level pass over the
    ids when the shape is right, else ``check_block_ids`` for the exact message."""
    if (isinstance(ids, (tuple, list)) and len(ids) == num_groups
            and all(g is None or isinstance(g, (list, tuple)) for g in ids)):
        flat = [b for g in ids if g is not None for b in g]
        if not flat or (set(map(type, flat)) == {int} and min(flat) >= 0 and max(flat) < num_blocks):
            return
    check_block_ids(ids, num_groups, num_blocks, f"scheduler output for {name_of(rid)}")


def _smallest_count(counts: Mapping[str, Any]) -> int:
    """The smallest ``num_scheduled_tokens`` value (0 when there is none); every value must be a
    non-negative int (``InvalidCountError`` naming the request)."""
    if not counts:
        return 0
    values = counts.values()
    if set(map(type, values)) == {int}:
        low: int = min(values)
        if low >= 0:
            return low
    for rid, n in counts.items():
        check_count(n, f"num_scheduled_tokens[{name_of(rid)}]")
    smallest: int = min(values)  # every value is a non-negative int (some of an int subclass)
    return smallest


def check_worker_output(out: object, load_sent: Callable[[str], bool | None], store_event_counter: int,
                        world_size: int, *, rules: bool = True) -> None:
    """Worker reports (``update_connector_output``), shapes first, bounded messages:
    ``finished_recving`` a set (or list) of request ids, each naming a request whose load was
    sent; ``completed_store_events`` a dict int event id -> worker count, each event issued, each
    count in 1..world_size. ``rules`` False (raw mode): the shapes only, counts any int."""
    what = "update_connector_output"
    recving = _field(out, "finished_recving", what, "a KVConnectorOutput")
    events = _field(out, "completed_store_events", what, "a KVConnectorOutput")
    check_request_ids(recving, "finished_recving")
    if not isinstance(events, Mapping):
        raise InvalidOperationError(f"completed_store_events must be a dict event id -> worker count, "
                                    f"got {echo(events)}")
    for e in events:
        if not isinstance(e, int) or isinstance(e, bool):
            raise InvalidOperationError(f"completed_store_events: an event id must be an int, got {echo(e)}")
    if not rules:
        for e, c in events.items():
            check_count_type(c, f"worker count for store event {e}")
        return
    for rid in recving:
        sent = load_sent(rid)
        if sent is None:
            raise UnknownRequestError(f"finished_recving names {echo(rid)}, which has no load")
        if not sent:
            raise InvalidOperationError(f"finished_recving names {echo(rid)}, whose load was never sent")
    for e, c in events.items():
        if not 0 <= e < store_event_counter:
            raise UnknownEventError(f"store event {echo(e)} was never issued")
        check_count(c, f"worker count for store event {e}", world_size)
        if c == 0:
            raise InvalidOperationError(f"worker count for store event {e} is 0")


# -- rules that read the target's state -------------------------------------------------------


def check_load_acceptance(rid: str, num_external_tokens: int, block_size: int, hit_len: int,
                          load_registered: bool) -> None:
    """``update_state_after_alloc`` accepting ``num_external_tokens`` of a pinned CPU hit of
    ``hit_len`` tokens: a multiple of the block size, at most the hit, and no load registered
    for the request yet. ``InvalidOperationError``. O(1)."""
    who = name_of(rid)
    if num_external_tokens % block_size:
        raise InvalidOperationError(
            f"{who}: num_external_tokens {num_external_tokens} is not a multiple of the block size {block_size}")
    if num_external_tokens > hit_len:
        raise InvalidOperationError(f"{who}: accepted {num_external_tokens} external tokens of a {hit_len}-token hit")
    if load_registered:
        raise InvalidOperationError(f"{who}: a load is already registered")


def check_load_block(rid: str, group: int, position: int, table: Sequence[int]) -> int:
    """The GPU block a load copies position ``position`` of group ``group`` into: the request's
    table must have a block there, and not the null block. Returns its id.
    ``InvalidOperationError``. O(1)."""
    if position >= len(table) or table[position] == NULL_BLOCK_ID:
        raise InvalidOperationError(
            f"{name_of(rid)}: group {group} has no allocated GPU block at position {position} for the load")
    return table[position]


def check_store_keys(event: int, gpu_ids: Iterable[int], block_hash: Callable[[int], object]) -> None:
    """A store event about to complete: every GPU block it copied still carries its key
    (``block_hash(id)`` is not None), as vLLM asserts before it registers the CPU copies.
    ``InvalidOperationError``. O(blocks)."""
    for g in gpu_ids:
        if block_hash(g) is None:
            raise InvalidOperationError(f"store event {event}: GPU block {g} lost its hash before completion")


def check_key_change(pool: str, block_id: int, current: str | None, new: str) -> bool:
    """Registering the key text ``new`` (``"<hash>:<group>"``) on ``block_id``, which carries
    ``current``: True when it already carries ``new`` (nothing to do), False when it carries no
    key; a different key is an ``InvalidBlockError`` (the modelled configurations have no
    secondary keys). O(1)."""
    if current is None:
        return False
    if current == new:
        return True
    raise InvalidBlockError(f"{pool}: block {block_id} already cached as {name_of(current)}, "
                            f"cannot also register {name_of(new)}")


# -- pool-face checks (every GPU and CPU pool: model, implementation, vLLM adapter) ------------


def check_id_list(block_ids: object, num_blocks: int, pool: str, what: str, allow_null: bool = False) -> list[int]:
    """Block ids for a pool operation (touch, free, evict, register): any iterable of block ids
    (not a string or a mapping), returned as a list, every id an int in ``0..num_blocks-1``; the
    null block 0 only when ``allow_null`` (vLLM skips it in touch/free; every caller in the
    modelled system filters it). Bounded messages. ``InvalidBlockError``. O(len)."""
    if isinstance(block_ids, (str, bytes, Mapping)) or not isinstance(block_ids, Iterable):
        raise InvalidBlockError(f"{pool}: cannot {what} {echo(block_ids)}: expected an iterable of block ids")
    ids = list(block_ids)
    lowest = NULL_BLOCK_ID if allow_null else NULL_BLOCK_ID + 1
    if ids and set(map(type, ids)) == {int} and min(ids) >= lowest and max(ids) < num_blocks:
        return ids
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < num_blocks:
            raise InvalidBlockError(f"{pool}: cannot {what} block {echo(b)}: ids are 0..{num_blocks - 1}")
        if b == NULL_BLOCK_ID and not allow_null:
            raise InvalidBlockError(f"{pool}: cannot {what} the null block 0")
    return ids


def check_new_block_count(n: object, num_free: int, pool: str) -> int:
    """``get_new_blocks(n)``: ``n`` a non-negative int (not a bool, ``InvalidCountError``) of at
    most the free count (``OutOfBlocksError``)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise InvalidCountError(f"{pool}: cannot allocate {echo(n)} blocks")
    if n > num_free:
        raise OutOfBlocksError(f"{pool}: cannot allocate {echo(n)} blocks, only {num_free} free")
    return n


def _group_range(num_groups: int | None) -> str:
    return "0.." + ("" if num_groups is None else str(num_groups - 1))


def check_group_id(gid: object, num_groups: int | None, pool: str, what: str) -> int:
    """A KV-group id: an int in ``0..num_groups-1`` (no upper bound when the pool was built
    without ``num_groups``). ``InvalidBlockError``."""
    if not isinstance(gid, int) or isinstance(gid, bool) or gid < 0 or (num_groups is not None and gid >= num_groups):
        raise InvalidBlockError(f"{pool}: cannot {what}: group id {echo(gid)} out of range {_group_range(num_groups)}")
    return gid


def check_block_key(key: object, num_groups: int | None, pool: str, what: str, *, lookup: bool = False) -> None:
    """A cache key ``(block_hash, group)``: a 2-tuple of a str and a group id (``check_group_id``).
    To register (``lookup`` False) the hash must also be non-empty and one line, as the snapshot
    writes keys ``"<hash>:<group>"``; a lookup of any str just finds nothing.
    ``InvalidBlockError``."""
    if not isinstance(key, tuple) or len(key) != 2:
        raise InvalidBlockError(f"{pool}: cannot {what} key {echo(key)}: "
                                "a key is a tuple (block_hash: str, group: int)")
    h, g = key
    if not isinstance(h, str):
        raise InvalidBlockError(f"{pool}: cannot {what} key {echo(key)}: the block hash must be a str")
    if not lookup and (not h or "\n" in h):
        raise InvalidBlockError(f"{pool}: cannot {what} key {echo(key)}: the block hash must be a non-empty, "
                                "one-line str")
    if not isinstance(g, int) or isinstance(g, bool) or g < 0 or (num_groups is not None and g >= num_groups):
        check_group_id(g, num_groups, pool, f"{what} key {echo(key)}")  # raises, with the key in the message


def check_cached_block_query(block_hash: object, group_ids: object, num_groups: int | None, pool: str) -> None:
    """``get_cached_block(block_hash, group_ids)``: a str hash and a list (tuple, range) of group
    ids. ``InvalidBlockError``."""
    if not isinstance(block_hash, str):
        raise InvalidBlockError(f"{pool}: cannot look up block hash {echo(block_hash)}: it must be a str")
    if not isinstance(group_ids, (list, tuple, range)):
        raise InvalidBlockError(f"{pool}: cannot look up group ids {echo(group_ids)}: expected a list of ints")
    for gid in group_ids:
        check_group_id(gid, num_groups, pool, "look up")


def check_num_groups(num_groups: object, pool: str) -> int | None:
    """A pool's optional ``num_groups``: None (group ids unbounded) or an int >= 1."""
    if num_groups is not None and (not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1):
        raise InvalidCountError(f"{pool}: num_groups must be None or an int >= 1, got {echo(num_groups)}")
    return num_groups
