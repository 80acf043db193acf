"""vLLM's ``CPUOffloadingManager`` on tensors (``OffloadingManagerTarget``).

State: the chunk pool (``ChunkPool``: ref counts, slot -> key id, the free stack), the key
table (``KeyTable``: key -> id, and per id its slot, ARC ghost list and offer count), the
policy's columns (``TensorLRU`` or ``TensorARC``), two counters (evictable chunks, chunks
being stored) and per-request records by key id (``Request``). Each call checks its input
with the contract's shared checks (``kvspec.contract.offloading_checks``), in the order the
contract's targets do, before it changes anything; then works on the call's keys as a batch:
one gather of their slots and ref counts, one scatter of the result.

The rules are those of vLLM 0.33.0 as the contract states them; this module says how they
map to the tensors, never what they are beyond that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvspec.contract.offloading import OffloadingConfig, OffloadKey, PrepareStoreOutput, key_text
from kvspec.contract.offloading_checks import (
    check_keys,
    check_loadable,
    check_loading,
    check_new_request,
    check_positions,
    check_success,
    known_request,
)
from kvspec.impl.offloading.arc import TensorARC
from kvspec.impl.offloading.keys import KeyTable
from kvspec.impl.offloading.lru import TensorLRU
from kvspec.impl.offloading.pool import STORING, ChunkPool
from kvspec.impl.offloading.requests import Access, Request


class TensorOffloadingManager:
    def __init__(self, config: OffloadingConfig, device: str | torch.device = "cpu") -> None:
        config.validate()
        self._config = config
        self.device = torch.device(device)
        self.pool = ChunkPool(config.num_chunks, self.device)
        self.keys = KeyTable(self.device)
        self.policy: TensorLRU | TensorARC = (TensorLRU(self.pool, self.keys) if config.policy == "lru"
                                              else TensorARC(self.pool, self.keys, config.num_chunks))
        self.protected = torch.zeros(config.num_chunks, dtype=torch.bool, device=self.device)  # False between calls
        self.num_evictable = 0
        self.num_write_pending = 0
        self.generation = 0
        self.requests: dict[str, Request] = {}
        self.tracking = config.store_threshold >= 2
        self.num_tracked = 0
        self.offer_clock = 0

    @property
    def config(self) -> OffloadingConfig:
        return self._config

    # -- requests ------------------------------------------------------------------------------

    def _req(self, req_id: str, submit: bool) -> Request:
        return known_request(req_id, self.requests, submit, lambda req: req.closed)

    def _access(self, req: Request) -> Access:
        if req.access is None or req.access.generation != self.generation:
            req.access = Access(self.generation)
        return req.access

    def _record_access(self, req: Request, kids: list[int], reused: list[int]) -> None:
        acc = self._access(req)
        new = [k for k in kids if k not in acc.seen]
        keys = self.keys.keys
        for k in new:
            acc.groups.setdefault(keys[k][1], []).append(k)
        acc.seen.update(new)
        if new:
            self.policy.on_request_access(new, req, self.generation)
        acc.reused.update(k for k in reused if k not in acc.inserted)

    def on_new_request(self, req_id: str) -> None:
        check_new_request(req_id, self.requests)
        req = Request()
        self._access(req)
        self.requests[req_id] = req

    def set_key_positions(self, req_id: str, positions: Sequence[tuple[OffloadKey, int]]) -> None:
        req = self._req(req_id, submit=True)
        check_positions(positions)
        kids = self.keys.intern([key for key, _ in positions])
        for kid, (_, position) in zip(kids, positions, strict=True):
            req.positions[kid] = position

    def on_request_finished(self, req_id: str) -> None:
        req = self._req(req_id, submit=False)
        req.closed = True
        acc = req.access
        if acc is None or acc.generation != self.generation or acc.finished:
            return
        acc.finished = True
        pos = req.positions
        order: list[int] = []
        for group in sorted(acc.groups):
            kids = acc.groups[group]
            if all(k in pos for k in kids):
                kids = sorted(kids, key=pos.__getitem__)
            order += kids
        if all(k in pos for k in order):
            order.sort(key=pos.__getitem__)
        self.policy.on_request_finished(order, acc.inserted - acc.reused, acc.reused, req, self.generation)

    # -- the call's keys as a batch --------------------------------------------------------------

    def _slots_refs(self, kids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key's slot (-1: none) and ref count (meaningless without a slot)."""
        slots = self.keys.slots_of(kids)
        refs = self.pool.ref[slots.clamp(min=0)]
        return slots, refs

    @staticmethod
    def _ref_reader(keys: Sequence[OffloadKey], slots: torch.Tensor, refs: torch.Tensor
                    ) -> dict[OffloadKey, int | None]:
        return {k: (r if s >= 0 else None)
                for k, s, r in zip(keys, slots.tolist(), refs.tolist(), strict=True)}

    # -- lookups and loads ---------------------------------------------------------------------

    def lookup(self, req_id: str, key: OffloadKey) -> str:
        self._req(req_id, submit=True)
        check_keys([key])
        kid = self.keys.ids.get(key)
        slot = -1 if kid is None else int(self.keys.slot[kid])
        if slot < 0:
            return "MISS"
        return "HIT" if int(self.pool.ref[slot]) >= 0 else "HIT_PENDING"

    def prepare_load(self, req_id: str, keys: Sequence[OffloadKey]) -> list[int]:
        req = self._req(req_id, submit=True)
        check_keys(keys)
        kids = self.keys.find(keys)  # all known once check_loadable passes
        slots, refs = self._slots_refs(kids)
        check_loadable(keys, self._ref_reader(keys, slots, refs).__getitem__)
        self.num_evictable -= int((refs == 0).sum())
        self.pool.ref[slots] += 1
        self._record_access(req, kids, reused=kids)
        return [int(s) for s in slots.tolist()]

    def touch(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        req = self._req(req_id, submit=True)
        check_keys(keys)
        self.policy.touch(self.keys.find(keys), req, self.generation)

    def complete_load(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        self._req(req_id, submit=False)
        check_keys(keys)
        kids = self.keys.find(keys)
        slots, refs = self._slots_refs(kids)
        check_loading(keys, self._ref_reader(keys, slots, refs).__getitem__)
        self.pool.ref[slots] -= 1
        self.num_evictable += int((refs == 1).sum())

    # -- stores --------------------------------------------------------------------------------

    def _count_offers(self, kids: list[int]) -> None:
        """The offer tracker: counted keys go up by one and to the end; new keys enter with 1
        at the end while there is room, else each displaces the front key that this offer
        did not count (none left: the key is not tracked)."""
        kt = self.keys.tensor(kids)
        counts = self.keys.offers[kt]
        counted = counts > 0
        n_counted = int(counted.sum())
        old = kt[counted]
        self.keys.offers[old] += 1
        self.keys.offer_stamp[old] = self._offer_stamps(n_counted)
        new = kt[~counted]
        if new.numel() == 0:
            return
        room = self._config.max_tracker_size - self.num_tracked
        uncounted = self.num_tracked - n_counted
        displace = min(uncounted, max(0, new.numel() - room))
        admitted = new[:max(0, room) + displace]
        if displace:
            offers = self.keys.live(self.keys.offers)
            tracked = torch.nonzero(offers > 0).squeeze(1)
            front = tracked[torch.topk(self.keys.offer_stamp[tracked], displace, largest=False).indices]
            self.keys.offers[front] = 0
        self.keys.offers[admitted] = 1
        self.keys.offer_stamp[admitted] = self._offer_stamps(admitted.numel())
        self.num_tracked += admitted.numel() - displace

    def _offer_stamps(self, n: int) -> torch.Tensor:
        out = torch.arange(self.offer_clock + 1, self.offer_clock + 1 + n, dtype=torch.int64, device=self.device)
        self.offer_clock += n
        return out

    def prepare_store(self, req_id: str, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        req = self._req(req_id, submit=True)
        check_keys(keys)
        keys = list(keys)
        kids = self.keys.intern(keys)
        if self.tracking:
            self._count_offers(kids)
        kt = self.keys.tensor(kids)
        slots, refs = self._slots_refs(kids)
        absent = slots < 0
        ready = ~absent & (refs >= 0)
        if self.tracking:
            absent &= self.keys.offers[kt] >= self._config.store_threshold
        store_l, ready_l = absent.tolist(), ready.tolist()
        to_store = [k for k, s in zip(kids, store_l, strict=True) if s]
        reused = [k for k, r in zip(kids, ready_l, strict=True) if r]
        acc = self._access(req)
        misses = [k for k in to_store if k not in acc.store_misses]
        if misses:
            self.policy.on_store_miss(misses, req, self.generation)
            acc.store_misses.update(misses)
        self._record_access(req, [k for k, s, r in zip(kids, store_l, ready_l, strict=True) if s or r], reused)
        if not to_store:
            return PrepareStoreOutput([], [], [])
        shortfall = len(to_store) - self.pool.num_free()
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            if shortfall > self.num_evictable:
                return None
            mine = slots[slots >= 0]
            self.protected[mine] = True  # the call's own resident keys; cleared again below
            victims = self.policy.evict(shortfall, self.protected)
            self.protected[mine] = False
            if victims is None:
                return None
            self.num_evictable -= victims.numel()
            gone = self.pool.key[victims]
            evicted = self.keys.key_list(gone)
            self.keys.slot[gone] = -1
            self.pool.key[victims] = -1
            self.pool.push(victims)
        new_slots = self.pool.allocate(len(to_store))
        store_t = self.keys.tensor(to_store)
        self.pool.key[new_slots] = store_t
        self.pool.ref[new_slots] = STORING
        self.keys.slot[store_t] = new_slots
        self.policy.insert(to_store, new_slots, req, self.generation)
        self.num_write_pending += len(to_store)
        acc.inserted.update(to_store)
        return PrepareStoreOutput(self.keys.key_list(store_t), [int(s) for s in new_slots.tolist()], evicted)

    def complete_store(self, req_id: str, keys: Sequence[OffloadKey], success: bool = True) -> None:
        self._req(req_id, submit=False)
        check_keys(keys)
        check_success(success)
        kids = self.keys.find(keys)
        slots, refs = self._slots_refs(kids)
        pending = slots[(slots >= 0) & (refs == STORING)]
        n = pending.numel()
        if n == 0:
            return
        self.num_write_pending -= n
        if success:
            self.pool.ref[pending] = 0
            self.num_evictable += n
            return
        self.policy.remove(pending)
        self.keys.slot[self.pool.key[pending]] = -1
        self.pool.key[pending] = -1
        self.pool.push(pending)

    def reset_cache(self) -> None:
        self.keys.slot[self.pool.key[self.pool.resident()]] = -1
        self.policy.clear()
        self.pool.clear()
        self.generation += 1
        self.num_evictable = 0
        self.num_write_pending = 0

    # -- observation ---------------------------------------------------------------------------

    def _offers_json(self) -> list[list[Any]] | None:
        if not self.tracking:
            return None
        offers = self.keys.live(self.keys.offers)
        kids = torch.nonzero(offers > 0).squeeze(1)
        kids = kids[torch.argsort(self.keys.offer_stamp[kids])]
        return [[self.keys.text(k), n] for k, n in zip(kids.tolist(), offers[kids].tolist(), strict=True)]

    def _requests_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        text = self.keys.text
        for rid, req in sorted(self.requests.items()):
            acc = req.access if req.access is not None and req.access.generation == self.generation else None
            out[rid] = None if acc is None else {
                "finished": acc.finished,
                "seen": sorted(text(k) for k in acc.seen),
                "inserted": sorted(text(k) for k in acc.inserted),
                "reused": sorted(text(k) for k in acc.reused),
                "store_misses": sorted(text(k) for k in acc.store_misses),
            }
        return out

    def snapshot(self) -> dict[str, Any]:
        slots = torch.nonzero(self.pool.resident()).squeeze(1)
        keys = self.keys.keys
        chunks = sorted(zip((keys[k] for k in self.pool.key[slots].tolist()), slots.tolist(),
                            self.pool.ref[slots].tolist(), strict=True))
        return {
            "manager": "offloading",
            "config": self._config.to_json(),
            "chunks": {key_text(k): {"chunk": s, "ref_cnt": r} for k, s, r in chunks},
            "free_list": self.pool.free_list(),
            "num_allocated": self.pool.num_allocated,
            "counters": {"evictable": self.num_evictable, "write_pending": self.num_write_pending},
            "policy": {self.policy.name: self.policy.snapshot()},
            "offers": self._offers_json(),
            "requests": self._requests_json(),
        }

    def _check(self) -> None:
        """Slot and key maps are inverse; resident and free slots together are exactly the
        allocated ones; the counters equal what they count; the tracker within its bound;
        no slot left protected between calls; the policy's own check."""
        pool, keys = self.pool, self.keys
        assert not bool(self.protected.any())
        res = pool.resident()
        slots = torch.nonzero(res).squeeze(1)
        assert bool((keys.slot[pool.key[slots]] == slots).all())
        assert int((keys.live(keys.slot) >= 0).sum()) == slots.numel()
        free = pool.free_list()
        assert sorted(slots.tolist() + free) == list(range(pool.num_allocated))
        assert pool.num_allocated <= pool.num_chunks
        refs = pool.ref[slots]
        assert self.num_evictable == int((refs == 0).sum())
        assert self.num_write_pending == int((refs == STORING).sum())
        assert bool((refs >= STORING).all())
        tracked = int((keys.live(keys.offers) > 0).sum())
        assert tracked == self.num_tracked <= self._config.max_tracker_size or not self.tracking
        self.policy._check()
