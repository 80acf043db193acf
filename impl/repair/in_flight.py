"""The keys being stored (R4 of ``kvspec.model.repair``), mirrored for both kinds of reader.

``repair`` dedups by key: a key in flight (any live store transfer carries a block of it)
is not stored again. The scalar paths read a count per key from a dict; the batched scan
reads the same counts from a tensor indexed by key id. ``InFlightKeys`` owns both and
changes them together (``add``, ``complete``, ``clear``), so they cannot drift apart;
``_check`` asserts that they agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping

import torch

from kvspec.impl.keys import KeyTable


class InFlightKeys:
    """Per key id: how many live store transfers carry it (absent = 0)."""

    def __init__(self, keys: KeyTable, device: torch.device) -> None:
        self._keys = keys
        self._counts: Counter[int] = Counter()
        self._per_key = torch.zeros(0, dtype=torch.int64, device=device)

    def __bool__(self) -> bool:
        return bool(self._counts)

    def __iter__(self) -> Iterator[int]:
        return iter(self._counts)

    @property
    def counts(self) -> Mapping[int, int]:
        """The counts, read-only (for the scalar paths' tight loops). O(1)."""
        return self._counts

    def count(self, kid: int) -> int:
        return self._counts.get(kid, 0)

    def per_key(self) -> torch.Tensor:
        """The counts as an int64 tensor over every key id handed out so far (grown by doubling).
        Amortised O(1)."""
        cap = self._keys.key_capacity
        t = self._per_key
        if t.numel() < cap:
            grown = torch.zeros(max(cap, 2 * t.numel(), 64), dtype=torch.int64, device=t.device)
            grown[: t.numel()] = t
            self._per_key = t = grown
        return t

    def add(self, kids: torch.Tensor) -> None:
        """+1 for each listed key id (repeats count; every id >= 0: stores are planned for hashed
        blocks only). O(len)."""
        if kids.numel() == 0:
            return
        self._counts.update(kids.tolist())
        self.per_key().index_put_((kids,), torch.ones_like(kids), accumulate=True)

    def complete(self, kids: torch.Tensor) -> None:
        """A store of these keys completed: -1 each, never below 0 (ids < 0 are skipped). O(len)."""
        counts = self._counts
        if counts:
            live = kids[kids >= 0]
            if live.numel():
                t = self.per_key()
                t.index_put_((live,), torch.full_like(live, -1), accumulate=True)
                t[live] = t[live].clamp(min=0)
        for k in kids.tolist():
            if k < 0:
                continue
            n = counts.get(k, 0) - 1
            if n > 0:
                counts[k] = n
            else:
                counts.pop(k, None)

    def clear(self) -> None:
        self._counts.clear()
        self._per_key.zero_()

    def _check(self) -> None:
        """The dict holds exactly the positive counts, the tensor the same counts and zeros
        elsewhere. O(key ids)."""
        t = self._per_key
        assert bool((t >= 0).all()), "in-flight keys: negative count in the tensor"
        assert all(k >= 0 and c > 0 for k, c in self._counts.items()), "in-flight keys: bad dict entry"
        nonzero = t.nonzero().flatten()
        assert dict(zip(nonzero.tolist(), t[nonzero].tolist(), strict=True)) == self._counts, \
            "in-flight keys: the tensor and the dict disagree"
