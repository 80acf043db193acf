"""The scan of ``repair`` (R3, R4, R5 of ``kvspec.model.repair``): what each request of a batch decides.

For a batch of scheduled requests (distinct slots), one round of tensor ops gathers
everything a candidate position's decision needs (``facts``): its block, whether the
request owns it there, the key, the key's CPU entry and whether that entry is free. A
Python pass then decides request after request, in vLLM's order (``plan``), with the
batch's own effects tracked in a ``ScanState``: the CPU free count (selections and pins
of free entries use it up), the keys earlier requests selected (in flight for later
ones), which free entries are pinned, and which keys each request read (an allocation
that evicts one ends the batch before that request; ``kvspec.impl.repair.commit``).

Per position, in group order from the cursor, ``rules.repair_step`` decides: a position
the request does not own is stored from its retained copy (a free GPU block carrying the
request's key: the table's, else the GPU prefix cache's) when that copy's key is READY,
never indexed or pinned, else passed; an owned one is classified by key
(``rules.classify_store_candidate``): IN_FLIGHT or a repeat of a key the request selected
(an owner only), ALREADY_CACHED (pinned for the step, R5; the scan stops instead when
pinning a free entry would leave no room for the step's selection) or READY (selected
while the free count lasts, else the group's scan stops there). Every owned position
passed or taken is indexed under its key (R1). Sliding groups first retire the covered keys of positions
that left the window since the last scan (R7 b). The finish flush runs the same scan on
the live table (``kvspec.impl.repair.policy``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvspec.impl.batched_rules import window_floors
from kvspec.impl.convert import int_tensor
from kvspec.impl.facade import SchedulerFacade
from kvspec.impl.planner import Layout
from kvspec.impl.repair.in_flight import InFlightKeys
from kvspec.impl.repair.index import LossIndex, Position
from kvspec.impl.repair.ownership import Ownership
from kvspec.model.rules import (
    ALREADY_CACHED,
    NOT_OWNED,
    PASS,
    PIN,
    READY,
    RETAINED,
    SELECT,
    STOP,
    classify_store_candidate,
    repair_step,
    window_floor,
)


class CandidateFacts(NamedTuple):
    """Per candidate position of a batch (flat, in visiting order), one gather each."""

    gpu_block: torch.Tensor  # the block to store: the request's at the position, or its retained copy
    owned: torch.Tensor  # the request owns the position's block (R1)
    retained: torch.Tensor  # not owned, and a retained copy carries the request's key (R3)
    key: torch.Tensor  # the request's key where owned or retained, else -1
    cpu_block: torch.Tensor  # the key's first CPU block, -1 when not cached
    cpu_free: torch.Tensor  # that CPU block is free (ref 0)


class CandidateLists(NamedTuple):
    """The same facts as Python lists, with each candidate's group and position."""

    group: list[int]
    position: list[int]
    gpu_block: list[int]
    owned: list[bool]
    retained: list[bool]
    key: list[int]
    cpu_block: list[int]
    cpu_free: list[bool]

    @classmethod
    def of(cls, layout: Layout, facts: CandidateFacts) -> CandidateLists:
        return cls(layout.group.tolist(), layout.position.tolist(), facts.gpu_block.tolist(), facts.owned.tolist(),
                   facts.retained.tolist(), facts.key.tolist(), facts.cpu_block.tolist(), facts.cpu_free.tolist())


NO_CANDIDATES = CandidateLists([], [], [], [], [], [], [], [])


@dataclass
class ScanState:
    """The batch's effects so far, as the requests after see them."""

    free: int  # CPU free count: the start's, less earlier selections and pinned free entries
    batch_keys: dict[int, int] = field(default_factory=dict)  # key -> selections by earlier requests
    pinned: dict[int, int] = field(default_factory=dict)  # free CPU block -> first request that pinned it
    sensitive: dict[int, int] = field(default_factory=dict)  # key -> last request whose decisions read it


@dataclass
class RequestPlan:
    """One request's decisions, applied when its batch is committed (in this order)."""

    advance: list[int]  # cursor advance per group
    retire: list[int] = field(default_factory=list)  # covered keys that left a sliding window (R7 b)
    window_floors: dict[int, int] = field(default_factory=dict)  # sliding group -> positions retired
    owned: list[Position] = field(default_factory=list)  # positions passed or taken: indexed (R1) ...
    owned_keys: list[int] = field(default_factory=list)  # ... under these keys
    judged_cached: list[int] = field(default_factory=list)  # keys judged ALREADY_CACHED
    pins: list[int] = field(default_factory=list)  # their CPU blocks, pinned for the step (R5)
    selected: list[int] = field(default_factory=list)  # GPU blocks to store
    selected_keys: list[int] = field(default_factory=list)  # their keys


