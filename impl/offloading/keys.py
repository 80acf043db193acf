"""Keys interned to ids, and the per-key columns on tensors.

``KeyTable.ids`` is the implementation's one Python-side map from keys: ``(hash, group)`` to
a dense id, handed out in order of first use and never taken back (the model keeps every
request's records for ever too). Everything else indexed by key lives in int tensors indexed
by id, grown by doubling:

* ``slot``: the chunk slot holding the key, -1 when it has none;
* ``ghost`` / ``ghost_stamp``: ARC's ghost list of the key (0 none, 1 B1, 2 B2) and its
  order in that list (larger is later);
* ``offers`` / ``offer_stamp``: the store-threshold tracker's count (0 = not tracked) and
  its order (least recently offered has the smallest stamp).

``raw[id]`` is vLLM's packing of the key (``key_bytes``), which breaks ties in LRU order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvspec.contract.offloading import OffloadKey, key_bytes, key_text
from kvspec.impl.convert import int_tensor

_COLUMNS = ("slot", "ghost", "ghost_stamp", "offers", "offer_stamp")


class KeyTable:
    def __init__(self, device: torch.device, capacity: int = 64) -> None:
        self.device = device
        self.ids: dict[OffloadKey, int] = {}
        self.keys: list[OffloadKey] = []
        self.raw: list[bytes] = []
        self.slot = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.ghost = torch.zeros(capacity, dtype=torch.int8, device=device)
        self.ghost_stamp = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.offers = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.offer_stamp = torch.zeros(capacity, dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return len(self.keys)

    def _grow(self, need: int) -> None:
        cap = self.slot.numel()
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for name in _COLUMNS:
            old: torch.Tensor = getattr(self, name)
            fill = -1 if name == "slot" else 0
            grown = torch.full((new_cap,), fill, dtype=old.dtype, device=self.device)
            grown[:cap] = old
            setattr(self, name, grown)

    def intern(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The ids of ``keys`` (already checked), new keys given the next ids. O(k)."""
        ids = self.ids
        out: list[int] = []
        for key in keys:
            kid = ids.get(key)
            if kid is None:
                kid = len(self.keys)
                ids[key] = kid
                self.keys.append(key)
                self.raw.append(key_bytes(key))
            out.append(kid)
        self._grow(len(self.keys))
        return out

    def find(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The ids of ``keys`` without interning any: -1 for a key never seen. O(k)."""
        ids = self.ids
        return [ids.get(key, -1) for key in keys]

    def slots_of(self, kids: Sequence[int]) -> torch.Tensor:
        """Each id's slot; -1 for no slot or the id -1."""
        kt = self.tensor(kids)
        return torch.where(kt >= 0, self.slot[kt.clamp(min=0)], -1)

    def tensor(self, kids: Sequence[int]) -> torch.Tensor:
        return int_tensor(kids, self.device)

    def text(self, kid: int) -> str:
        return key_text(self.keys[kid])

    def texts(self, kids: torch.Tensor) -> list[str]:
        keys = self.keys
        return [key_text(keys[k]) for k in kids.tolist()]

    def key_list(self, kids: torch.Tensor) -> list[OffloadKey]:
        keys = self.keys
        return [keys[k] for k in kids.tolist()]

    def live(self, column: torch.Tensor) -> torch.Tensor:
        """The column's entries of interned ids (the rest is spare capacity)."""
        return column[: len(self.keys)]
