"""Pure rules of the store scan, each stated once and called by the policies that use it.

Each function is a plain function of ints, bools, strings and lists (no pools, no state),
with its contract in PEP 316 docstring form (``pre:``/``post:``), which
``crosshair check kvspec.model.rules`` verifies (tests/test_crosshair.py). The policies
(``kvspec.model.baseline``, ``signal_rescan``, ``repair``) gather what a position is from
the pools and the request, pass it here, and apply the answer; none of them restates a
rule of this module.

* ``ready_blocks``, ``window_floor``: which positions a request has confirmed, and which a
  sliding-window group has let go of.
* ``classify_store_candidate``: what a GPU block is to a store (vLLM's classes).
* ``scan_group``: the baseline's positional scan of one group from its cursor (vLLM 0.33.0).
* ``rescan_end``, ``rescan_group``: PR #47235's Phase 1a rescan below the cursor and
  Phase 1b scan above it, with the options of ``SignalRescanOptions``.
* ``repair_step``: the repair policy's decision at one position of its scan (R3-R5), and
  ``repair_scan``: its scan of one group, position after position.
"""

from __future__ import annotations

from typing import NamedTuple

# Store-candidate classes (vLLM ``_StoreAdmission``), and the repair policy's "not owned" and
# "retained" (a position it does not own whose free GPU copy is READY to store).
NULL, NOT_HASHED, IN_FLIGHT = "null", "not_hashed", "in_flight"
ALREADY_CACHED, READY = "already_cached", "ready"
NOT_OWNED, RETAINED = "not_owned", "retained"
STORABLE = (IN_FLIGHT, ALREADY_CACHED, READY)  # the classes of owned blocks a repair scan does not simply pass
SELECTABLE = (READY, RETAINED)  # the kinds a repair scan selects while there is room

# What the repair scan does at one position (``repair_step``).
PASS, STOP, OWN, PIN, SELECT = "pass", "stop", "own", "pin", "select"


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


def window_floor(computed: int, placeholders: int, window: int, block_size: int) -> int:
    """Leading positions of a sliding-window group that have left the window for good: those
    whose tokens all precede the last ``window`` *confirmed* tokens, ``computed`` minus output
    ``placeholders`` (vLLM ``remove_skipped_blocks``: the block of token ``confirmed - window``
    and those before it are never read again). Placeholders are left out because speculative
    drafts among them may be rejected, which lowers the computed tokens and brings positions back
    into the window; the confirmed tokens never go down while the request runs. O(1).

    pre: block_size >= 1
    pre: window >= 1
    pre: computed >= 0
    pre: placeholders >= 0
    post: __return__ >= 0
    post: __return__ * block_size <= max(0, computed - placeholders - window + 1)
    post: (__return__ + 1) * block_size > computed - placeholders - window + 1
    """
    return max(0, computed - placeholders - window + 1) // block_size


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


class GroupScan(NamedTuple):
    """One group's scan: the offsets selected, how far the cursor advances, and whether the
    scan stopped short at a READY position it had no room for."""

    picked: list[int]
    advance: int
    stopped: bool


def scan_group(flags: list[bool], taken: int, free: int) -> GroupScan:
    """The positional scan of one group from its cursor: ``flags[k]`` says whether the k-th
    position from the cursor is READY. Non-ready positions are passed; a READY one is
    selected while the step's selection (``taken`` before this group) stays below the free
    count, else the scan stops there without passing it. O(len(flags)).

    pre: taken >= 0
    post: 0 <= __return__.advance <= len(flags)
    post: __return__.picked == [k for k in range(__return__.advance) if flags[k]]
    post: taken + len(__return__.picked) <= max(free, taken)
    post: __return__.stopped == (__return__.advance < len(flags))
    post: not __return__.stopped or (flags[__return__.advance] and taken + len(__return__.picked) >= free)
    """
    picked: list[int] = []
    advance = 0
    for k, is_ready in enumerate(flags):
        if is_ready:
            if taken + len(picked) >= free:
                return GroupScan(picked, advance, True)
            picked.append(k)
        advance += 1
    return GroupScan(picked, advance, False)


