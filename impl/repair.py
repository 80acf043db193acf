"""The ``repair`` policy on the tensor scheduler: exact records of what the CPU lost.

Same rules as the model's policy (R1-R9 in ``kvspec.model.repair``): positions a
cursor passed whose block the request owns are indexed by key (``owners``); an
eviction of a key no longer cached anywhere on the CPU gives every live owner a *lost
record*; planning re-stores pending records after the new work, taking CPU blocks
from the LRU head but refreshing (never evicting) live entries whose parent is still
reachable; keys already cached are pinned for the rest of the step; dedup is by key.

How it is computed here:

* a batch of scheduled requests gathers, in one round of tensor ops, everything a
  position's decision needs (its block, the block's key and ref count, the request's
  own key for the position, the CPU entry of that key and whether it is free);
* when every scan of the batch runs to its end and the allocation can change no
  decision of the batch (the usual step), the decisions are tensor ops too and the
  batch is committed whole; only owner registration is a Python pass;
* otherwise a Python pass over the gathered lists applies the per-position rules
  request by request (the CPU free count, which pins lower, and the request's key set
  change as it goes) and the pins and allocations are applied as batches;
* requests with nothing in ``[cursor, ready)`` are skipped without any per-request
  work (one gather for the whole step finds them);
* the victim walk of a re-store reads the CPU free list in slices and the owner index
  only for keys that have owners.

Owners, lost records and in-flight key counts are dicts keyed by interned key ids,
in the model's insertion order (their order decides which record is made first).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from kvspec.contract.types import RequestView, SchedulerOutput
from kvspec.impl.convert import int_tensor
from kvspec.impl.planner import Layout, layout
from kvspec.impl.policies import BaselinePolicy
from kvspec.model.rules import window_floor

if TYPE_CHECKING:
    from kvspec.impl.scheduler import StepBatch, TensorOffloadScheduler

Position = tuple[str, int, int]
# One request's decisions in _scan_batch: (retire, floors, regs, judged, pins, selected, sel_keys, advance)
_Plan = tuple[list[int], list[tuple[int, int]], list[tuple[int, int, int]], list[int], list[int], list[int],
              list[int], list[int]]


class RepairPolicy(BaselinePolicy):
    name = "repair"

    def __init__(self, sched: TensorOffloadScheduler) -> None:
        super().__init__(sched)
        self.owners: dict[int, dict[Position, None]] = {}
        self.lost: dict[Position, int] = {}
        self.in_flight_keys: dict[int, int] = {}
        self._ifk_t = torch.zeros(0, dtype=torch.int64, device=sched.device)  # in_flight_keys, per key id
        self.held: list[int] = []
        self.restores_last_plan = 0
        self.lost_keys_at_repair = 0
        self.judged_cached: set[int] = set()
        self.self_evictions = 0
        self.useful_evicted_by_restores = 0
        self.owned_keys: dict[str, list[int]] = {}
        self.window_floor: dict[tuple[str, int], int] = {}
        self.retired: OrderedDict[int, None] = OrderedDict()
        self.windows = [(g.sliding_window if g.kind == "sliding" else 0) for g in sched.config.groups]
        self.sliding_groups = [g for g, w in enumerate(self.windows) if w]
        self._adv: dict[int, list[int]] = {}  # cursor advances of the batch being committed

    # -- ownership -------------------------------------------------------------------------------

    def _owned(self, slot: int, g: int, p: int, b: int | None) -> int | None:
        """``b`` (the request's id at (g, p)) if the request owns it there, else None."""
        s = self.s
        if b is None:
            return None
        req = s.stores.request[slot]
        if p >= len(req.block_hashes):
            return None
        w = self.windows[g]
        if w and p < window_floor(req.num_computed_tokens, w, s.B):
            return None
        if b == 0:
            return None
        hids = s.stores.sync_hids(slot)
        if int(s.gpu_pool.key[b]) != hids[p] * s.G + g or int(s.gpu_pool.ref[b]) < 1:
            return None
        return b

    def _cursor(self, slot: int, g: int) -> int:
        """The slot's cursor, including advances of this batch not yet written to the tensor."""
        adv = self._adv.get(slot)
        return int(self.s.stores.cursor[slot, g]) + (adv[g] if adv is not None else 0)

    def _table_id(self, slot: int, g: int, p: int) -> int | None:
        st = self.s.stores
        if p >= int(st.length[slot, g]):
            return None
        return int(st.table[slot, g, p])

    def _is_live(self, kid: int) -> bool:
        owners = self.owners.get(kid)
        if not owners:
            return False
        st = self.s.stores
        for pos in list(owners):
            rid, g, p = pos
            slot = st.slot_of.get(rid)
            if (slot is None or st.finished[slot] or p >= self._cursor(slot, g)
                    or self._owned(slot, g, p, self._table_id(slot, g, p)) is None):
                del owners[pos]
        if not owners:
            del self.owners[kid]
        return bool(owners)

    def _covered(self, kid: int) -> bool:
        return self.in_flight_keys.get(kid, 0) > 0 or self.s.cpu_pool.index.get_one(kid) >= 0

    def _ifk_tensor(self) -> torch.Tensor:
        """``in_flight_keys`` as a count per key id (kept in step with the dict)."""
        cap = self.s.keys.key_capacity
        t = self._ifk_t
        if t.numel() < cap:
            grown = torch.zeros(max(cap, 2 * t.numel(), 64), dtype=torch.int64, device=t.device)
            grown[: t.numel()] = t
            self._ifk_t = t = grown
        return t

    def _ifk_add(self, kids: torch.Tensor, keyed: bool = False) -> None:
        """The tensor side of ``in_flight_keys[k] += 1`` for each k of ``kids`` (repeats count);
        ``keyed``: no -1 among them."""
        if not keyed:
            kids = kids[kids >= 0]
        if kids.numel():
            self._ifk_tensor().index_put_((kids,), torch.ones_like(kids), accumulate=True)

    def on_evictions(self, blocks: torch.Tensor, kids: torch.Tensor) -> None:
        self._record_evictions(kids.tolist(), self.s.cpu_pool.first_of(kids).tolist())

    def _record_evictions(self, kl: list[int], firsts: list[int]) -> None:
        """Evicted keys (in order) and each key's first remaining CPU block after the allocation."""
        judged = self.judged_cached
        if judged:
            self.self_evictions += sum(1 for k in kl if k in judged)
        owners, retired = self.owners, self.retired
        gone = [kid for kid, f in zip(kl, firsts, strict=True) if f < 0]  # cached nowhere on the CPU now
        if retired:
            for kid in retired.keys() & set(gone):
                del retired[kid]
        for kid in [kid for kid in gone if kid in owners]:
            if self._is_live(kid):
                for pos in owners[kid]:
                    self.lost.setdefault(pos, kid)

    def _drop_request(self, rid: str) -> None:
        """The request owns nothing any more: drop its records, retire its keys."""
        for pos in [p for p in self.lost if p[0] == rid]:
            del self.lost[pos]
        for kid in self.owned_keys.pop(rid, []):
            self._retire(kid)
        for rg in [rg for rg in self.window_floor if rg[0] == rid]:
            del self.window_floor[rg]

    def _retire(self, kid: int) -> None:
        if self._covered(kid):  # cached, or cached when its store completes
            self.retired[kid] = None

    def _retire_out_of_window(self, rid: str, slot: int, g: int) -> None:
        w = self.windows[g]
        if not w:
            return
        s = self.s
        req = s.stores.request[slot]
        floor = window_floor(req.num_computed_tokens, w, s.B)
        floor = min(floor, int(s.stores.cursor[slot, g]), len(req.block_hashes))
        start = self.window_floor.get((rid, g), 0)
        if floor > start:
            hids = s.stores.sync_hids(slot)
            for p in range(start, floor):
                self._retire(hids[p] * s.G + g)
        self.window_floor[(rid, g)] = max(floor, start)

    # -- the scan ---------------------------------------------------------------------------------

    def _select(self, rid: str, slot: int, live: list[list[int]] | None) -> tuple[list[int], list[int]]:
        """Scan ``[cursor, ready)`` of every group (accumulated ids, or the live table)."""
        s = self.s
        st = s.stores
        req = st.request[slot]
        conf = max(0, req.num_computed_tokens - req.num_output_placeholders) // s.B
        cursors = st.cursor[slot].tolist()
        if live is None:
            lengths = st.length[slot].tolist()
        else:
            lengths = [len(x) for x in live]
        for g in self.sliding_groups:
            self._retire_out_of_window(rid, slot, g)
        spans = [(g, cursors[g], min(lengths[g], conf)) for g in range(s.G)]
        spans = [(g, a, r) for g, a, r in spans if a < r]
        advance = [0] * s.G
        if not spans:
            return [], advance
        if live is None:
            top = max(r for _, _, r in spans)
            rows = st.table[slot, :, :top].tolist()
        else:
            rows = live
        cg: list[int] = []
        cp: list[int] = []
        cb: list[int] = []
        for g, a, r in spans:
            cg.extend([g] * (r - a))
            cp.extend(range(a, r))
            cb.extend(rows[g][a:r])
        hids = st.sync_hids(slot)
        nh = len(hids)
        G = s.G
        want = [hids[p] * G + g if p < nh else -2 for g, p in zip(cg, cp, strict=True)]
        for i, (g, p) in enumerate(zip(cg, cp, strict=True)):
            w = self.windows[g]
            if w and p < window_floor(req.num_computed_tokens, w, s.B):
                want[i] = -2
        bt = int_tensor(cb, s.device)
        gkey = s.gpu_pool.key[bt]
        owned = (bt != 0) & (gkey == int_tensor(want, s.device)) & (s.gpu_pool.ref[bt] >= 1)
        okey = torch.where(owned, gkey, -1)
        cblock = s.cpu_pool.first_of(okey)
        cfree = (cblock >= 0) & (s.cpu_pool.ref[cblock.clamp(min=0)] == 0)
        owned_l, okey_l, cblock_l, cfree_l = owned.tolist(), okey.tolist(), cblock.tolist(), cfree.tolist()

        free_now = s.cpu_pool.free.count
        selected: list[int] = []
        keys: set[int] = set()
        pins: list[int] = []
        pinned_free: set[int] = set()
        ifk = self.in_flight_keys
        owners = self.owners
        owned_keys = self.owned_keys.setdefault(rid, [])
        i = 0
        n = len(cg)
        while i < n:
            g = cg[i]
            while i < n and cg[i] == g:
                if not owned_l[i]:
                    advance[g] += 1
                    i += 1
                    continue
                kid = okey_l[i]
                if ifk.get(kid, 0) > 0 or kid in keys:
                    kind = 1  # in flight
                elif cblock_l[i] >= 0:
                    kind = 2  # already cached
                    c = cblock_l[i]
                    if cfree_l[i] and c not in pinned_free and free_now - 1 < len(selected):
                        break  # pinning it would starve this step's selection
                else:
                    kind = 3  # ready
                    if len(selected) >= free_now:
                        break
                advance[g] += 1
                pos = (rid, g, cp[i])
                own = owners.setdefault(kid, {})
                if pos not in own:
                    own[pos] = None
                    owned_keys.append(kid)
                if kind == 2:
                    self.judged_cached.add(kid)
                    pins.append(c)
                    if cfree_l[i] and c not in pinned_free:
                        pinned_free.add(c)
                        free_now -= 1
                elif kind == 3:
                    selected.append(cb[i])
                    keys.add(kid)
                i += 1
            while i < n and cg[i] == g:  # rest of a group the scan left
                i += 1
        if pins:
            s.cpu_pool.touch_t(int_tensor(pins, s.device))
            self.held.extend(pins)
        return selected, advance

    # -- planning --------------------------------------------------------------------------------

    def _scan_batch(self, rids: list[str], slots: list[int], batch: StepBatch) -> int:
        """Scan requests (distinct slots) in vLLM's order; commit a prefix; return its length.

        One gather gives every candidate position's facts; a Python pass then applies the
        per-position rules request after request, with this batch's own effects (free count,
        pins, keys put in flight) tracked locally. Allocations are then simulated on a peek
        of the CPU free list: the first request whose allocation would evict a key that a
        later request read, or a block that a later request pins, ends the batch there (the
        rest is scanned again against the new state). The prefix is committed with one
        pin, one allocation and one in-flight marking, and its bookkeeping (retirements,
        owners, loss records, cursors) is applied request by request, in order.
        """
        s = self.s
        st = s.stores
        G, B = s.G, s.B
        k = len(slots)
        dev = s.device
        sl, reqs = s.batch_requests(slots)
        cur = st.cursor[sl]
        ready = s._ready(reqs, st.length[sl])
        cur_l = cur.tolist() if self.sliding_groups else []
        lay = layout(cur, ready, False)
        if lay is None and not self.sliding_groups:
            return k  # nothing to scan or retire
        counts = [0] * k
        if lay is not None:
            occ, g_t, p_t = lay[0], lay[1], lay[2]
            sl_occ = sl[occ]
            gid = st.table[sl_occ, g_t, p_t]
            hid = st.hash_ids_at(sl_occ, p_t)
            want = torch.where(hid >= 0, hid * G + g_t, -2)
            gkey = s.gpu_pool.key[gid]
            owned = (gid != 0) & (gkey == want) & (s.gpu_pool.ref[gid] >= 1)
            if self.sliding_groups:
                comp = int_tensor([r.num_computed_tokens for r in reqs], dev)
                w = int_tensor(self.windows, dev)[g_t]
                # rules.window_floor, batched (the conformance harness holds the result to the model)
                floor = torch.div((comp[occ] - w + 1).clamp(min=0), B, rounding_mode="floor")
                owned &= (w == 0) | (p_t >= floor)
            okey = torch.where(owned, gkey, -1)
            s.cpu_pool.index.ensure(s.keys.key_capacity)
            cblock = s.cpu_pool.index.first_known(okey)
            cfree = (cblock >= 0) & (s.cpu_pool.ref[cblock.clamp(min=0)] == 0)
            if not self.sliding_groups and self._commit_if_all_fit(
                    rids, sl, lay, (gid, owned, okey, cblock, cfree), batch):
                return k
            counts = torch.bincount(occ, minlength=k).tolist()
            g_l, p_l, gid_l = g_t.tolist(), p_t.tolist(), gid.tolist()
            owned_l, okey_l, cblock_l, cfree_l = owned.tolist(), okey.tolist(), cblock.tolist(), cfree.tolist()

        ifk = self.in_flight_keys
        ifk_batch: dict[int, int] = {}
        pinned: dict[int, int] = {}  # free CPU block -> the request that pinned it first
        free_now = s.cpu_pool.free.count
        plans: list[_Plan | None] = []
        sensitive: dict[int, int] = {}  # key -> last request whose decisions read it
        i0 = 0
        for i in range(k):
            if not counts[i] and not self.sliding_groups:
                plans.append(None)  # nothing to scan, retire or record
                continue
            rid, slot = rids[i], slots[i]
            retire: list[int] = []
            floors: list[tuple[int, int]] = []
            for g in self.sliding_groups:
                req = reqs[i]
                fl = window_floor(req.num_computed_tokens, self.windows[g], B)
                fl = min(fl, cur_l[i][g], len(req.block_hashes))
                start = self.window_floor.get((rid, g), 0)
                if fl > start:
                    hids = st.hids[slot]
                    for p in range(start, fl):
                        kid = hids[p] * G + g
                        sensitive[kid] = i
                        if ifk.get(kid, 0) + ifk_batch.get(kid, 0) > 0 or s.cpu_pool.index.get_one(kid) >= 0:
                            retire.append(kid)
                floors.append((g, max(fl, start)))
            selected: list[int] = []
            sel_keys: list[int] = []
            keys: set[int] = set()
            pins: list[int] = []
            regs: list[tuple[int, int, int]] = []
            judged: list[int] = []
            advance = [0] * G
            j, end = i0, i0 + counts[i]
            while j < end:
                g = g_l[j]
                while j < end and g_l[j] == g:
                    if not owned_l[j]:
                        advance[g] += 1
                        j += 1
                        continue
                    kid = okey_l[j]
                    sensitive[kid] = i
                    c = cblock_l[j]
                    if ifk.get(kid, 0) + ifk_batch.get(kid, 0) > 0 or kid in keys:
                        kind = 1
                    elif c >= 0:
                        kind = 2
                        if cfree_l[j] and c not in pinned and free_now - 1 < len(selected):
                            break
                    else:
                        kind = 3
                        if len(selected) >= free_now:
                            break
                    advance[g] += 1
                    regs.append((kid, g, p_l[j]))
                    if kind == 2:
                        judged.append(kid)
                        pins.append(c)
                        if cfree_l[j] and c not in pinned:
                            pinned[c] = i
                            free_now -= 1
                    elif kind == 3:
                        selected.append(gid_l[j])
                        sel_keys.append(kid)
                        keys.add(kid)
                    j += 1
                while j < end and g_l[j] == g:
                    j += 1
            i0 = end
            free_now -= len(selected)
            for kid in sel_keys:
                ifk_batch[kid] = ifk_batch.get(kid, 0) + 1
            plans.append((retire, floors, regs, judged, pins, selected, sel_keys, advance))

        # -- simulate the allocations on the free list; find where the batch must end
        K_all = sum(len(pl[5]) for pl in plans if pl is not None)
        cut = k
        popped_by: list[list[tuple[int, int]]] = [[] for _ in range(k)]
        if K_all:
            peek = s.cpu_pool.free.peek_head(K_all + len(pinned))
            peek_b, peek_k = peek.tolist(), s.cpu_pool.key[peek].tolist()
            ptr = 0
            removed: set[int] = set()
            evicted_at: dict[int, int] = {}
            for i in range(k):
                pl = plans[i]
                if pl is None:
                    continue
                removed.update(c for c in pl[4] if pinned.get(c) == i)
                need = len(pl[5])
                while need:
                    b, kid = peek_b[ptr], peek_k[ptr]
                    ptr += 1
                    if b in removed:
                        continue
                    need -= 1
                    popped_by[i].append((b, kid))
                    if pinned.get(b, -1) > i:
                        cut = min(cut, i + 1)
                    if kid >= 0:
                        if sensitive.get(kid, -1) > i:
                            cut = min(cut, i + 1)
                        if kid in evicted_at:
                            cut = min(cut, evicted_at[kid] + 1)
                        evicted_at.setdefault(kid, i)
                if cut <= i + 1 and cut < k:
                    break
        plans = plans[:cut]

        # -- commit the first ``cut`` requests
        decided = [(i, pl) for i, pl in enumerate(plans) if pl is not None]
        pins_all = [c for _, pl in decided for c in pl[4]]
        if pins_all:
            s.cpu_pool.touch_t(int_tensor(pins_all, dev))
            self.held.extend(pins_all)
        sel_all = [b for _, pl in decided for b in pl[5]]
        ev_first: dict[int, int] = {}
        if sel_all:
            cpu, _, ev_k = s.cpu_pool.alloc(len(sel_all))
            assert cpu.tolist() == [b for i in range(cut) for b, _ in popped_by[i]], "allocation simulation"
            if ev_k.numel():
                ev_first = dict(zip(ev_k.tolist(), s.cpu_pool.first_of(ev_k).tolist(), strict=True))
            gsel = int_tensor(sel_all, dev)
            s.in_flight[gsel] = True
            s.gpu_pool.touch_t(gsel)
            batch.gpu.append(gsel)
            batch.cpu.append(cpu)
        owners, owned_keys = self.owners, self.owned_keys
        for i, (retire, floors, regs, judged, _pins, selected, sel_keys, advance) in decided:
            rid, slot = rids[i], slots[i]
            for kid in retire:
                self.retired[kid] = None
            for g, fl in floors:
                self.window_floor[(rid, g)] = fl
            mine = owned_keys.setdefault(rid, [])
            for kid, g, p in regs:
                own = owners.setdefault(kid, {})
                if (rid, g, p) not in own:
                    own[(rid, g, p)] = None
                    mine.append(kid)
            self.judged_cached.update(judged)
            for kid in sel_keys:
                ifk[kid] = ifk.get(kid, 0) + 1
            if selected:
                batch.req_ids.append(rid)
                ev = [kid for _, kid in popped_by[i] if kid >= 0]
                if ev:
                    self._record_evictions(ev, [ev_first[kid] for kid in ev])
            if any(advance):
                self._adv[slot] = advance
        sel_keys_all = [kid for _, pl in decided for kid in pl[6]]
        if sel_keys_all:
            self._ifk_add(int_tensor(sel_keys_all, dev))
        if self._adv:
            idx = int_tensor(list(self._adv), dev)
            s.stores.cursor.index_put_((idx,), int_tensor([a for v in self._adv.values() for a in v], dev)
                                       .view(-1, G), accumulate=True)
            self._adv.clear()
        return cut


    def _commit_if_all_fit(self, rids: list[str], sl: torch.Tensor, lay: Layout,
                           facts: tuple[torch.Tensor, ...], batch: StepBatch) -> bool:
        """The usual batch, decided with tensor ops and committed whole; False (nothing changed)
        sends the batch to the request-by-request pass.

        It applies when no scan stops early (the batch's selections plus the free CPU blocks it
        pins fit the free count) and the allocation can affect no decision of the batch (it
        pops no block the batch pins and no key the batch reads, and no key twice). Then every
        candidate is passed; owned ones are in flight (a key in flight, or selected earlier in
        the batch), already cached (pinned) or selected; evictions are recorded in pop order.
        No sliding groups (their retirements are per request).
        """
        s = self.s
        dev = s.device
        occ, g_t, p_t, n1 = lay[0], lay[1], lay[2], lay[5]
        assert n1 is not None, "the layout without a rescan counts each range (n1)"
        gid, owned, okey, cblock, cfree = facts
        rest = owned
        if self.in_flight_keys:
            rest = owned & (self._ifk_tensor()[okey.clamp(min=0)] == 0)
        cached = rest & (cblock >= 0)
        fi = (rest & (cblock < 0)).nonzero().flatten()
        if fi.numel() > 1:  # the first candidate of a key is selected; later ones see it in flight
            uk, inv = torch.unique(okey[fi], return_inverse=True)
            if uk.numel() < fi.numel():
                at = torch.arange(fi.numel(), device=dev)
                first = torch.full_like(uk, fi.numel()).scatter_reduce_(0, inv, at, reduce="amin")
                fi = fi[first[inv] == at]
        pins = cblock[cached]
        free_pins = torch.unique(pins[cfree[cached]])
        n_sel = fi.numel()
        if n_sel + free_pins.numel() > s.cpu_pool.free.count:
            return False
        if n_sel:
            popped = s.cpu_pool.free.peek_head(n_sel)
            pk = s.cpu_pool.key[popped]
            pk = pk[pk >= 0]
            if (bool(torch.isin(popped, free_pins).any()) or bool(torch.isin(pk, okey[owned]).any())
                    or torch.unique(pk).numel() < pk.numel()):
                return False
        if pins.numel():
            s.cpu_pool.touch_t(pins)
            self.held.extend(pins.tolist())
        ev_k = pins[:0]
        if n_sel:
            gsel = gid[fi]
            cpu, _, ev_k = s.cpu_pool.alloc(n_sel)
            s.in_flight[gsel] = True
            s.gpu_pool.touch_t(gsel)
            batch.gpu.append(gsel)
            batch.cpu.append(cpu)
            batch.req_ids.extend(map(rids.__getitem__, torch.unique_consecutive(occ[fi]).tolist()))
        oi = owned.nonzero().flatten()
        self._register(rids, okey[oi].tolist(), occ[oi].tolist(), g_t[oi].tolist(), p_t[oi].tolist())
        self.judged_cached.update(okey[cached].tolist())
        ifk = self.in_flight_keys
        sel_k = okey[fi]
        for kid in sel_k.tolist():
            ifk[kid] = ifk.get(kid, 0) + 1
        self._ifk_add(sel_k, keyed=True)
        s.stores.cursor.index_put_((sl,), n1, accumulate=True)
        if ev_k.numel():
            self._record_evictions(ev_k.tolist(), s.cpu_pool.first_of(ev_k).tolist())
        return True

    def _register(self, rids: list[str], kids: list[int], occ: list[int], gs: list[int], ps: list[int]) -> None:
        """Index positions (request ``rids[occ[i]]``, ``gs[i]``, ``ps[i]``) under ``kids[i]``, in order:
        new owner entries, and the request's key list for each entry it did not have."""
        owners, owned_keys = self.owners, self.owned_keys
        positions = zip(map(rids.__getitem__, occ), gs, ps, strict=True)
        for kid, pos in zip(kids, positions, strict=True):
            own = owners.get(kid)
            if own is None:
                owners[kid] = {pos: None}
            elif pos in own:
                continue
            else:
                own[pos] = None
            mine = owned_keys.get(pos[0])
            if mine is None:
                owned_keys[pos[0]] = [kid]
            else:
                mine.append(kid)

    def plan_eager(self, out: SchedulerOutput, batch: StepBatch) -> None:
        s = self.s
        segs = s.eager_segments(out)
        self.restores_last_plan = 0
        for rid in out.preempted_req_ids:
            self._drop_request(rid)
        for seg in segs:
            rids, slots = s.apply_segment(seg, out)
            while slots:
                cut = self._scan_batch(rids, slots, batch)
                rids, slots = rids[cut:], slots[cut:]
        wanted = self._candidates(None)
        self.lost_keys_at_repair = len({kid for _, _, kid in wanted})
        done = self._restore(wanted)
        if done:
            batch.req_ids.extend(rid for rid, _, _ in done)
            batch.gpu.append(int_tensor([g for _, g, _ in done], s.device))
            batch.cpu.append(int_tensor([c for _, _, c in done], s.device))
        self.restores_last_plan = len(done)
        self._release_held()
        batch.req_ids = list(dict.fromkeys(batch.req_ids))

    def _alloc(self, n: int) -> torch.Tensor:
        cpu, ev_b, ev_k = self.s.cpu_pool.alloc(n)
        if ev_b.numel():
            self.on_evictions(ev_b, ev_k)
        return cpu

    def _mark_in_flight(self, gpu_ids: torch.Tensor) -> None:
        s = self.s
        s.in_flight[gpu_ids] = True
        s.gpu_pool.touch_t(gpu_ids)
        ifk = self.in_flight_keys
        kids = s.gpu_pool.key[gpu_ids]
        for k in kids.tolist():
            ifk[k] = ifk.get(k, 0) + 1
        self._ifk_add(kids)

    def _release_held(self) -> None:
        self.judged_cached.clear()
        if self.held:
            held, self.held = self.held, []
            self.s.cpu_pool.free_t(int_tensor(held, self.s.device))

    def _candidates(self, finishing: tuple[str, list[list[int]]] | None) -> list[tuple[Position, int, int]]:
        """Pending records still owned and uncovered, one per key, in record order; drops the rest."""
        st = self.s.stores
        out: list[tuple[Position, int, int]] = []
        keys: set[int] = set()
        for pos, kid in list(self.lost.items()):
            rid, g, p = pos
            if finishing is not None and rid != finishing[0]:
                continue
            slot = st.slot_of.get(rid)
            b = None
            if slot is not None and not st.finished[slot] and p < self._cursor(slot, g):
                if finishing is not None:
                    ids = finishing[1][g]
                    raw = ids[p] if p < len(ids) else None
                else:
                    raw = self._table_id(slot, g, p)
                b = self._owned(slot, g, p, raw)
            if b is None or self._covered(kid):
                del self.lost[pos]
                continue
            if kid not in keys:
                keys.add(kid)
                out.append((pos, b, kid))
        return out

    def _acceptable(self, kid: int, useless_ok: bool = True) -> bool:
        """R7: a free CPU entry may be taken iff unhashed, not live, or (``useless_ok``) useless."""
        if kid < 0 or kid not in self.owners or not self._is_live(kid):
            return True
        if not useless_ok:
            return False
        rid, g, p = next(iter(self.owners[kid]))
        if p == 0:
            return False
        st = self.s.stores
        hids = st.sync_hids(st.slot_of[rid])
        return not self._covered(hids[p - 1] * self.s.G + g)

    def _choose_victims(self, n: int) -> list[int]:
        """R7: (a) acceptable entries at the head, (b) retired keys oldest first, (c) a
        refreshing walk of at most 2n + 8 entries."""
        s = self.s
        pool = s.cpu_pool
        victims: list[int] = []
        head = pool.free.peek_head(n)
        for cb, kid in zip(head.tolist(), pool.key[head].tolist(), strict=True):  # (a)
            if not self._acceptable(kid, useless_ok=False):
                break
            victims.append(cb)
        if len(victims) >= n:
            return victims
        chosen = set(victims)
        deferred: list[int] = []
        retired = self.retired
        while len(victims) < n and retired:  # (b)
            kid, _ = retired.popitem(last=False)
            cb = pool.index.get_one(kid)
            if cb < 0 and self.in_flight_keys.get(kid, 0) > 0:
                deferred.append(kid)  # its store has not completed yet
                continue
            if cb < 0 or cb in chosen or self._is_live(kid):
                continue
            if int(pool.ref[cb]) > 0:
                deferred.append(kid)
                continue
            victims.append(cb)
            chosen.add(cb)
        for kid in deferred:
            retired[kid] = None
        budget = 2 * n + 8
        if len(victims) < n:  # (c)
            walk = pool.free.peek_head(len(chosen) + budget)
            refresh: list[int] = []
            useless: list[int] = []  # acceptable only because their parent is lost: taken last
            for cb, kid in zip(walk.tolist(), pool.key[walk].tolist(), strict=True):
                if len(victims) >= n or budget <= 0:
                    break
                if cb in chosen:
                    continue
                budget -= 1
                if self._acceptable(kid, useless_ok=False):
                    victims.append(cb)
                elif self._acceptable(kid):
                    useless.append(cb)
                else:
                    refresh.append(cb)
            if refresh:
                pool.touch_t(int_tensor(refresh, s.device))
                self.held.extend(refresh)
            victims += useless[: n - len(victims)]
        return victims

    def _restore(self, wanted: list[tuple[Position, int, int]]) -> list[tuple[str, int, int]]:
        if not wanted:
            return []
        victims = self._choose_victims(len(wanted))
        if not victims:
            return []
        s = self.s
        pool = s.cpu_pool
        vt = int_tensor(victims, s.device)
        vkeys = pool.key[vt]
        self.useful_evicted_by_restores += sum(1 for k in vkeys.tolist() if not self._acceptable(k))
        taken = wanted[: len(victims)]
        pool.touch_t(vt)
        hashed = vkeys >= 0
        ev_b, ev_k = vt[hashed], vkeys[hashed]
        if ev_b.numel():
            pool.index.remove_many(ev_b, ev_k)
            pool.key[ev_b] = -1
            self.on_evictions(ev_b, ev_k)
        for pos, _, _ in taken:
            self.lost.pop(pos, None)
        self._mark_in_flight(int_tensor([b for _, b, _ in taken], s.device))
        return [(pos[0], b, c) for (pos, b, _), c in zip(taken, victims, strict=True)]

    # -- finish, completion, reset ----------------------------------------------------------------

    def finish_flush(self, request: RequestView, slot: int, block_ids: list[list[int]]) -> None:
        """R9: the live table's new work first, then this request's pending records."""
        s = self.s
        rid = request.request_id
        selected, _ = self._select(rid, slot, block_ids)
        gpu = list(selected)
        cpu: list[int] = []
        if selected:
            gsel = int_tensor(selected, s.device)
            cpu = self._alloc(len(selected)).tolist()
            self._mark_in_flight(gsel)
        for _, b, c in self._restore(self._candidates((rid, block_ids))):
            gpu.append(b)
            cpu.append(c)
        self._release_held()
        if gpu:
            s.queue_flush(int_tensor(gpu, s.device),
                          int_tensor(cpu, s.device))

    def on_store_completed(self, kids: torch.Tensor) -> None:
        ifk = self.in_flight_keys
        if ifk:
            live = kids[kids >= 0]
            if live.numel():
                t = self._ifk_tensor()
                t.index_put_((live,), torch.full_like(live, -1), accumulate=True)
                t[live] = t[live].clamp(min=0)
        for k in kids.tolist():
            if k < 0:
                continue
            n = ifk.get(k, 0) - 1
            if n > 0:
                ifk[k] = n
            else:
                ifk.pop(k, None)

    def on_request_finished(self, rid: str) -> None:
        self._drop_request(rid)

    def on_reset(self) -> None:
        self.owners.clear()
        self.lost.clear()
        self.in_flight_keys.clear()
        self._ifk_t.zero_()
        self.owned_keys.clear()
        self.window_floor.clear()
        self.retired.clear()

    def snapshot(self) -> dict[str, Any]:
        keys = self.s.keys
        return {
            "lost": sorted([rid, g, p] for rid, g, p in self.lost),
            "in_flight_keys": sorted(keys.key_text(k) for k in self.in_flight_keys),
            "restores_last_plan": self.restores_last_plan,
            "lost_keys_at_repair": self.lost_keys_at_repair,
            "self_evictions": self.self_evictions,
            "useful_evicted_by_restores": self.useful_evicted_by_restores,
        }
