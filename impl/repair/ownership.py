"""What a request owns, and the key predicates built on it (R1, R4, R7 of ``kvspec.model.repair``).

A request *owns* position p of group g when the block its table holds at p carries the
request's key for p and is referenced, and, in a sliding-window group, p has not left the
window (``rules.window_floor``). A key is *live* when an active request owns it below its
cursor, *covered* when it is cached on CPU or being stored.

While a batch is being committed, cursor advances of its earlier requests are not yet in
the store table's tensor: ``pending_advance`` holds them, and ``cursor`` adds them.

The predicates above read a handful of tensor scalars per position. A loop that asks them of
many positions and changes nothing the predicates read (the victim walk, the repair
candidates, the owners of evicted keys) first takes ``Reads`` for all of them at once:
a few gathers, whatever their number, and the same answers.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvspec.impl.convert import int_tensor
from kvspec.impl.facade import SchedulerFacade
from kvspec.impl.repair.in_flight import InFlightKeys
from kvspec.impl.repair.index import LossIndex, Position
from kvspec.model.rules import window_floor


class Ownership:
    def __init__(self, host: SchedulerFacade, index: LossIndex, in_flight: InFlightKeys) -> None:
        self.host = host
        self.index = index
        self.in_flight = in_flight
        self.windows = [(g.sliding_window if g.kind == "sliding" else 0) for g in host.config.groups]
        self.sliding_groups = [g for g, w in enumerate(self.windows) if w]
        self.pending_advance: dict[int, list[int]] = {}  # slot -> cursor advance per group, not yet written

    def owned_block(self, slot: int, g: int, p: int, b: int | None) -> int | None:
        """``b`` (the request's id at (g, p), None past its table) if the request owns it there,
        else None. O(1) (amortised: the request's hash ids are synced)."""
        if b is None:
            return None
        stores = self.host.stores
        req = stores.request[slot]
        if p >= len(req.block_hashes):
            return None
        w = self.windows[g]
        if w and p < window_floor(req.num_computed_tokens, req.num_output_placeholders, w,
                                  self.host.config.block_size):
            return None
        if b == 0:
            return None
        hids = stores.sync_hids(slot)
        gpu = self.host.gpu_pool
        if int(gpu.key[b]) != hids[p] * self.host.config.num_groups + g or int(gpu.ref[b]) < 1:
            return None
        return b

    def cursor(self, slot: int, g: int) -> int:
        """The slot's cursor, including advances of this batch not yet written to the tensor."""
        adv = self.pending_advance.get(slot)
        return int(self.host.stores.cursor[slot, g]) + (adv[g] if adv is not None else 0)

    def table_id(self, slot: int, g: int, p: int) -> int | None:
        """The accumulated id at (g, p), None past the table."""
        stores = self.host.stores
        if p >= int(stores.length[slot, g]):
            return None
        return int(stores.table[slot, g, p])

    def reads(self, positions: Iterable[Position], kids: Iterable[int] = ()) -> Reads:
        """``Reads`` answering ``owns_below_cursor`` (with the owned block) for ``positions`` and
        ``covered`` for ``kids`` and for the chain parents of ``positions`` (what ``useless``
        asks); three rounds of gathers. O(positions + kids)."""
        owned = self._owned_below_cursor(list(dict.fromkeys(positions)))
        G = self.host.config.num_groups
        stores = self.host.stores
        parents = []
        for (rid, g, p), b in owned.items():
            if b is not None and p > 0:
                hids = stores.hids[stores.slot_of[rid]]
                if p - 1 < len(hids):
                    parents.append(hids[p - 1] * G + g)
        return Reads(self, owned, self._covered_many([*kids, *parents]))

    def _owned_below_cursor(self, positions: list[Position]) -> dict[Position, int | None]:
        """Per position: the block its request owns there below its cursor, or None
        (``owns_below_cursor`` and ``owned_block`` at once); a position whose answer needs the
        request's hash ids synced (interning is left to the scalar path, in its own order) is
        left out."""
        stores = self.host.stores
        slot_of, finished = stores.slot_of, stores.finished
        out: dict[Position, int | None] = {}
        todo: list[Position] = []
        slots: list[int] = []
        for pos in positions:
            slot = slot_of.get(pos[0])
            if slot is None or finished[slot]:
                out[pos] = None
            else:
                todo.append(pos)
                slots.append(slot)
        if not todo:
            return out
        dev = self.host.device
        slot_t = int_tensor(slots, dev)
        group_t = int_tensor([pos[1] for pos in todo], dev)
        cursors = stores.cursor[slot_t, group_t].tolist()
        lengths = stores.length[slot_t, group_t].tolist()
        bs, windows, pending, requests = self.host.config.block_size, self.windows, self.pending_advance, stores.request
        inside: list[int] = []  # indices into todo: below the cursor, inside the table and the hashes
        for i, (pos, slot, cur, length) in enumerate(zip(todo, slots, cursors, lengths, strict=True)):
            _, g, p = pos
            if pending:
                adv = pending.get(slot)
                cur += adv[g] if adv is not None else 0
            req = requests[slot]
            w = windows[g]
            if p < cur and p < length and p < len(req.block_hashes) and not (
                    w and p < window_floor(req.num_computed_tokens, req.num_output_placeholders, w, bs)):
                inside.append(i)
            else:
                out[pos] = None
        if not inside:
            return out
        pick = int_tensor(inside, dev)
        blocks = stores.table[slot_t[pick], group_t[pick], int_tensor([todo[i][2] for i in inside], dev)].tolist()
        self._carry_own_keys([todo[i] for i in inside], [slots[i] for i in inside], blocks, out)
        return out

    def _carry_own_keys(self, positions: list[Position], slots: list[int], blocks: list[int],
                        out: dict[Position, int | None]) -> None:
        """The last test of ``owned_block`` for positions below their cursors: the block is not
        null, carries the request's key for the position and is referenced (one gather of keys
        and ref counts); a position whose hash ids need syncing gets no entry in ``out``."""
        G, hids_of = self.host.config.num_groups, self.host.stores.hids
        check: list[Position] = []
        check_blocks: list[int] = []
        want: list[int] = []  # the key each checked block must carry
        for pos, slot, b in zip(positions, slots, blocks, strict=True):
            hids = hids_of[slot]
            if b == 0:
                out[pos] = None
            elif pos[2] < len(hids):
                check.append(pos)
                check_blocks.append(b)
                want.append(hids[pos[2]] * G + pos[1])
        if check:
            gpu = self.host.gpu_pool
            bt = int_tensor(check_blocks, self.host.device)
            for pos, b, w_key, key, ref in zip(check, check_blocks, want, gpu.key[bt].tolist(), gpu.ref[bt].tolist(),
                                               strict=True):
                out[pos] = b if key == w_key and ref >= 1 else None

    def _covered_many(self, kids: list[int]) -> dict[int, bool]:
        """``covered`` per key id: one gather of the CPU prefix index."""
        kids = list(dict.fromkeys(kids))
        if not kids:
            return {}
        index = self.host.cpu_pool.index
        inside = [k for k in kids if 0 <= k < index.first.numel() - 1]
        firsts = dict(zip(inside, index.first[int_tensor(inside, self.host.device)].tolist(), strict=True))
        counts = self.in_flight.counts
        return {k: counts.get(k, 0) > 0 or firsts.get(k, -1) >= 0 for k in kids}

    def owns_below_cursor(self, pos: Position) -> bool:
        """The position's request is active and owns it below its cursor."""
        rid, g, p = pos
        stores = self.host.stores
        slot = stores.slot_of.get(rid)
        return not (slot is None or stores.finished[slot] or p >= self.cursor(slot, g)
                    or self.owned_block(slot, g, p, self.table_id(slot, g, p)) is None)

    def is_live(self, kid: int) -> bool:
        """Some active request owns ``kid`` below its cursor (stale owners are pruned)."""
        return self.index.live(kid, self.owns_below_cursor)

    def covered(self, kid: int) -> bool:
        """Cached on CPU, or cached when a store in flight completes."""
        return self.in_flight.count(kid) > 0 or self.host.cpu_pool.index.get_one(kid) >= 0

    def useless(self, pos: Position) -> bool:
        """The key at ``pos`` is *useless*: its chain parent (the key one position earlier) is not
        covered, so no lookup can reach it. A first position has no parent: never useless."""
        parent = self.parent_key(pos)
        return parent is not None and not self.covered(parent)

    def parent_key(self, pos: Position) -> int | None:
        """The key one position before ``pos`` in its request's chain (None at position 0)."""
        rid, g, p = pos
        if p == 0:
            return None
        stores = self.host.stores
        return stores.sync_hids(stores.slot_of[rid])[p - 1] * self.host.config.num_groups + g


class Reads:
    """``owned_block``-below-cursor and ``covered`` answers taken in one batch (``Ownership.reads``),
    valid while nothing they read changes: the store table, the GPU pool's keys and ref counts,
    the CPU prefix index, the in-flight keys. A position or key it holds no answer for (never
    asked, or one only the scalar path may answer: it interns the request's new hash ids) is
    answered by the scalar predicates."""

    def __init__(self, ownership: Ownership, owned: dict[Position, int | None], covered: dict[int, bool]) -> None:
        self.ownership = ownership
        self.owned = owned  # position -> the block its request owns there below its cursor, or None
        self._covered = covered

    def owns_below_cursor(self, pos: Position) -> bool:
        b = self.owned.get(pos, -1)
        return self.ownership.owns_below_cursor(pos) if b == -1 else b is not None

    def is_live(self, kid: int) -> bool:
        """``Ownership.is_live`` (stale owners are pruned the same way)."""
        return self.ownership.index.live(kid, self.owns_below_cursor)

    def covered(self, kid: int) -> bool:
        c = self._covered.get(kid)
        return self.ownership.covered(kid) if c is None else c

    def useless(self, pos: Position) -> bool:
        """``Ownership.useless``."""
        parent = self.ownership.parent_key(pos)
        return parent is not None and not self.covered(parent)
