"""The commit of a scanned batch (``kvspec.impl.repair.scan``): how much of it, and applying it.

A batch's requests were decided against the state at its start, with its own effects
tracked. What the decisions did not see are the CPU allocations: popping the LRU head
may evict an entry that a later request of the batch judged cached or pinned, or a key
it read. ``simulate_allocations`` replays the allocations on a peek of the free list; the
first request whose allocation could change a later request's decision ends the batch
(``cut``), and the rest is scanned again against the new state. ``Committer.commit`` then
applies the prefix: one pin, one allocation and one in-flight marking for all of it, and
its bookkeeping (retirements, window floors, owners, judged keys, loss records of what
its allocation evicted, cursor advances) request by request, in order.

The usual batch needs none of that: when every scan runs to its end and the allocation
can change no decision of the batch (it pops no block the batch pins, no key the batch
reads, no key twice), ``Committer.commit_if_all_fit`` decides it with tensor ops and
commits it whole; only owner registration is a Python pass. Not for sliding groups
(their retirements are per request), nor for a batch with a retained copy (R3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvspec.impl.block_pool import TensorBlockPool
from kvspec.impl.convert import int_tensor
from kvspec.impl.facade import SchedulerFacade
from kvspec.impl.planner import Layout
from kvspec.impl.repair.holds import StepHolds
from kvspec.impl.repair.in_flight import InFlightKeys
from kvspec.impl.repair.index import LossIndex
from kvspec.impl.repair.ownership import Ownership
from kvspec.impl.repair.scan import CandidateFacts, RequestPlan, ScanState
from kvspec.impl.segments import ScanBatch
from kvspec.impl.transfers import StoreBatch

RecordLosses = Callable[[list[int], list[int]], None]  # (evicted keys, each key's first CPU block left)


@dataclass
class AllocationCut:
    """How many requests to commit, and per request the (block, key) pairs its allocation pops."""

    cut: int
    popped_blocks: list[list[int]]
    popped_keys: list[list[int]]


class AllFit(NamedTuple):
    """The all-fit decision of a batch."""

    selected: torch.Tensor  # candidate indices selected (the first candidate of each READY key)
    cached: torch.Tensor  # bool per candidate: ALREADY_CACHED
    pins: torch.Tensor  # the CPU blocks of those, in order


def simulate_allocations(plans: list[RequestPlan | None], state: ScanState, cpu_pool: TensorBlockPool) -> AllocationCut:
    """Replay the batch's allocations on a peek of the CPU free list's head. Request i's
    allocation ends the batch after it when it pops a block a later request pins, a key a
    later request read, or a key an earlier allocation evicted too. O(blocks popped)."""
    k = len(plans)
    total = sum(len(plan.selected) for plan in plans if plan is not None)
    if not total:
        return AllocationCut(k, [[] for _ in range(k)], [[] for _ in range(k)])
    peek = cpu_pool.free.peek_head(total + len(state.pinned))
    return _replay(plans, state, peek.tolist(), cpu_pool.key[peek].tolist())


def _replay(plans: list[RequestPlan | None], state: ScanState, peek_blocks: list[int],
            peek_keys: list[int]) -> AllocationCut:
    k = len(plans)
    cut = k
    popped_blocks: list[list[int]] = [[] for _ in range(k)]
    popped_keys: list[list[int]] = [[] for _ in range(k)]
    ptr = 0
    removed: set[int] = set()  # pinned free blocks, out of the queue from the request that pins them
    evicted_at: dict[int, int] = {}  # key -> first request whose allocation evicted it
    for i, plan in enumerate(plans):
        if plan is None:
            continue
        removed.update(c for c in plan.pins if state.pinned.get(c) == i)
        need = len(plan.selected)
        while need:
            b, kid = peek_blocks[ptr], peek_keys[ptr]
            ptr += 1
            if b in removed:
                continue
            need -= 1
            popped_blocks[i].append(b)
            popped_keys[i].append(kid)
            if state.pinned.get(b, -1) > i:
                cut = min(cut, i + 1)
            if kid >= 0:
                if state.sensitive.get(kid, -1) > i:
                    cut = min(cut, i + 1)
                if kid in evicted_at:
                    cut = min(cut, evicted_at[kid] + 1)
                evicted_at.setdefault(kid, i)
        if cut <= i + 1 and cut < k:
            break
    return AllocationCut(cut, popped_blocks, popped_keys)


class Committer:
    def __init__(self, host: SchedulerFacade, index: LossIndex, in_flight: InFlightKeys, ownership: Ownership,
                 holds: StepHolds, record_losses: RecordLosses) -> None:
        self.host = host
        self.index = index
        self.in_flight = in_flight
        self.ownership = ownership
        self.holds = holds
        self.record_losses = record_losses

    # -- the request-by-request commit ---------------------------------------------------------------

    def commit(self, batch: ScanBatch, plans: list[RequestPlan | None], cut: AllocationCut,
               step: StoreBatch) -> None:
        """Apply the first ``cut.cut`` plans (``plans`` is that prefix). O(their decisions)."""
        decided = [(i, plan) for i, plan in enumerate(plans) if plan is not None]
        self.holds.pin([c for _, plan in decided for c in plan.pins])
        selected = [b for _, plan in decided for b in plan.selected]
        first_left: dict[int, int] = {}
        if selected:
            first_left = self._allocate(selected, cut, step)
        for i, plan in decided:
            rid, slot = batch.rids[i], batch.slots[i]
            self.apply_records(rid, plan)
            if plan.selected:
                step.req_ids.append(rid)
                evicted = [kid for kid in cut.popped_keys[i] if kid >= 0]
                if evicted:
                    self.record_losses(evicted, [first_left[kid] for kid in evicted])
            if any(plan.advance):
                self.ownership.pending_advance[slot] = plan.advance
        self.in_flight.add(int_tensor([kid for _, plan in decided for kid in plan.selected_keys], self.host.device))
        self._write_advances()

    def _allocate(self, selected: list[int], cut: AllocationCut, step: StoreBatch) -> dict[int, int]:
        """One allocation for the prefix's selections (it pops what the simulation said), marked in
        flight; each evicted key's first CPU block left afterwards."""
        host = self.host
        cpu, _, evicted = host.cpu_pool.alloc(len(selected))
        assert cpu.tolist() == [b for i in range(cut.cut) for b in cut.popped_blocks[i]], "allocation simulation"
        first_left: dict[int, int] = {}
        if evicted.numel():
            first_left = dict(zip(evicted.tolist(), host.cpu_pool.first_of(evicted).tolist(), strict=True))
        gsel = int_tensor(selected, host.device)
        host.mark_in_flight(gsel)
        step.add(gsel, cpu)
        return first_left

    def apply_records(self, rid: str, plan: RequestPlan) -> None:
        """A plan's bookkeeping: retirements, window floors, owners, judged keys."""
        for kid in plan.retire:
            self.index.retire(kid)
        for g, floor in plan.window_floors.items():
            self.index.window_floor[(rid, g)] = floor
        self.index.register_all(plan.owned_keys, plan.owned)
        self.holds.judged_cached.update(plan.judged_cached)

    def _write_advances(self) -> None:
        """The batch's cursor advances, into the store table in one scatter."""
        adv = self.ownership.pending_advance
        if not adv:
            return
        dev, G = self.host.device, self.host.config.num_groups
        idx = int_tensor(list(adv), dev)
        flat = int_tensor([a for v in adv.values() for a in v], dev)
        self.host.stores.cursor.index_put_((idx,), flat.view(-1, G), accumulate=True)
        adv.clear()

    # -- the all-fit batch ---------------------------------------------------------------------------

    def commit_if_all_fit(self, batch: ScanBatch, slots: torch.Tensor, layout: Layout, facts: CandidateFacts,
                          step: StoreBatch) -> bool:
        """Decide and commit the whole batch with tensor ops when it all fits (module docstring);
        False (nothing changed) sends it to the request-by-request pass."""
        fit = self._decide_all_fit(facts)
        if fit is None:
            return False
        self._commit_all_fit(batch, slots, layout, facts, fit, step)
        return True

    def _decide_all_fit(self, facts: CandidateFacts) -> AllFit | None:
        """Every owned candidate is in flight (a key in flight, or selected earlier in the batch),
        already cached or selected, if the selections and the free entries pinned fit the free
        count and the allocation touches nothing the batch read. A batch with a retained copy
        (R3) goes to the request-by-request pass."""
        if bool(facts.retained.any()):
            return None
        owned, key, cpu_block = facts.owned, facts.key, facts.cpu_block
        rest = owned
        if self.in_flight:
            rest = owned & (self.in_flight.per_key()[key.clamp(min=0)] == 0)
        cached = rest & (cpu_block >= 0)
        selected = _first_of_each_key((rest & (cpu_block < 0)).nonzero().flatten(), key)
        pins = cpu_block[cached]
        free_pins = torch.unique(pins[facts.cpu_free[cached]])
        n_sel = selected.numel()
        pool = self.host.cpu_pool
        if n_sel + free_pins.numel() > pool.free.count:
            return None
        if n_sel:
            popped = pool.free.peek_head(n_sel)
            pk = pool.key[popped]
            pk = pk[pk >= 0]
            if (bool(torch.isin(popped, free_pins).any()) or bool(torch.isin(pk, key[owned]).any())
                    or torch.unique(pk).numel() < pk.numel()):
                return None
        return AllFit(selected, cached, pins)

    def _commit_all_fit(self, batch: ScanBatch, slots: torch.Tensor, layout: Layout, facts: CandidateFacts,
                        fit: AllFit, step: StoreBatch) -> None:
        host = self.host
        self.holds.pin_tensor(fit.pins)
        evicted = fit.pins[:0]
        if fit.selected.numel():
            gsel = facts.gpu_block[fit.selected]
            cpu, _, evicted = host.cpu_pool.alloc(fit.selected.numel())
            host.mark_in_flight(gsel)
            step.add(gsel, cpu)
            served = torch.unique_consecutive(layout.request[fit.selected]).tolist()
            step.req_ids.extend(map(batch.rids.__getitem__, served))
        oi = facts.owned.nonzero().flatten()
        positions = zip(map(batch.rids.__getitem__, layout.request[oi].tolist()), layout.group[oi].tolist(),
                        layout.position[oi].tolist(), strict=True)
        self.index.register_all(facts.key[oi].tolist(), positions)
        self.holds.judged_cached.update(facts.key[fit.cached].tolist())
        self.in_flight.add(facts.key[fit.selected])
        assert layout.new_counts is not None, "the layout without a rescan counts each range (new_counts)"
        host.stores.cursor.index_put_((slots,), layout.new_counts, accumulate=True)
        if evicted.numel():
            self.record_losses(evicted.tolist(), host.cpu_pool.first_of(evicted).tolist())


def _first_of_each_key(idx: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The candidates of ``idx`` that are the first of their key (later ones see it in flight)."""
    if idx.numel() <= 1:
        return idx
    uk, inv = torch.unique(key[idx], return_inverse=True)
    if uk.numel() == idx.numel():
        return idx
    at = torch.arange(idx.numel(), device=idx.device)
    first = torch.full_like(uk, idx.numel()).scatter_reduce_(0, inv, at, reduce="amin")
    return idx[first[inv] == at]
