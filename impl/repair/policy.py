"""The ``repair`` policy on the tensor scheduler: the pieces of ``kvspec.impl.repair`` tied together.

Same rules as the model's policy (R1-R9 in ``kvspec.model.repair``). A planning step:

1. preempted requests are dropped from the index (``LossIndex.drop_request``);
2. each segment of the step's requests is scanned in batches (``BatchScanner``): the usual
   batch is decided and committed whole with tensor ops (``Committer.commit_if_all_fit``),
   any other one request by request, cut where an allocation could change a later
   request's decision (``simulate_allocations``, ``Committer.commit``);
3. pending lost records still owned and uncovered are re-stored after the new work (R6),
   one per key, into victims chosen by R7 (``VictimChooser``);
4. the step's pins are released (``StepHolds``).

A finish flush scans the live table the same way, then re-stores the finishing request's
own records (R9). Evictions anywhere give live owners lost records (R1); completed stores
leave the in-flight key counts (``InFlightKeys``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, final

import torch

from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.impl.convert import int_tensor
from kvspec.impl.facade import ImplStorePolicy, SchedulerFacade
from kvspec.impl.planner import candidate_layout
from kvspec.impl.repair.commit import Committer, simulate_allocations
from kvspec.impl.repair.holds import StepHolds
from kvspec.impl.repair.in_flight import InFlightKeys
from kvspec.impl.repair.index import LossIndex, Position
from kvspec.impl.repair.ownership import Ownership
from kvspec.impl.repair.scan import NO_CANDIDATES, BatchScanner, CandidateLists, RequestPlan, ScanState
from kvspec.impl.repair.victims import VictimChooser
from kvspec.impl.segments import ScanBatch
from kvspec.impl.transfers import Evictions, StoreBatch


class Candidate(NamedTuple):
    """A pending record to re-store: its position, the GPU block the request owns there, its key."""

    position: Position
    gpu_id: int
    kid: int


class Restore(NamedTuple):
    """One planned re-store: the request it serves, the GPU block copied, the CPU victim."""

    rid: str
    gpu_id: int
    cpu_id: int


class Finishing(NamedTuple):
    """The request whose finish flush is running, and its live block table."""

    rid: str
    block_ids: list[list[int]]


@final  # mypy then reports any StorePolicy member left unimplemented
class RepairPolicy(ImplStorePolicy):
    name = "repair"

    def __init__(self, host: SchedulerFacade) -> None:
        self.host = host
        self.index = LossIndex()
        self.in_flight_keys = InFlightKeys(host.keys, host.device)
        self.ownership = Ownership(host, self.index, self.in_flight_keys)
        self.holds = StepHolds(host.cpu_pool, host.device)
        self.scanner = BatchScanner(host, self.index, self.in_flight_keys, self.ownership)
        self.committer = Committer(host, self.index, self.in_flight_keys, self.ownership, self.holds,
                                   self.record_losses)
        self.victims = VictimChooser(host, self.index, self.in_flight_keys, self.ownership, self.holds)
        self.restores_last_plan = 0
        self.lost_keys_at_repair = 0
        self.self_evictions = 0
        self.useful_evicted_by_restores = 0

    # -- planning ------------------------------------------------------------------------------------

    def plan_eager(self, out: SchedulerOutput, batch: StoreBatch) -> None:
        segments = self.host.scheduled_segments(out)  # the preemption reset runs first
        self.restores_last_plan = 0
        for rid in out.preempted_req_ids:
            self.index.drop_request(rid, self.ownership.covered)
        for scan in segments:
            while scan.slots:
                cut = self._scan_batch(scan, batch)
                scan = ScanBatch(scan.rids[cut:], scan.slots[cut:])
        wanted = self.repair_candidates(None)
        self.lost_keys_at_repair = len({c.kid for c in wanted})
        done = self._restore(wanted)
        if done:
            batch.req_ids.extend(r.rid for r in done)
            batch.add(int_tensor([r.gpu_id for r in done], self.host.device),
                      int_tensor([r.cpu_id for r in done], self.host.device))
        self.restores_last_plan = len(done)
        self.holds.release()
        batch.req_ids = list(dict.fromkeys(batch.req_ids))

    def _scan_batch(self, scan: ScanBatch, step: StoreBatch) -> int:
        """Scan requests (distinct slots) in vLLM's order; commit a prefix; return its length."""
        host = self.host
        st = host.stores
        k = len(scan.slots)
        slots, requests = host.batch_requests(scan.slots)
        cur = st.cursor[slots]
        sliding = bool(self.ownership.sliding_groups)
        layout = candidate_layout(cur, host.ready_blocks(requests, st.length[slots]), False)
        if layout is None and not sliding:
            return k  # nothing to scan or retire
        cands, counts = NO_CANDIDATES, [0] * k
        if layout is not None:
            blocks = st.table[slots[layout.request], layout.group, layout.position]
            facts = self.scanner.facts(slots, requests, layout, blocks)
            if not sliding and self.committer.commit_if_all_fit(scan, slots, layout, facts, step):
                return k
            cands, counts = CandidateLists.of(layout, facts), torch.bincount(layout.request, minlength=k).tolist()
        cursors = cur.tolist() if sliding else None
        state = ScanState(host.cpu_pool.free.count)
        plans: list[RequestPlan | None] = []
        lo = 0
        for i in range(k):
            if not counts[i] and not sliding:
                plans.append(None)  # nothing to scan, retire or record
                continue
            plans.append(self.scanner.plan(i, scan.rids[i], scan.slots[i], cursors[i] if cursors else None,
                                           cands, lo, lo + counts[i], state))
            lo += counts[i]
        cut = simulate_allocations(plans, state, host.cpu_pool)
        self.committer.commit(scan, plans[: cut.cut], cut, step)
        return cut.cut

    # -- R1: records ---------------------------------------------------------------------------------

    def record_losses(self, kids: list[int], firsts: list[int]) -> None:
        """Evicted keys (in order) and each key's first remaining CPU block after the eviction:
        self-evictions are counted, keys cached nowhere leave the retired list and give their live
        owners lost records."""
        judged = self.holds.judged_cached
        if judged:
            self.self_evictions += sum(1 for k in kids if k in judged)
        gone = [kid for kid, f in zip(kids, firsts, strict=True) if f < 0]  # cached nowhere on the CPU now
        self.index.forget_retired(gone)
        owners = self.index.owners
        reads = self.ownership.reads(pos for kid in gone if kid in owners for pos in owners[kid])
        self.index.record_losses(gone, reads.is_live)

    # -- R6-R8: re-stores -----------------------------------------------------------------------------

    def repair_candidates(self, finishing: Finishing | None) -> list[Candidate]:
        """Pending records still owned and uncovered, one per key, in record order; drops the rest.
        ``finishing`` limits them to one request, read on its live table. O(records); the
        records' ownership and coverage are read in one batch (``Ownership.reads``)."""
        own = self.ownership
        stores = self.host.stores
        out: list[Candidate] = []
        keys: set[int] = set()
        records = list(self.index.lost.items())
        if finishing is not None:
            records = [(pos, kid) for pos, kid in records if pos[0] == finishing.rid]
            reads = own.reads((), [kid for _, kid in records])
        else:
            reads = own.reads([pos for pos, _ in records], [kid for _, kid in records])
        for pos, kid in records:
            rid, g, p = pos
            b = -1 if finishing is not None else reads.owned.get(pos, -1)
            if b == -1:  # the live table of a finishing request, or a position only the scalar path answers
                b = None
                slot = stores.slot_of.get(rid)
                if slot is not None and not stores.finished[slot] and p < own.cursor(slot, g):
                    if finishing is not None:
                        ids = finishing.block_ids[g]
                        raw = ids[p] if p < len(ids) else None
                    else:
                        raw = own.table_id(slot, g, p)
                    b = own.owned_block(slot, g, p, raw)
            if b is None or reads.covered(kid):
                del self.index.lost[pos]
                continue
            if kid not in keys:
                keys.add(kid)
                out.append(Candidate(pos, b, kid))
        return out

    def _restore(self, wanted: list[Candidate]) -> list[Restore]:
        """Take R7 victims for ``wanted`` (taking one evicts it like an allocation); mark the
        re-stores in flight. O(len(wanted) + the victim search)."""
        if not wanted:
            return []
        victims = self.victims.choose_victims(len(wanted))
        if not victims:
            return []
        host = self.host
        pool = host.cpu_pool
        vt = int_tensor(victims, host.device)
        victim_kids = pool.key[vt].tolist()
        reads = self.victims.reads_for(victim_kids)
        self.useful_evicted_by_restores += sum(1 for k in victim_kids if not self.victims.acceptable_victim(k, reads))
        taken = wanted[: len(victims)]
        pool.touch_t(vt)
        evicted = Evictions(*pool.evict_t(vt))
        if evicted.blocks.numel():
            self.on_cpu_evictions(evicted)
        for c in taken:
            self.index.lost.pop(c.position, None)
        self._mark_in_flight(int_tensor([c.gpu_id for c in taken], host.device))
        return [Restore(c.position[0], c.gpu_id, cb) for c, cb in zip(taken, victims, strict=True)]

    def _mark_in_flight(self, gpu: torch.Tensor) -> None:
        """R4: besides the GPU blocks, count the keys being stored."""
        self.host.mark_in_flight(gpu)
        self.in_flight_keys.add(self.host.gpu_pool.key[gpu])

    # -- R9: finish ------------------------------------------------------------------------------------

    def finish_flush(self, request: RequestView, block_ids: list[list[int]]) -> None:
        """The live table's new work first, then this request's pending records."""
        host = self.host
        rid = request.request_id
        selected = self._scan_live_table(rid, host.stores.slot_of[rid], block_ids)
        gpu = list(selected)
        cpu: list[int] = []
        if selected:
            gsel = int_tensor(selected, host.device)
            cpu = host.start_stores(gsel, None).tolist()
            self.in_flight_keys.add(host.gpu_pool.key[gsel])
        for r in self._restore(self.repair_candidates(Finishing(rid, block_ids))):
            gpu.append(r.gpu_id)
            cpu.append(r.cpu_id)
        self.holds.release()
        if gpu:
            host.queue_flush(int_tensor(gpu, host.device), int_tensor(cpu, host.device))

    def _scan_live_table(self, rid: str, slot: int, block_ids: list[list[int]]) -> list[int]:
        """The scan of ``[cursor, ready)`` over the live table, applied at once (owners, pins,
        retirements); the GPU blocks selected. Cursors do not move."""
        host = self.host
        found = host.flush_candidates(slot, block_ids)
        cands = NO_CANDIDATES
        if found is not None:
            slots = torch.full((1,), slot, dtype=torch.int64, device=host.device)
            facts = self.scanner.facts(slots, [host.stores.request[slot]], found.layout, found.blocks)
            cands = CandidateLists.of(found.layout, facts)
        cursors = host.stores.cursor[slot].tolist() if self.ownership.sliding_groups else None
        state = ScanState(host.cpu_pool.free.count)
        plan = self.scanner.plan(0, rid, slot, cursors, cands, 0, len(cands.gpu_block), state)
        self.committer.apply_records(rid, plan)
        self.holds.pin(plan.pins)
        return plan.selected

    # -- the StorePolicy hooks -------------------------------------------------------------------------

    def on_cpu_evictions(self, evicted: Evictions) -> None:
        self.record_losses(evicted.kids.tolist(), self.host.cpu_pool.first_of(evicted.kids).tolist())

    def on_store_completed(self, completed: torch.Tensor) -> None:
        self.in_flight_keys.complete(completed)

    def on_request_finished(self, rid: str) -> None:
        self.index.drop_request(rid, self.ownership.covered)

    def on_reset(self) -> None:
        self.index.clear()
        self.in_flight_keys.clear()

    def snapshot(self) -> dict[str, Any]:
        keys = self.host.keys
        return {
            "lost": sorted([rid, g, p] for rid, g, p in self.index.lost),
            "in_flight_keys": sorted(keys.key_text(k) for k in self.in_flight_keys),
            "restores_last_plan": self.restores_last_plan,
            "lost_keys_at_repair": self.lost_keys_at_repair,
            "self_evictions": self.self_evictions,
            "useful_evicted_by_restores": self.useful_evicted_by_restores,
        }

    def _check(self) -> None:
        """The index's and the in-flight mirror's invariants; between operations nothing is
        pinned for a step and no cursor advance is pending. O(records + key ids)."""
        self.index._check(self.host.config.num_groups)
        self.in_flight_keys._check()
        assert not self.holds.held and not self.holds.judged_cached, "step pins outlived their step"
        assert not self.ownership.pending_advance, "cursor advances left unwritten"