def rescan_end(cursor: int, ready: int, num_ids: int, cap_at_ready: bool) -> int:
    """Where PR #47235's Phase 1a rescan of ``[0, cursor)`` ends: at the cursor, capped at the
    confirmed blocks (``cap_rescan_at_ready``) or else at the ids the request holds. O(1).

    pre: 0 <= ready <= num_ids
    pre: cursor >= 0
    post: 0 <= __return__ <= min(cursor, num_ids)
    post: not cap_at_ready or __return__ <= ready
    post: __return__ == cursor or __return__ == (ready if cap_at_ready else num_ids)
    """
    return min(cursor, ready if cap_at_ready else num_ids)


class Rescan(NamedTuple):
    """One group under PR #47235: Phase 1a's re-stores (offsets from position 0), Phase 1b's
    selection (offsets from the cursor), the cursor advance, and the positions looked at."""

    restored: list[int]
    picked: list[int]
    advance: int
    visits: int


def rescan_group(stored: list[bool], new: list[bool], taken: int, free: int, oos_stops_scan: bool) -> Rescan:
    """PR #47235 on one group (§9.2): Phase 1a re-stores the READY positions of ``stored``
    (``[0, rescan_end)``) while there is room, never moving the cursor; Phase 1b is the
    baseline scan (``scan_group``) of ``new`` (``[cursor, ready)``) with what is left. When
    Phase 1a runs out of room, ``oos_stops_scan`` skips Phase 1b (``rescan_oos_stops_scan``).
    A phase looks at the positions it passes and the one it stops at.
    O(len(stored) + len(new)).

    pre: taken >= 0
    post: __return__.restored == [k for k, r in enumerate(stored) if r][: max(0, free - taken)]
    post: taken + len(__return__.restored) + len(__return__.picked) <= max(free, taken)
    post: 0 <= __return__.advance <= len(new)
    post: __return__.picked == [k for k in range(__return__.advance) if new[k]]
    post: __return__.advance == len(new) or free <= taken + len(__return__.restored) + len(__return__.picked)
    post: __return__.advance == len(new) or new[__return__.advance] or oos_stops_scan
    post: __return__.advance == 0 or not oos_stops_scan or sum(stored) <= max(0, free - taken)
    post: __return__.visits <= len(stored) + len(new)
    """
    phase_1a = scan_group(stored, taken, free)
    visits = phase_1a.advance + phase_1a.stopped
    if phase_1a.stopped and oos_stops_scan:
        return Rescan(phase_1a.picked, [], 0, visits)
    phase_1b = scan_group(new, taken + len(phase_1a.picked), free)
    return Rescan(phase_1a.picked, phase_1b.picked, phase_1b.advance, visits + phase_1b.advance + phase_1b.stopped)


def repair_step(kind: str, duplicate: bool, entry_free: bool, taken: int, free: int) -> str:
    """The repair scan at one position of ``[cursor, ready)`` (R3-R5), given what the position
    is (``kind``: the class of the block the request owns there, by key; RETAINED when it owns
    none there but a free GPU copy of its key is READY; else NOT_OWNED), whether its key was
    selected earlier in this group (``duplicate``), whether its cached CPU entry sits in the
    free queue (``entry_free``), the blocks selected so far for this request in this step
    (``taken``) and the CPU free count now (``free``, lowered by pins):

    * not owned or not hashed: PASS (the cursor moves on, nothing is recorded);
    * in flight, or a duplicate of a selected key (R4): OWN (indexed as an owner, R1);
    * already cached: PIN (owner, pinned for the step, R5), unless pinning a free entry
      would leave less room than the selection needs: STOP;
    * ready, or retained: SELECT while the selection stays below the free count, else STOP;
      a retained duplicate is passed (not owned, so never indexed).

    STOP ends the group's scan without passing the position. O(1).

    pre: taken >= 0
    post: __return__ in (PASS, STOP, OWN, PIN, SELECT)
    post: (__return__ == PASS) == (kind not in STORABLE and (kind != RETAINED or duplicate))
    post: (__return__ == SELECT) == (kind in SELECTABLE and not duplicate and taken < free)
    post: (__return__ == PIN) == (kind == ALREADY_CACHED and not (entry_free and free - 1 < taken))
    post: (__return__ == OWN) == (kind == IN_FLIGHT or (kind == READY and duplicate))
    """
    if kind in SELECTABLE and not duplicate:
        return SELECT if taken < free else STOP
    if kind == ALREADY_CACHED:
        return STOP if entry_free and free - 1 < taken else PIN
    if kind in (IN_FLIGHT, READY):
        return OWN
    return PASS


