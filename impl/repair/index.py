"""The loss-record index of ``repair`` (R1, R7 b of ``kvspec.model.repair``), by key id.

* ``owners``: key -> the positions (request, group, position) indexed under it, in
  insertion order (their order decides which record is made first);
* ``lost``: position -> key, the pending lost records, in the order they were made;
* ``owned_keys``: request -> the keys it was indexed under (retired when it finishes);
* ``window_floor``: (request, sliding group) -> positions retired so far;
* ``retired``: keys whose owner finished or was preempted, or whose position left a
  sliding window, oldest first (R7 b's victims).

Owners are pruned lazily: ``live`` drops the positions a caller's predicate rejects. The
index knows nothing of the pools; what "owns" and "covered" mean is given by its callers
(``kvspec.impl.repair.ownership``). Key ids are ``hash_id * G + group``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

Position = tuple[str, int, int]  # (request id, group, position), as in the model


class LossIndex:
    def __init__(self) -> None:
        self.owners: dict[int, dict[Position, None]] = {}
        self.lost: dict[Position, int] = {}
        self.owned_keys: dict[str, list[int]] = {}
        self.window_floor: dict[tuple[str, int], int] = {}
        self.retired: OrderedDict[int, None] = OrderedDict()

    def register_all(self, kids: Iterable[int], positions: Iterable[Position]) -> None:
        """Index each position under its key, in order (a no-op for a pair already there); a new
        entry also lists the key for the position's request. O(len)."""
        owners, owned_keys = self.owners, self.owned_keys
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

    def live(self, kid: int, owns: Callable[[Position], bool]) -> bool:
        """Whether some position indexed under ``kid`` still ``owns`` it; the others are dropped.
        O(owners of the key)."""
        owners = self.owners.get(kid)
        if not owners:
            return False
        for pos in list(owners):
            if not owns(pos):
                del owners[pos]
        if not owners:
            del self.owners[kid]
        return bool(owners)

    def record_losses(self, gone: list[int], is_live: Callable[[int], bool]) -> None:
        """R1: every owner of a key the CPU no longer holds gets a lost record, when the key is
        live (records already pending are kept). O(owners of the keys)."""
        for kid in [kid for kid in gone if kid in self.owners]:
            if is_live(kid):
                for pos in self.owners[kid]:
                    self.lost.setdefault(pos, kid)

    def forget_retired(self, gone: list[int]) -> None:
        """Evicted keys leave the retired list (nothing is left to take). O(len)."""
        if self.retired:
            for kid in self.retired.keys() & set(gone):
                del self.retired[kid]

    def retire(self, kid: int) -> None:
        """R7 (b): ``kid`` may be taken as a victim, after the keys retired before it. O(1)."""
        self.retired[kid] = None

    def drop_request(self, rid: str, covered: Callable[[int], bool]) -> None:
        """The request owns nothing any more: drop its records and window floors, retire its
        ``covered`` keys. O(records + its keys)."""
        for pos in [p for p in self.lost if p[0] == rid]:
            del self.lost[pos]
        for kid in self.owned_keys.pop(rid, []):
            if covered(kid):  # cached, or cached when its store completes
                self.retire(kid)
        for rg in [rg for rg in self.window_floor if rg[0] == rid]:
            del self.window_floor[rg]

    def clear(self) -> None:
        self.owners.clear()
        self.lost.clear()
        self.owned_keys.clear()
        self.window_floor.clear()
        self.retired.clear()

    def _check(self, num_groups: int) -> None:
        """Every key id is >= 0 and every position's key belongs to the position's group; no key
        keeps an empty owner list; floors and positions are >= 0. O(entries)."""
        for kid, owners in self.owners.items():
            assert owners, f"key {kid}: empty owner list"
            for rid, g, p in owners:
                assert kid >= 0 and kid % num_groups == g and p >= 0, f"key {kid} indexes ({rid}, {g}, {p})"
        for (rid, g, p), kid in self.lost.items():
            assert kid >= 0 and kid % num_groups == g and p >= 0, f"lost record ({rid}, {g}, {p}) under {kid}"
        for rid, kids in self.owned_keys.items():
            assert all(k >= 0 for k in kids), f"{rid}: owned key < 0"
        assert all(k >= 0 for k in self.retired), "retired key < 0"
        for (rid, g), floor in self.window_floor.items():
            assert 0 <= g < num_groups and floor >= 0, f"{rid}: window floor {floor} of group {g}"
