"""Per-request eager store state in slot-indexed tensors.

A registered request gets a *slot*. Per slot and KV group: ``length`` (how many GPU
ids vLLM's ``StoreRequestState.block_ids`` holds) and ``cursor``
(``num_stored_blocks``), both int64 ``[slots, groups]``; the ids themselves live in
``table`` ``[slots, groups, capacity]``. A planning step reads the cursors, lengths and
candidate ids of every scheduled request with one gather each, and writes the
advanced cursors with one scatter. Appending the ids a scheduler output brings is
one scatter for the whole step.

Per slot, in Python: the request object (read for its token counts), the set of its
store events, the finished flag, and the interned hash ids of its ``block_hashes``
(synced lazily, append-only as in vLLM). Slots are reused after cleanup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from kvspec.impl.convert import int_tensor
from kvspec.impl.keys import KeyTable

FEW_SHORT = 256  # at most this many positions beyond the copied hash ids are looked up directly


class StoreTable:
    def __init__(self, num_groups: int, keys: KeyTable, device: torch.device) -> None:
        self.G = num_groups
        self.keys = keys
        self.device = device
        self.slots = 0
        self.capacity = 16
        self.cursor = torch.zeros((0, num_groups), dtype=torch.int64, device=device)
        self.length = torch.zeros((0, num_groups), dtype=torch.int64, device=device)
        self.table = torch.zeros((0, num_groups, self.capacity), dtype=torch.int64, device=device)
        self.slot_of: dict[str, int] = {}
        self.rid: list[str | None] = []
        self.request: list[Any] = []
        self.events: list[set[int]] = []
        self.finished: list[bool] = []
        self.hids: list[list[int]] = []
        self._free_slots: list[int] = []
        self.hid_tab = torch.zeros((0, 16), dtype=torch.int64, device=device)  # hash ids per slot
        self.hid_len = torch.zeros(0, dtype=torch.int64, device=device)  # per slot: entries copied in
        self.hid_done: list[int] = []  # hid_len as a Python list
        self.num_finished = 0  # slots whose request finished with store events pending
        self.version = 0  # bumped whenever a slot's request or finished flag changes

    def __contains__(self, rid: object) -> bool:
        return rid in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    # -- membership ------------------------------------------------------------------------

    def add(self, rid: str, request: Any) -> int:
        self.version += 1
        if self._free_slots:
            s = self._free_slots.pop()
        else:
            s = self.slots
            self.slots += 1
            if s >= self.cursor.shape[0]:
                self._grow_rows(max(16, 2 * self.cursor.shape[0]))
            self.rid.append(None)
            self.request.append(None)
            self.events.append(set())
            self.finished.append(False)
            self.hids.append([])
            self.hid_done.append(0)
        self.slot_of[rid] = s
        self.rid[s] = rid
        self.request[s] = request
        self.events[s] = set()
        self.finished[s] = False
        self.hids[s] = []
        self.hid_len[s] = 0
        self.hid_done[s] = 0
        self.cursor[s] = 0
        self.length[s] = 0
        return s

    def mark_finished(self, slot: int) -> None:
        if not self.finished[slot]:
            self.version += 1
            self.finished[slot] = True
            self.num_finished += 1

    def remove(self, rid: str) -> int:
        s = self.slot_of.pop(rid)
        self.version += 1
        if self.finished[s]:
            self.finished[s] = False
            self.num_finished -= 1
        self.rid[s] = None
        self.request[s] = None
        self.events[s] = set()
        self.hids[s] = []
        self.hid_len[s] = 0
        self.hid_done[s] = 0
        self._free_slots.append(s)
        return s

    def clear(self) -> None:
        for rid in list(self.slot_of):
            self.remove(rid)

    def _grow_rows(self, rows: int) -> None:
        pad = rows - self.cursor.shape[0]
        self.cursor = torch.cat([self.cursor, self.cursor.new_zeros((pad, self.G))])
        self.length = torch.cat([self.length, self.length.new_zeros((pad, self.G))])
        self.table = torch.cat([self.table, self.table.new_zeros((pad, self.G, self.capacity))])
        self.hid_len = torch.cat([self.hid_len, self.hid_len.new_zeros(pad)])
        self.hid_tab = torch.cat([self.hid_tab, self.hid_tab.new_zeros((pad, self.hid_tab.shape[1]))])

    def _grow_columns(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        wider = self.table.new_zeros((self.table.shape[0], self.G, cap))
        wider[:, :, : self.capacity] = self.table
        self.table, self.capacity = wider, cap

    # -- ids -----------------------------------------------------------------------------------

    def reset_rows(self, slots: Sequence[int], cursors_too: bool) -> None:
        if not slots:
            return
        idx = int_tensor(list(slots), self.device)
        self.length[idx] = 0
        if cursors_too:
            self.cursor[idx] = 0

    def append(self, seg_slot: list[int], seg_group: list[int], seg_len: list[int], flat: list[int]) -> None:
        """Append ``flat`` (concatenated runs) to ``(seg_slot[i], seg_group[i])``; pairs distinct."""
        if not seg_slot:
            return
        dev = self.device
        s = int_tensor(seg_slot, dev)
        g = int_tensor(seg_group, dev)
        n = int_tensor(seg_len, dev)
        base = self.length[s, g]
        new_len = base + n
        top = int(new_len.max())
        if top > self.capacity:
            self._grow_columns(top)
        total = len(flat)
        rows = torch.repeat_interleave(s, n)
        cols = torch.repeat_interleave(g, n)
        start = torch.cumsum(n, 0) - n
        offs = torch.arange(total, device=dev) - torch.repeat_interleave(start - base, n)
        self.table[rows, cols, offs] = int_tensor(flat, dev)
        self.length[s, g] = new_len

    def ids(self, slot: int, g: int) -> list[int]:
        return self.table[slot, g, : int(self.length[slot, g])].tolist()

    def hash_ids_at(self, slots: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Per (slot, position) pair: the hash id of ``block_hashes[p]`` of the slot's request, -1
        where it has none (or its hash was never interned: no key of it exists). Pairs beyond the
        copied hash ids are looked up one by one when they are few (``FEW_SHORT``, a decode step's
        new positions), else their slots are synced (``sync_hids``) and copied in (one scatter).
        O(pairs) tensor work plus O(min(short pairs, FEW_SHORT)) dict look-ups or the sync."""
        short = p >= self.hid_len.index_select(0, slots)
        n_short = int(short.sum())
        if n_short > FEW_SHORT:
            self._copy_hids(torch.unique(slots[short]).tolist())
            short = p >= self.hid_len.index_select(0, slots)
            n_short = 0
        got = torch.where(short, -1, self.hid_tab[slots, p.clamp(max=self.hid_tab.shape[1] - 1)])
        if n_short:
            at = short.nonzero().flatten()
            known, request = self.keys.known_hash_id_map(), self.request
            looked = []
            for s, q in zip(slots.index_select(0, at).tolist(), p.index_select(0, at).tolist(), strict=True):
                hashes = request[s].block_hashes
                looked.append(known.get(hashes[q], -1) if q < len(hashes) else -1)
            got[at] = int_tensor(looked, self.device)
        return got

    def _copy_hids(self, slots: list[int]) -> None:
        dev = self.device
        hid_done = self.hid_done
        done = [hid_done[s] for s in slots]
        hids, request = self.hids, self.request
        known = self.keys.known_hash_id_map()
        at_s: list[int] = []
        at_p: list[int] = []
        new: list[int] = []
        lens: list[int] = []
        for s, d in zip(slots, done, strict=True):
            have = hids[s]
            hashes = request[s].block_hashes
            n = len(have)
            if len(hashes) > n:
                add = [known.get(t) for t in hashes[n:]] if len(hashes) - n < 8 else None
                if add is None or None in add:
                    have.extend(self.keys.hash_ids(hashes[n:]))
                else:
                    have.extend(cast("list[int]", add))  # no None in it: every hash has an id already
            m = len(have)
            lens.append(m)
            hid_done[s] = m
            if m - d == 1:
                at_s.append(s)
                at_p.append(d)
                new.append(have[d])
            elif m > d:
                at_s += [s] * (m - d)
                at_p += range(d, m)
                new += have[d:]
        need = max(lens)
        if need > self.hid_tab.shape[1]:
            wider = self.hid_tab.new_zeros((self.hid_tab.shape[0], max(need, 2 * self.hid_tab.shape[1])))
            wider[:, : self.hid_tab.shape[1]] = self.hid_tab
            self.hid_tab = wider
        if new:
            self.hid_tab[int_tensor(at_s, dev), int_tensor(at_p, dev)] = int_tensor(new, dev)
        self.hid_len[int_tensor(slots, dev)] = int_tensor(lens, dev)

    def sync_hids(self, slot: int) -> list[int]:
        """The hash ids of the slot's request's ``block_hashes`` (interning new ones)."""
        have = self.hids[slot]
        hashes = self.request[slot].block_hashes
        if len(hashes) > len(have):
            have.extend(self.keys.hash_ids(hashes[len(have):]))
        return have

    # -- observation ----------------------------------------------------------------------------

    def snapshot_rows(self) -> dict[str, tuple[list[list[int]], list[int], set[int], bool]]:
        """Per request: (GPU ids per group, cursors, store events, finished), for the snapshot."""
        if not self.slot_of:
            return {}
        cursors = self.cursor.tolist()
        lengths = self.length.tolist()
        slots = list(self.slot_of.values())
        tables = self.table[slots].tolist()  # one gather of the live slots' rows
        return {rid: ([row[: lengths[s][g]] for g, row in enumerate(rows)], cursors[s], self.events[s],
                      self.finished[s])
                for (rid, s), rows in zip(self.slot_of.items(), tables, strict=True)}

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cursor, self.length, self.table))

    # -- self-check ---------------------------------------------------------------------------------

    def _check(self) -> None:
        """Slots: every per-slot list has one entry per slot, the tensors at least as many rows;
        each slot is either a request's (``slot_of`` and ``rid`` agree) or free and empty; the
        finished count is right. Ids: lengths within the capacity, cursors and lengths >= 0.
        Hash ids: a prefix of the request's hashes' ids, and the tensor copy (``hid_tab``) holds
        the first ``hid_done`` of them. O(slots + hash ids)."""
        n = self.slots
        lists = (self.rid, self.request, self.events, self.finished, self.hids, self.hid_done)
        assert all(len(x) == n for x in lists), "store table: per-slot lists of different lengths"
        rows = {t.shape[0] for t in (self.cursor, self.length, self.table, self.hid_len, self.hid_tab)}
        assert len(rows) == 1 and rows.pop() >= n and self.table.shape[2] == self.capacity, "store table: shapes"
        free = set(self._free_slots)
        assert len(free) == len(self._free_slots) and free.isdisjoint(self.slot_of.values()), "store table: free slots"
        assert len(free) + len(self.slot_of) == n, "store table: a slot is neither used nor free"
        for s in free:
            assert self.rid[s] is None and self.request[s] is None and not self.events[s], f"free slot {s} in use"
            assert not self.finished[s] and not self.hids[s] and self.hid_done[s] == 0, f"free slot {s} not cleared"
        assert self.num_finished == sum(self.finished), "store table: finished count"
        assert bool((self.cursor[:n] >= 0).all()) and bool((self.length[:n] >= 0).all()), "store table: negative"
        assert not bool((self.length > self.capacity).any()), "store table: ids beyond the capacity"
        assert self.hid_len[:n].tolist() == self.hid_done, "store table: hid_len and hid_done disagree"
        copied = self.hid_tab[:n].tolist()
        for rid, s in self.slot_of.items():
            self._check_slot(rid, s, copied[s])

    def _check_slot(self, rid: str, s: int, copied: list[int]) -> None:
        assert self.rid[s] == rid and self.request[s] is not None, f"{rid}: slot {s} names another request"
        have, done = self.hids[s], self.hid_done[s]
        hashes = self.request[s].block_hashes
        assert len(have) <= len(hashes) and done <= len(have), f"{rid}: hash ids beyond the hashes"
        assert have == [self.keys.known_hash_id(h) for h in hashes[: len(have)]], f"{rid}: stale hash ids"
        assert copied[:done] == have[:done], f"{rid}: hash id tensor out of step"

