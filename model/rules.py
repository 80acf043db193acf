"""Pure rules of the store scan, shared by the scheduler and checked by CrossHair.

Each function is a plain function of ints, bools and lists (no pools, no state), with
its contract in PEP 316 docstring form (``pre:``/``post:``), which
``crosshair check kvspec.model.rules`` verifies (tests/test_crosshair.py).
"""

from __future__ import annotations

# Store-candidate classes (vLLM ``_StoreAdmission``).
NULL, NOT_HASHED, IN_FLIGHT = "null", "not_hashed", "in_flight"
ALREADY_CACHED, READY = "already_cached", "ready"


def ready_blocks(computed: int, placeholders: int, num_ids: int, block_size: int) -> int:
    """Confirmed full blocks: ``computed`` tokens minus output ``placeholders``, in whole
    blocks, capped at the number of ids. O(1).

    pre: block_size >= 1
    pre: num_ids >= 0
    post: 0 <= __return__ <= num_ids
    post: __return__ * block_size <= max(0, computed - placeholders)
    post: __return__ == num_ids or (__return__ + 1) * block_size > computed - placeholders
    """
    return min(num_ids, max(0, computed - placeholders) // block_size)


def window_floor(computed: int, window: int, block_size: int) -> int:
    """Leading positions of a sliding-window group that have left the window after ``computed``
    tokens (vLLM ``remove_skipped_blocks``: the block of token ``computed - window`` and those
    before it are never read again). O(1).

    pre: block_size >= 1
    pre: window >= 1
    pre: computed >= 0
    post: __return__ >= 0
    post: __return__ * block_size <= max(0, computed - window + 1)
    post: (__return__ + 1) * block_size > computed - window + 1
    """
    return max(0, computed - window + 1) // block_size


def classify_store_candidate(is_null: bool, hashed: bool, in_flight: bool, cached: bool) -> str:
    """vLLM ``_classify_store_candidate``, first match wins: null, not hashed, in flight,
    already cached on CPU, else ready to store. O(1).

    post: __return__ in (NULL, NOT_HASHED, IN_FLIGHT, ALREADY_CACHED, READY)
    post: (__return__ == READY) == (not is_null and hashed and not in_flight and not cached)
    post: (__return__ == NULL) == is_null
    post: __return__ != IN_FLIGHT or in_flight
    post: __return__ != ALREADY_CACHED or (cached and not in_flight)
    """
    if is_null:
        return NULL
    if not hashed:
        return NOT_HASHED
    if in_flight:
        return IN_FLIGHT
    if cached:
        return ALREADY_CACHED
    return READY


def scan_group(flags: list[bool], taken: int, free: int) -> tuple[list[int], int]:
    """The positional scan of one group from its cursor: ``flags[k]`` says whether the k-th
    position from the cursor is READY. Non-ready positions are passed; a READY one is
    selected while the step's selection (``taken`` before this group) stays below the free
    count, else the scan stops there without passing it. Returns the selected offsets and
    the cursor advance. O(len(flags)).

    pre: taken >= 0
    post: 0 <= __return__[1] <= len(flags)
    post: __return__[0] == [k for k in range(__return__[1]) if flags[k]]
    post: taken + len(__return__[0]) <= max(free, taken)
    post: __return__[1] == len(flags) or (flags[__return__[1]] and taken + len(__return__[0]) >= free)
    """
    picked: list[int] = []
    advance = 0
    for k, is_ready in enumerate(flags):
        if is_ready:
            if taken + len(picked) >= free:
                break
            picked.append(k)
        advance += 1
    return picked, advance
