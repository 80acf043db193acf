"""The prefix-cache map (vLLM ``BlockHashToBlockMap``) on tensors: key id -> block ids.

A block carries at most one key (the pool's ``key`` tensor), so the blocks of one key
form a chain through two per-block link tensors (``nxt``, ``prv``) with its ends in
two per-key tensors (``first``, ``last``). Duplicates are allowed and kept in
insertion order; ``get_one_block`` is ``first[key]``. ``stamp[key]`` records when the
key last became present, which gives the map's key order (a dict's order) for the
snapshot.

Batch operations, each a handful of tensor ops:

* ``first_of(kids)``: the first block of many keys at once (-1 for absent or no key);
* ``insert_many(kids, blocks)``: appends in list order, several blocks per key allowed
  (a stable sort groups them and links each run);
* ``remove_many(blocks)``: unlinks blocks from their chains; when two of them are
  neighbours in one chain (only with duplicate entries) the pair is done in order.

Per-key tensors grow by doubling as keys are interned.
"""

from __future__ import annotations

import torch

SMALL_KEY_SLOTS = 4096  # up to this many key slots, ``items`` reads the per-key tensors as lists


class PrefixIndex:
    def __init__(self, num_blocks: int, block_key: torch.Tensor, device: torch.device) -> None:
        self.device = device
        self.block_key = block_key  # the owning pool's per-block key ids (shared tensor)
        self.nxt = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.prv = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.first = torch.full((64,), -1, dtype=torch.int64, device=device)
        self.last = torch.full((64,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.zeros(64, dtype=torch.int64, device=device)
        self.clock = 0

    def ensure(self, key_capacity: int) -> None:
        """Make room for key ids below ``key_capacity``. The last slot is never a key's, so
        ``first[-1]`` (a gather at key id -1) reads -1."""
        cap = self.first.numel()
        if key_capacity < cap:
            return
        new = max(key_capacity + 1, 2 * cap)
        pad = new - cap
        self.first = torch.cat([self.first, self.first.new_full((pad,), -1)])
        self.last = torch.cat([self.last, self.last.new_full((pad,), -1)])
        self.stamp = torch.cat([self.stamp, self.stamp.new_zeros(pad)])

    # -- reading ---------------------------------------------------------------------------

    def first_of(self, kids: torch.Tensor) -> torch.Tensor:
        """First block per key id (-1 where the key is absent or the id is -1 / unknown)."""
        if kids.numel() and int(kids.max()) >= self.first.numel() - 1:
            self.ensure(int(kids.max()) + 1)
        return self.first[kids]

    def first_known(self, kids: torch.Tensor) -> torch.Tensor:
        """``first_of`` for key ids below the capacity ``ensure`` was given (or -1): one gather."""
        return self.first[kids]

    def get_one(self, kid: int) -> int:
        if kid < 0 or kid >= self.first.numel() - 1:
            return -1
        return int(self.first[kid])

    def items(self) -> list[tuple[int, list[int]]]:
        """(key id, blocks in insertion order) in the map's key order. O(key slots + blocks): up to
        ``SMALL_KEY_SLOTS`` slots the per-key tensors are read as lists (a handful of tensor
        operations costs more than that), beyond it tensor operations find the present keys."""
        if self.first.numel() <= SMALL_KEY_SLOTS:
            first, stamp = self.first.tolist(), self.stamp.tolist()
            kids = sorted([k for k, f in enumerate(first) if f >= 0], key=stamp.__getitem__)
            last = self.last.tolist()
            firsts, lasts = [first[k] for k in kids], [last[k] for k in kids]
        else:
            present = (self.first >= 0).nonzero().flatten()
            present = present[torch.argsort(self.stamp[present])]
            kids, firsts, lasts = present.tolist(), self.first[present].tolist(), self.last[present].tolist()
        out = []
        nxt = None
        for kid, f, last in zip(kids, firsts, lasts, strict=True):
            chain = [f]
            if f != last:
                if nxt is None:
                    nxt = self.nxt.tolist()
                b = f
                while b != last:
                    b = nxt[b]
                    chain.append(b)
            out.append((kid, chain))
        return out

    # -- changing --------------------------------------------------------------------------

    def insert(self, kid: int, block: int) -> None:
        self.ensure(kid + 1)
        tail = int(self.last[kid])
        if tail < 0:
            self.first[kid] = block
            self.stamp[kid] = self.clock
            self.clock += 1
        else:
            self.nxt[tail] = block
            self.prv[block] = tail
        self.last[kid] = block

    def insert_many(self, kids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Append ``blocks[i]`` under ``kids[i]`` for i in order (blocks distinct, unlisted).
        Keys all absent and distinct (the usual case) take a path of a few scatters."""
        n = kids.numel()
        if n == 0:
            return
        self.ensure(int(kids.max()) + 1)
        if self._insert_new(kids, blocks):
            return
        order = torch.argsort(kids, stable=True)
        sk, sb = kids[order], blocks[order]
        start = torch.ones(n, dtype=torch.bool, device=self.device)
        start[1:] = sk[1:] != sk[:-1]
        end = torch.ones(n, dtype=torch.bool, device=self.device)
        end[:-1] = start[1:]
        old_last = self.last[sk]
        prev = torch.empty_like(sb)
        prev[1:] = sb[:-1]
        prev = torch.where(start, old_last, prev)
        nxt = torch.full_like(sb, -1)
        nxt[:-1] = sb[1:]
        nxt = torch.where(end, -1, nxt)
        self.prv[sb] = prev
        self.nxt[sb] = nxt
        head_k, head_b, head_old = sk[start], sb[start], old_last[start]
        joined = head_old >= 0
        self.nxt[head_old[joined]] = head_b[joined]
        new_k, new_b = head_k[~joined], head_b[~joined]
        self.first[new_k] = new_b
        if new_k.numel():
            first_seen = order[start][~joined]  # original index of each new key's first block
            rank = torch.argsort(torch.argsort(first_seen))
            self.stamp[new_k] = self.clock + rank
            self.clock += new_k.numel()
        self.last[sk[end]] = sb[end]

    def _insert_new(self, kids: torch.Tensor, blocks: torch.Tensor) -> bool:
        """``insert_many`` when no key of ``kids`` is present and none repeats: each block is
        its key's whole chain, keys stamped in order. False (nothing changed) otherwise. The
        repeat test writes the blocks into ``last`` and reads them back (a repeated key keeps
        only one of its blocks)."""
        if bool((self.last.index_select(0, kids) >= 0).any()):
            return False
        self.last[kids] = blocks
        if not torch.equal(self.last.index_select(0, kids), blocks):
            self.last[kids] = -1
            return False
        self.first[kids] = blocks  # the blocks' links are already -1: unlisted blocks are unlinked
        n = kids.numel()
        self.stamp[kids] = torch.arange(self.clock, self.clock + n, dtype=torch.int64, device=self.device)
        self.clock += n
        return True

    def remove_many(self, blocks: torch.Tensor, kids: torch.Tensor) -> None:
        """Unlink distinct listed ``blocks`` (``kids[i]`` = key of ``blocks[i]``)."""
        if blocks.numel() == 0:
            return
        prv, nxt = self.prv[blocks], self.nxt[blocks]
        if bool(((prv < 0) & (nxt < 0)).all()):  # every block alone under its key
            self.first[kids] = -1
            self.last[kids] = -1
            return
        for b, k in zip(blocks.tolist(), kids.tolist(), strict=True):
            self.remove(b, k)

    def remove(self, block: int, kid: int) -> None:
        p, n = int(self.prv[block]), int(self.nxt[block])
        if p >= 0:
            self.nxt[p] = n
        else:
            self.first[kid] = n
        if n >= 0:
            self.prv[n] = p
        else:
            self.last[kid] = p
        self.prv[block] = -1
        self.nxt[block] = -1

    def clear(self) -> None:
        self.first.fill_(-1)
        self.last.fill_(-1)
        self.nxt.fill_(-1)
        self.prv.fill_(-1)

    # -- self-check ---------------------------------------------------------------------------

    def _check(self) -> None:
        """Each present key's chain runs from ``first`` to ``last`` through blocks of that key,
        with ``prv`` the reverse of ``nxt``, and the chains hold every hashed block, once;
        unhashed blocks are unlinked; the sentinel slot reads -1; present keys have distinct
        stamps below the clock. O(blocks + key ids)."""
        key, nxt, prv = self.block_key.tolist(), self.nxt.tolist(), self.prv.tolist()
        first, last = self.first.tolist(), self.last.tolist()
        assert len(first) == len(last) == self.stamp.numel(), "prefix index: per-key sizes"
        assert first[-1] == -1 and last[-1] == -1, "prefix index: the sentinel slot is used"
        hashed = 0
        for b, k in enumerate(key):
            if k < 0:
                assert nxt[b] == -1 and prv[b] == -1, f"prefix index: unhashed block {b} is linked"
            else:
                assert k < len(first) - 1, f"prefix index: block {b}'s key id {k} beyond the capacity"
                hashed += 1
        present = [k for k, f in enumerate(first) if f >= 0]
        assert present == [k for k, t in enumerate(last) if t >= 0], "prefix index: a chain without two ends"
        visited = 0
        for k in present:
            b, before = first[k], -1
            while b >= 0:
                visited += 1
                assert visited <= hashed, "prefix index: a chain closes on itself"
                assert key[b] == k and prv[b] == before, f"prefix index: block {b} in the chain of key {k}"
                before, b = b, nxt[b]
            assert last[k] == before, f"prefix index: key {k}'s chain does not end at its last"
        assert visited == hashed, "prefix index: a hashed block is in no chain"
        stamps = self.stamp[present].tolist()
        assert all(x < self.clock for x in stamps) and len(set(stamps)) == len(stamps), \
            "prefix index: stamps of present keys"
