"""Interning of block hashes and cache keys as int64 ids.

Every tensor in ``kvspec.impl`` that refers to a hash key holds an int64 *key id*
(-1 = no key). A hash string gets a *hash id* ``h`` the first time it is seen; the key
``(hash, group)`` of a configured group ``g`` is ``h * G + g``, so the keys of a
request's positions are computed in one tensor expression from its hash ids. A key
whose group lies outside ``0..G-1`` (nothing in the modelled system makes one, but the
pool accepts any key) gets a hash id of its own and group slot 0.

Each hash id also carries a 63-bit *seed* (BLAKE2b of the hash text): the payload of a
block is a pure function of it (``kvspec.impl.payload``). Interning is O(1) per new
hash; ids never change and are never reused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

import torch

from kvspec.impl.convert import int_tensor

BlockKey = tuple[str, int]


def seed_of(text: str) -> int:
    """A deterministic non-negative 63-bit integer for ``text``."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


class KeyTable:
    """hash text <-> hash id, key tuple <-> key id (``hash_id * num_groups + group``)."""

    def __init__(self, num_groups: int, device: torch.device) -> None:
        self.num_groups = num_groups
        self.device = device
        self._hid: dict[str, int] = {}
        self._odd: dict[BlockKey, int] = {}
        self._text: list[str | BlockKey] = []  # per hash id: the hash text, or the whole odd key
        self._seeds: list[int] = []
        self._seed_t = torch.zeros(64, dtype=torch.int64, device=device)
        self._seed_n = 0  # seeds copied into the tensor so far
        self._key_texts: dict[int, str] = {}  # key id -> snapshot text, filled as snapshots ask

    def __len__(self) -> int:
        return len(self._text)

    @property
    def key_capacity(self) -> int:
        """Number of key ids handed out so far (an exclusive upper bound)."""
        return len(self._text) * self.num_groups

    def hash_id(self, text: str) -> int:
        h = self._hid.get(text)
        if h is None:
            h = self._hid[text] = len(self._text)
            self._text.append(text)
            self._seeds.append(seed_of(text))
        return h

    def hash_ids(self, texts: Sequence[str]) -> list[int]:
        get = self._hid.get
        out = [get(t) for t in texts]
        if None in out:
            return [self.hash_id(t) for t in texts]
        return cast("list[int]", out)  # no None in it

    def known_hash_id_map(self) -> dict[str, int]:
        """hash text -> hash id of every hash interned so far (read-only; do not change it)."""
        return self._hid

    def known_hash_id(self, text: str) -> int:
        """The hash id of ``text`` or -1 when it was never seen (then no key of it exists)."""
        return self._hid.get(text, -1)

    def key_id(self, key: BlockKey) -> int:
        h, g = key
        if isinstance(g, int) and not isinstance(g, bool) and 0 <= g < self.num_groups and isinstance(h, str):
            return self.hash_id(h) * self.num_groups + g
        kid = self._odd.get(key)
        if kid is None:
            kid = self._odd[key] = len(self._text) * self.num_groups
            self._text.append(key)
            self._seeds.append(seed_of(f"{h}:{g}"))
        return kid

    def known_key_id(self, key: BlockKey) -> int:
        """The id of ``key`` or -1 when no block could carry it yet."""
        h, g = key
        if isinstance(g, int) and not isinstance(g, bool) and 0 <= g < self.num_groups and isinstance(h, str):
            hid = self._hid.get(h, -1)
            return -1 if hid < 0 else hid * self.num_groups + g
        return self._odd.get(key, -1)

    def key(self, kid: int) -> BlockKey:
        entry = self._text[kid // self.num_groups]
        if isinstance(entry, tuple):
            return entry
        return (entry, kid % self.num_groups)

    def key_text(self, kid: int) -> str:
        """The snapshot text ``"<hash>:<group>"`` of key id ``kid`` (memoized: ids are never reused)."""
        text = self._key_texts.get(kid)
        if text is None:
            k = self.key(kid)
            text = self._key_texts[kid] = f"{k[0]}:{k[1]}"
        return text

    def seeds(self, kids: torch.Tensor) -> torch.Tensor:
        """Seeds of the hashes of ``kids`` (vectorized)."""
        n = len(self._seeds)
        if self._seed_n < n:
            if n > self._seed_t.numel():
                grown = torch.zeros(max(n, 2 * self._seed_t.numel()), dtype=torch.int64, device=self.device)
                grown[: self._seed_n] = self._seed_t[: self._seed_n]
                self._seed_t = grown
            self._seed_t[self._seed_n : n] = int_tensor(self._seeds[self._seed_n :], self.device)
            self._seed_n = n
        return self._seed_t[torch.div(kids, self.num_groups, rounding_mode="floor")]

    def _check(self) -> None:
        """Each interned text or odd key maps to the id whose entry it is, one seed per id, the
        seed tensor mirrors the seeds copied so far, and each memoized key text is its key's
        text. O(hash ids + key texts)."""
        assert len(self._seeds) == len(self._text) == len(self._hid) + len(self._odd), "key table: sizes"
        assert all(self._text[h] == text for text, h in self._hid.items()), "key table: hash ids"
        G = self.num_groups
        assert all(kid % G == 0 and self._text[kid // G] == key for key, kid in self._odd.items()), \
            "key table: odd keys"
        assert self._seed_n <= min(len(self._seeds), self._seed_t.numel()), "key table: seeds copied"
        assert all(t == "{}:{}".format(*self.key(k)) for k, t in self._key_texts.items()), "key table: key texts"
        assert self._seed_t[: self._seed_n].tolist() == self._seeds[: self._seed_n], "key table: seed tensor"

