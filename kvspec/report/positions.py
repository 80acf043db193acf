"""Position cells: what each block position of a request is, read off an engine snapshot.

A *lane* is one request's positions in one KV group: position ``p`` is the ``p``-th full block
of the request's tokens, whose cache key is ``"<block_hashes[p]>:<group>"``. Each position is in
exactly one state, decided in this order (the first rule that applies wins):

1. ``empty``: the request holds no block there (beyond its table: not allocated yet, preempted,
   finished);
2. ``null``: the null block, or a sliding-window position that has left the window (never read
   again, so never judged);
3. ``cpu``: the key is cached on the CPU;
4. ``storing``: the key is in flight, the GPU side of a live store transfer (an event or a
   queued finish flush);
5. ``gpu``: on the GPU only, at or after the request's store cursor (not yet scanned), or not
   hashed with its own key yet;
6. ``recorded``: below the cursor, on neither side, and recorded as lost, pending repair;
7. ``lost``: below the cursor, on neither side, and not recorded: a hole (what C1 and C2 judge).

Rules 5-7 follow ``kvspec.oracle.catalogue.owned_below_cursor``: only a position whose block is
hashed with the position's key counts as below the cursor. A request with no live store state
has no cursor (``None``), and no position of it is ``lost``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvspec.model.block_pool import NULL_BLOCK
from kvspec.model.rules import window_floor

EMPTY, NULL, CPU, STORING, GPU, RECORDED, LOST = "empty", "null", "cpu", "storing", "gpu", "recorded", "lost"
STATES = (GPU, CPU, STORING, LOST, RECORDED, NULL, EMPTY)

Snapshot = dict[str, Any]


@dataclass(frozen=True)
class Position:
    """One block position of one request: (request, KV group, position index)."""

    rid: str
    group: int
    index: int

    def __str__(self) -> str:
        return f"{self.rid} g{self.group} p{self.index}"


@dataclass(frozen=True)
class Lane:
    """One request's positions in one group, after some operation.

    ``cells[p]`` is the state of position ``p``; ``blocks[p]`` the GPU block there (None beyond
    the table); ``keys[p]`` the position's cache key; ``cursor`` the store cursor
    (``num_stored_blocks``), None without live store state."""

    rid: str
    group: int
    cells: tuple[str, ...]
    blocks: tuple[int | None, ...]
    keys: tuple[str, ...]
    cursor: int | None

    def positions_in(self, state: str) -> list[int]:
        """The positions in ``state``, ascending. O(positions)."""
        return [p for p, cell in enumerate(self.cells) if cell == state]


class SnapshotView:
    """The sets one snapshot's lanes are classified against, built once: CPU-cached keys, keys in
    flight, lost records. Building is O(CPU map + live transfers + records); ``lanes(rid)`` is
    O(groups x positions) for one request."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        sched = snap["scheduler"]
        gpu_hash = snap["gpu_pool"]["block_hash"]
        self.cached = set(snap["cpu_pool"]["cached"])
        live = [*sched["store_events"].values(), *sched["pending_finished_stores"]]
        self.storing = {gpu_hash[g] for t in live for g in t["gpu"] if gpu_hash[g] is not None}
        self.recorded = {Position(str(r), int(g), int(p)) for r, g, p in sched["policy_state"].get("lost", [])}
        self.groups = snap["engine"]["config"]["groups"]
        self.block_size = int(snap["engine"]["config"]["block_size"])

    def cursor(self, rid: str, group: int) -> int | None:
        """The request's store cursor in ``group``, None without live (unfinished) store state."""
        st = self.snap["scheduler"]["reqs_to_store"].get(rid)
        if st is None or st["finished"]:
            return None
        return int(st["num_stored_blocks"][group])

    def floor(self, request: dict[str, Any], group: int) -> int:
        """First position of ``group`` still inside the request's window (0 for full attention)."""
        spec = self.groups[group]
        if spec["kind"] != "sliding":
            return 0
        return window_floor(int(request["num_computed_tokens"]), int(request["num_output_placeholders"]),
                            int(spec["sliding_window"]), self.block_size)

    def lanes(self, rid: str) -> list[Lane]:
        """One lane per group for request ``rid`` (which the snapshot must list)."""
        return [self.lane(rid, g) for g in range(len(self.groups))]

    def lane(self, rid: str, group: int) -> Lane:
        request = self.snap["engine"]["requests"][rid]
        table = request["table"][group] if group < len(request["table"]) else []
        keys = tuple(f"{h}:{group}" for h in request["block_hashes"])
        cursor = self.cursor(rid, group)
        floor = self.floor(request, group)
        cells = tuple(self._state(Position(rid, group, p), keys[p], table, cursor, floor) for p in range(len(keys)))
        blocks = tuple(table[p] if p < len(table) else None for p in range(len(keys)))
        return Lane(rid, group, cells, blocks, keys, cursor)

    def _state(self, pos: Position, key: str, table: list[int], cursor: int | None, floor: int) -> str:
        """The state of one position (the rules of the module docstring, in order). O(1)."""
        p = pos.index
        if p >= len(table):
            return EMPTY
        if table[p] == NULL_BLOCK or p < floor:
            return NULL
        if key in self.cached:
            return CPU
        if key in self.storing:
            return STORING
        if cursor is None or p >= cursor or self.snap["gpu_pool"]["block_hash"][table[p]] != key:
            return GPU
        return RECORDED if pos in self.recorded else LOST
