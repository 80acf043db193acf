"""The second manager's driver: vLLM's connector around an ``OffloadingManagerTarget``.

One operation is one manager call, as JSON (the trace format's operation lines):

    {"op": "new", "req": R}                          on_new_request
    {"op": "positions", "req": R, "keys": [[h, g, p], ...]}   set_key_positions
    {"op": "lookup", "req": R, "keys": [[h, g], ...]}  lookup of each key in turn, stopping at
                                                       the first that is not a HIT (the
                                                       connector counts consecutive hits)
    {"op": "load", "req": R, "keys": [...]}            prepare_load
    {"op": "load_done", "req": R, "keys": [...]}       complete_load
    {"op": "touch", "req": R, "keys": [...]}           touch
    {"op": "store", "req": R, "keys": [...]}           prepare_store
    {"op": "store_done", "req": R, "keys": [...], "success": bool}   complete_store
    {"op": "finish", "req": R}                         on_request_finished
    {"op": "reset"}                                    reset_cache

``Driver`` applies operations to a target and keeps what an oracle may use: what it
*observed* (the loads and stores it has in flight, from its own calls and the target's
outputs; the last call's inputs, outputs and the snapshot before it), never the target's
account of itself. ``snapshot()`` is the target's snapshot plus that ``observed`` section;
the catalogue's O-invariants are functions of it.

``Generator`` draws the next operation the way vLLM's connector would make one: loads only
of keys a lookup just found ready, completions only of transfers in flight, stores of a
request's keys in prefix order (offering again keys already cached, as the connector does),
no transfer completed across a reset (vLLM's connector drops pre-reset completions), no call
for a finished request but completions. It reads only the target's outputs.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvspec.contract.errors import InvalidOperationError
from kvspec.contract.offloading import OffloadingConfig, OffloadingManagerTarget, OffloadKey, key_text

OPS = ("new", "positions", "lookup", "load", "load_done", "touch", "store", "store_done", "finish", "reset")
BLOCK_SIZE = 16


def _keys(raw: object) -> list[OffloadKey]:
    if not isinstance(raw, list):
        raise InvalidOperationError(f"keys must be a list of [hash, group], got {raw!r:.60}")
    out = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 2:
            raise InvalidOperationError(f"a key is [hash, group], got {item!r:.60}")
        out.append((item[0], item[1]))
    return out


def _positions(raw: object) -> list[tuple[OffloadKey, int]]:
    if not isinstance(raw, list):
        raise InvalidOperationError(f"positions must be a list of [hash, group, end token], got {raw!r:.60}")
    out = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 3:
            raise InvalidOperationError(f"a position is [hash, group, end token], got {item!r:.60}")
        out.append(((item[0], item[1]), item[2]))
    return out


def _as_json(keys: list[OffloadKey]) -> list[list[Any]]:
    return [[h, g] for h, g in keys]


@dataclass
class Observed:
    """What the driver saw: transfers in flight by its own calls, and the last call."""

    loads: Counter[OffloadKey] = field(default_factory=Counter)  # key -> loads in flight
    stores: set[OffloadKey] = field(default_factory=set)  # keys returned by prepare_store, not completed
    last: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"loads": {key_text(k): n for k, n in sorted(self.loads.items()) if n},
                "stores": sorted(key_text(k) for k in self.stores),
                "last": self.last}


class Driver:
    """Applies operations to one target and records what it observes."""

    def __init__(self, target: OffloadingManagerTarget) -> None:
        self.target = target
        self.observed = Observed()

    def apply(self, op: dict[str, Any]) -> Any:
        """Run ``op`` on the target; its result (JSON). A ``KVSpecError`` is a refusal and
        leaves the observations unchanged; anything else the target raises propagates."""
        if not isinstance(op, dict) or op.get("op") not in OPS:
            raise InvalidOperationError(f"unknown operation {op!r:.80}; known: {', '.join(OPS)}")
        kind = op["op"]
        unknown = set(op) - {"op", "req", "keys", "success"}
        if unknown:
            raise InvalidOperationError(f"operation {kind!r}: unknown field {sorted(unknown)[0]!r}")
        t = self.target
        req = op.get("req", "")
        if kind == "reset":
            t.reset_cache()
            self.observed = Observed(last={"op": "reset"})
            return None
        if kind == "new":
            t.on_new_request(req)
            self.observed.last = {"op": "new"}
            return None
        if kind == "finish":
            t.on_request_finished(req)
            self.observed.last = {"op": "finish"}
            return None
        if kind == "positions":
            t.set_key_positions(req, _positions(op.get("keys")))
            self.observed.last = {"op": "positions"}
            return None
        keys = _keys(op.get("keys"))
        if kind == "lookup":
            results: list[str] = []
            for key in keys:
                results.append(t.lookup(req, key))
                if results[-1] != "HIT":
                    break
            answered = {key_text(k): r for k, r in zip(keys, results, strict=False)}
            self.observed.last = {"op": "lookup", "results": answered}
            return results
        if kind == "load":
            chunk_ids = t.prepare_load(req, keys)
            self.observed.loads.update(keys)
            self.observed.last = {"op": "load"}
            return chunk_ids
        if kind == "load_done":
            missing = [k for k in keys if self.observed.loads[k] <= 0]
            if missing:
                raise InvalidOperationError(f"load_done: no load of {key_text(missing[0])} is in flight")
            t.complete_load(req, keys)
            self.observed.loads.subtract(keys)
            self.observed.last = {"op": "load_done"}
            return None
        if kind == "touch":
            t.touch(req, keys)
            self.observed.last = {"op": "touch"}
            return None
        if kind == "store":
            return self._store(req, keys)
        return self._store_done(req, keys, op.get("success", True))

    def _store(self, req: str, keys: list[OffloadKey]) -> dict[str, Any] | None:
        pre = self.target.snapshot()
        out = self.target.prepare_store(req, keys)
        self.observed.last = {"op": "store", "offered": [key_text(k) for k in keys],
                              "pre_chunks": pre["chunks"], "pre_order": _order(pre), "failed": out is None}
        if out is None:
            return None
        self.observed.stores.update(out.keys_to_store)
        self.observed.last |= {"stored": [key_text(k) for k in out.keys_to_store], "chunk_ids": list(out.chunk_ids),
                               "evicted": [key_text(k) for k in out.evicted_keys]}
        return {"keys_to_store": _as_json(out.keys_to_store), "chunk_ids": list(out.chunk_ids),
                "evicted_keys": _as_json(out.evicted_keys)}

    def _store_done(self, req: str, keys: list[OffloadKey], success: Any) -> None:
        missing = [k for k in keys if k not in self.observed.stores]
        if missing:
            raise InvalidOperationError(f"store_done: no store of {key_text(missing[0])} is in flight")
        self.target.complete_store(req, keys, success)
        self.observed.stores.difference_update(keys)
        self.observed.last = {"op": "store_done", "success": success}

    def snapshot(self) -> dict[str, Any]:
        snap = self.target.snapshot()
        snap["observed"] = self.observed.to_json()
        return snap


def _order(snap: dict[str, Any]) -> list[str] | None:
    lru = snap["policy"].get("lru")
    return None if lru is None else list(lru["order"])


# -- the generator ------------------------------------------------------------------------------


@dataclass
class _Req:
    keys: list[OffloadKey]  # prefix order, groups interleaved per block
    positions: dict[OffloadKey, int]
    stored_upto: int = 0  # blocks offered for storing so far
    finished: bool = False
    loads: list[list[OffloadKey]] = field(default_factory=list)  # load jobs in flight
    stores: list[list[OffloadKey]] = field(default_factory=list)  # store jobs in flight


def random_offloading_config(rng: random.Random) -> OffloadingConfig:
    """Small pools (evictions early), both policies, the store threshold one time in four."""
    threshold = 2 if rng.random() < 0.25 else 1
    return OffloadingConfig(num_chunks=rng.randint(2, 12), policy=rng.choice(("lru", "arc")),
                            store_threshold=threshold,
                            max_tracker_size=rng.choice((3, 6, 64_000)) if threshold > 1 else 64_000)


class Generator:
    """Draws operations as vLLM's connector makes them (module docstring), from what the
    target answered; ``feed`` tells it each operation's result."""

    def __init__(self, rng: random.Random, num_groups: int | None = None, families: int | None = None) -> None:
        self.rng = rng
        self.num_groups = num_groups or rng.choice((1, 1, 2))
        self.families = families or rng.randint(1, 4)
        self.reqs: dict[str, _Req] = {}
        self.serial = 0
        self.hits: tuple[str, list[OffloadKey]] | None = None  # the last lookup's HIT prefix

    def _new_request(self) -> list[dict[str, Any]]:
        self.serial += 1
        rid = f"r{self.serial}"
        fam = self.rng.randrange(self.families)
        n = self.rng.randint(1, 6)
        keys: list[OffloadKey] = []
        positions: dict[OffloadKey, int] = {}
        for i in range(n):
            for g in range(self.num_groups):
                key = (f"f{fam}b{i}", g)
                keys.append(key)
                positions[key] = (i + 1) * BLOCK_SIZE
        self.reqs[rid] = _Req(keys, positions)
        ops: list[dict[str, Any]] = [{"op": "new", "req": rid}]
        if self.rng.random() < 0.9:  # the connector declares positions; sometimes a key has none
            declared = [k for k in keys if self.rng.random() < 0.95]
            ops.append({"op": "positions", "req": rid, "keys": [[h, g, positions[(h, g)]] for h, g in declared]})
        return ops

    def next_ops(self) -> list[dict[str, Any]]:
        """One or two operations (a new request comes with its positions)."""
        rng = self.rng
        if self.hits is not None:
            rid, hits = self.hits
            self.hits = None
            if hits and not self.reqs[rid].finished and rng.random() < 0.8:
                cut = rng.randint(1, len(hits))
                self.reqs[rid].loads.append(hits[:cut])
                return [{"op": "load", "req": rid, "keys": _as_json(hits[:cut])}]
        active = [r for r, q in self.reqs.items() if not q.finished]
        loading = [r for r, q in self.reqs.items() if q.loads]
        storing = [r for r, q in self.reqs.items() if q.stores]
        choices: list[tuple[float, str]] = [(1.0 if len(active) < 4 else 0.2, "new")]
        if active:
            choices += [(1.5, "lookup"), (3.0, "store"), (0.4, "touch"), (0.6, "finish")]
        if loading:
            choices.append((1.5, "load_done"))
        if storing:
            choices.append((2.5, "store_done"))
        choices.append((0.05, "reset"))
        kind = rng.choices([c for _, c in choices], weights=[w for w, _ in choices])[0]
        if kind == "new":
            return self._new_request()
        if kind == "reset":
            for q in self.reqs.values():
                q.loads.clear()
                q.stores.clear()
            return [{"op": "reset"}]
        if kind == "load_done":
            rid = rng.choice(loading)
            return [{"op": "load_done", "req": rid, "keys": _as_json(self.reqs[rid].loads.pop(0))}]
        if kind == "store_done":
            rid = rng.choice(storing)
            q = self.reqs[rid]
            job = q.stores.pop(rng.randrange(len(q.stores)))
            return [{"op": "store_done", "req": rid, "keys": _as_json(job), "success": rng.random() < 0.9}]
        rid = rng.choice(active)
        q = self.reqs[rid]
        if kind == "finish":
            q.finished = True
            return [{"op": "finish", "req": rid}]
        if kind == "lookup":
            return [{"op": "lookup", "req": rid, "keys": _as_json(q.keys)}]
        if kind == "touch":
            lo = rng.randrange(len(q.keys))
            return [{"op": "touch", "req": rid, "keys": _as_json(q.keys[lo:lo + rng.randint(1, 4)])}]
        return [self._store_op(rid)]

    def _store_op(self, rid: str) -> dict[str, Any]:
        """The next blocks in prefix order; sometimes from the start again (prefix hits offered
        again), sometimes from anywhere (a sliding-window backfill)."""
        rng, q, g = self.rng, self.reqs[rid], self.num_groups
        blocks = len(q.keys) // g
        roll = rng.random()
        if roll < 0.15:
            lo = 0
        elif roll < 0.25:
            lo = rng.randrange(blocks)
        else:
            lo = min(q.stored_upto, blocks - 1)
        hi = min(blocks, lo + rng.randint(1, 3))
        q.stored_upto = max(q.stored_upto, hi)
        return {"op": "store", "req": rid, "keys": _as_json(q.keys[lo * g:hi * g])}

    def feed(self, op: dict[str, Any], result: Any) -> None:
        """What the target answered to ``op``: lookup hits and the keys a store must complete."""
        if op["op"] == "lookup":
            keys = _keys(op["keys"])
            hits = [k for k, r in zip(keys, result, strict=False) if r == "HIT"]
            self.hits = (op["req"], hits)
        elif op["op"] == "store" and result is not None and result["keys_to_store"]:
            self.reqs[op["req"]].stores.append([(h, g) for h, g in result["keys_to_store"]])

