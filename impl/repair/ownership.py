"""What a request owns, and the key predicates built on it (R1, R4, R7 of ``kvspec.model.repair``).

A request *owns* position p of group g when the block its table holds at p carries the
request's key for p and is referenced, and, in a sliding-window group, p has not left the
window (``rules.window_floor``). A key is *live* when an active request owns it below its
cursor, *covered* when it is cached on CPU or being stored.

While a batch is being committed, cursor advances of its earlier requests are not yet in
the store table's tensor: ``pending_advance`` holds them, and ``cursor`` adds them.
"""

from __future__ import annotations

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
        rid, g, p = pos
        if p == 0:
            return False
        stores = self.host.stores
        hids = stores.sync_hids(stores.slot_of[rid])
        return not self.covered(hids[p - 1] * self.host.config.num_groups + g)
