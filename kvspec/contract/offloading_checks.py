"""Input checks of the second manager's contract, shared by every target (model, impl, vLLM's adapter).

A key is ``(hash, group)``: a non-empty string without line breaks and an int group in
``[0, 2**32)`` (vLLM packs the group into 4 bytes). A call names each key at most once.
Each check raises ``InvalidOperationError`` naming the offending value, before any state
changes. O(k) for k keys.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

from kvspec.contract.errors import InvalidOperationError, UnknownRequestError
from kvspec.contract.offloading import OffloadKey

_MAX_GROUP = 2**32


def _check_key(key: object) -> OffloadKey:
    if (not isinstance(key, tuple) or len(key) != 2 or not isinstance(key[0], str) or not key[0]
            or "\n" in key[0] or type(key[1]) is not int or not 0 <= key[1] < _MAX_GROUP):
        raise InvalidOperationError(f"an offload key is (non-empty hash, group in [0, 2**32)), got {key!r:.60}")
    return key


def check_keys(keys: object) -> None:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise InvalidOperationError(f"keys must be a list of (hash, group), got {type(keys).__name__}")
    seen: set[OffloadKey] = set()
    for key in keys:
        k = _check_key(key)
        if k in seen:
            raise InvalidOperationError(f"key {k[0]}:{k[1]} is named twice in one call")
        seen.add(k)


def check_positions(positions: object) -> None:
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence):
        raise InvalidOperationError("positions must be a list of (key, end-token position)")
    for pair in positions:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidOperationError(f"a position is (key, end token), got {pair!r:.60}")
        _check_key(pair[0])
        if type(pair[1]) is not int or pair[1] < 0:
            raise InvalidOperationError(f"an end-token position is an int >= 0, got {pair[1]!r:.30}")


def check_new_request(req_id: object, known: Collection[str]) -> None:
    """A request id is a non-empty string never used before (vLLM's ids are unique)."""
    if not isinstance(req_id, str) or not req_id or "\n" in req_id:
        raise InvalidOperationError(f"a request id is a non-empty one-line string, got {req_id!r:.60}")
    if req_id in known:
        raise InvalidOperationError(f"request {req_id!r:.60} is already known")


def check_loadable(keys: Sequence[OffloadKey], ref_cnt: Callable[[OffloadKey], int | None]) -> None:
    """Every key has a ready chunk (``ref_cnt(key)`` is its ref count, None without a chunk):
    vLLM asserts it in ``prepare_load``."""
    for key in keys:
        r = ref_cnt(key)
        if r is None or r < 0:
            state = "not cached" if r is None else "still being stored"
            raise InvalidOperationError(f"cannot load {key[0]}:{key[1]}: {state}")


def check_loading(keys: Sequence[OffloadKey], ref_cnt: Callable[[OffloadKey], int | None]) -> None:
    """Every key has a load in flight (``ref_cnt > 0``): vLLM asserts it in ``complete_load``."""
    for key in keys:
        r = ref_cnt(key)
        if r is None or r <= 0:
            raise InvalidOperationError(f"cannot complete a load of {key[0]}:{key[1]}: no load is in flight")


def check_success(success: object) -> None:
    if not isinstance(success, bool):
        raise InvalidOperationError(f"success must be a bool, got {success!r:.30}")


_C = TypeVar("_C")


def known_request(req_id: object, contexts: Mapping[str, _C], submit: bool, closed: Callable[[_C], bool]) -> _C:
    """The context of a known request; for a submit-side call (``lookup``, ``prepare_*``,
    ``touch``, positions) also one not finished (``closed``): vLLM's connector makes no such call
    after ``on_request_finished``, while completions of its transfers may still come."""
    ctx = contexts.get(req_id) if isinstance(req_id, str) else None
    if ctx is None:
        raise UnknownRequestError(f"unknown request {req_id!r:.60}")
    if submit and closed(ctx):
        raise InvalidOperationError(f"request {req_id!r:.60} has finished: no more lookups, loads or stores")
    return ctx