class BatchScanner:
    def __init__(self, host: SchedulerFacade, index: LossIndex, in_flight: InFlightKeys,
                 ownership: Ownership) -> None:
        self.host = host
        self.index = index
        self.in_flight = in_flight
        self.ownership = ownership
        self._windows = int_tensor(ownership.windows, host.device)

    def facts(self, slots: torch.Tensor, requests: list[Any], layout: Layout, blocks: torch.Tensor) -> CandidateFacts:
        """The facts of every candidate: ``slots[i]``/``requests[i]`` are candidate i's request's
        slot and request object by batch index (``layout.request``), ``blocks`` its GPU block.
        O(candidates)."""
        host = self.host
        G = host.config.num_groups
        hid = host.stores.hash_ids_at(slots[layout.request], layout.position)
        want = torch.where(hid >= 0, hid * G + layout.group, -2)
        gpu = host.gpu_pool
        block_key = gpu.key[blocks]
        carries = (blocks != 0) & (block_key == want)
        owned = carries & (gpu.ref[blocks] >= 1)
        if self.ownership.sliding_groups:
            confirmed = int_tensor([r.num_computed_tokens - r.num_output_placeholders for r in requests],
                                   host.device)
            w = self._windows[layout.group]
            owned &= (w == 0) | (layout.position >= window_floors(confirmed[layout.request], w,
                                                                  host.config.block_size))
        # R3: a retained copy, the table's block if it carries the key, else the prefix cache's
        kept = torch.where(carries, blocks, gpu.first_of(want.clamp(min=-1)))
        retained = ~owned & (kept > 0) & (gpu.ref[kept.clamp(min=0)] == 0)
        key = torch.where(owned | retained, want, -1)
        cpu = host.cpu_pool
        cpu.index.ensure(host.keys.key_capacity)
        cpu_block = cpu.index.first_known(key)
        cpu_free = (cpu_block >= 0) & (cpu.ref[cpu_block.clamp(min=0)] == 0)
        return CandidateFacts(torch.where(retained, kept, blocks), owned, retained, key, cpu_block, cpu_free)

    def plan(self, i: int, rid: str, slot: int, cursors: list[int] | None, cands: CandidateLists,
             lo: int, hi: int, state: ScanState) -> RequestPlan:
        """Request ``i`` of the batch, whose candidates are ``cands[lo:hi]``; ``cursors``: its
        cursors (read by sliding groups only). Updates ``state``. O(its candidates + positions
        that left a window)."""
        plan = RequestPlan([0] * self.host.config.num_groups)
        if self.ownership.sliding_groups:
            assert cursors is not None, "sliding groups need the request's cursors"
            self._plan_retirements(i, rid, slot, cursors, state, plan)
        self._plan_positions(i, rid, cands, lo, hi, state, plan)
        state.free -= len(plan.selected)
        for kid in plan.selected_keys:
            state.batch_keys[kid] = state.batch_keys.get(kid, 0) + 1
        return plan

    def _plan_retirements(self, i: int, rid: str, slot: int, cursors: list[int], state: ScanState,
                          plan: RequestPlan) -> None:
        """Sliding groups: keys at positions that left the window (below the cursor and the hashes)
        since the last scan retire when covered; the group's floor moves up."""
        host = self.host
        G, B = host.config.num_groups, host.config.block_size
        req = host.stores.request[slot]
        get_one = host.cpu_pool.index.get_one
        counts, batch_keys = self.in_flight.counts, state.batch_keys
        for g in self.ownership.sliding_groups:
            floor = min(window_floor(req.num_computed_tokens, req.num_output_placeholders,
                                     self.ownership.windows[g], B), cursors[g],
                        len(req.block_hashes))
            start = self.index.window_floor.get((rid, g), 0)
            if floor > start:
                hids = host.stores.sync_hids(slot)
                for p in range(start, floor):
                    kid = hids[p] * G + g
                    state.sensitive[kid] = i
                    if counts.get(kid, 0) + batch_keys.get(kid, 0) > 0 or get_one(kid) >= 0:
                        plan.retire.append(kid)
            plan.window_floors[g] = max(floor, start)

    def _plan_positions(self, i: int, rid: str, c: CandidateLists, lo: int, hi: int, state: ScanState,
                        plan: RequestPlan) -> None:
        """The positional scan of the request's candidates: ``rules.repair_step`` at each
        position, with the class by key (``rules.classify_store_candidate``; in flight when a live
        transfer or an earlier request of the batch carries the key)."""
        counts, batch_keys, pinned, sensitive = self.in_flight.counts, state.batch_keys, state.pinned, state.sensitive
        mine: set[int] = set()  # keys this request selected (a repeat of one is a duplicate)
        stopped = -1  # the group whose scan stopped: its later positions are left alone
        for j in range(lo, hi):
            g = c.group[j]
            if g == stopped:
                continue
            kid, cb = c.key[j], c.cpu_block[j]
            entry_free = False
            if c.owned[j] or c.retained[j]:
                sensitive[kid] = i
                busy = counts.get(kid, 0) + batch_keys.get(kid, 0) > 0
                kind = classify_store_candidate(False, True, busy, cb >= 0)  # not null, hashed
                if c.retained[j]:
                    kind = RETAINED if kind == READY else NOT_OWNED
                entry_free = kind == ALREADY_CACHED and c.cpu_free[j] and cb not in pinned
            else:
                kind = NOT_OWNED
            step = repair_step(kind, kid in mine, entry_free, len(plan.selected), state.free)
            if step == STOP:
                stopped = g
                continue
            plan.advance[g] += 1
            if step == PASS:
                continue
            if c.owned[j]:
                plan.owned.append((rid, g, c.position[j]))
                plan.owned_keys.append(kid)
            if step == PIN:
                plan.judged_cached.append(kid)
                plan.pins.append(cb)
                if entry_free:
                    pinned[cb] = i
                    state.free -= 1
            elif step == SELECT:
                plan.selected.append(c.gpu_block[j])
                plan.selected_keys.append(kid)
                mine.add(kid)