class RepairScan(NamedTuple):
    """One group's repair scan: the decision at each position passed (offsets from the cursor;
    never STOP), and whether it stopped short (at offset ``len(steps)``)."""

    steps: list[str]
    stopped: bool


def repair_scan(kinds: list[str], keys: list[int], entry_free: list[bool], taken: int, free: int) -> RepairScan:
    """The repair scan of one group from its cursor: ``repair_step`` at each position, with
    ``kinds[k]``, ``keys[k]`` and ``entry_free[k]`` what the k-th position is, its key (read only
    where the request owns it or a retained copy is READY) and whether its cached CPU entry is
    free. A key selected earlier in the group is a duplicate; the selection count starts at
    ``taken``; a PIN of a free entry takes it out of the free queue, so the free count drops by
    one. STOP ends the scan there.
    O(len(kinds)).

    pre: len(kinds) == len(keys) == len(entry_free)
    pre: all(k in (NOT_OWNED, NOT_HASHED, IN_FLIGHT, ALREADY_CACHED, READY, RETAINED) for k in kinds)
    pre: taken >= 0
    post: len(__return__.steps) <= len(kinds)
    post: __return__.stopped == (len(__return__.steps) < len(kinds))
    post: STOP not in __return__.steps
    post: all((s == PASS) == (kinds[k] not in STORABLE) for k, s in enumerate(__return__.steps) if kinds[k] != RETAINED)
    post: all(s in (PASS, SELECT) for k, s in enumerate(__return__.steps) if kinds[k] == RETAINED)
    post: _distinct_selections(keys, __return__.steps)
    post: all(s == SELECT for k, s in enumerate(__return__.steps) if kinds[k] in SELECTABLE and keys[k] not in keys[:k])
    post: taken + __return__.steps.count(SELECT) + _free_pins(__return__.steps, entry_free) <= max(free, taken)
    post: not __return__.stopped or _stop_for_room(kinds, entry_free, __return__.steps, taken, free)
    """
    steps: list[str] = []
    selected: set[int] = set()
    for kind, key, free_entry in zip(kinds, keys, entry_free, strict=True):
        step = repair_step(kind, key in selected, free_entry, taken + len(selected), free)
        if step == STOP:
            return RepairScan(steps, True)
        steps.append(step)
        if step == SELECT:
            selected.add(key)
        elif step == PIN and free_entry:
            free -= 1
    return RepairScan(steps, False)


def _distinct_selections(keys: list[int], steps: list[str]) -> bool:
    """``repair_scan``'s contract: no key is selected twice."""
    picked = [keys[k] for k, s in enumerate(steps) if s == SELECT]
    return len(set(picked)) == len(picked)


def _free_pins(steps: list[str], entry_free: list[bool]) -> int:
    """``repair_scan``'s contract: the pins that took a free entry out of the free queue."""
    return sum(1 for k, s in enumerate(steps) if s == PIN and entry_free[k])


def _stop_for_room(kinds: list[str], entry_free: list[bool], steps: list[str], taken: int, free: int) -> bool:
    """``repair_scan``'s contract: the position it stopped at is READY (or RETAINED) with the selection at the
    free count, or already cached with a free entry whose pin would leave less room than the
    selection (the free count lowered, in both cases, by the scan's earlier pins of free entries)."""
    at, chosen, pinned = len(steps), taken + steps.count(SELECT), _free_pins(steps, entry_free)
    if kinds[at] in SELECTABLE:
        return chosen >= free - pinned
    return kinds[at] == ALREADY_CACHED and entry_free[at] and free - pinned - 1 < chosen
