"""The invariant catalogue: stable ids, each a function of a snapshot.

One catalogue checks the model, the implementation, a replayed trace and any
engine that can write a snapshot (``kvspec check-snapshot``). A snapshot has the
sections ``gpu_pool``, ``cpu_pool``, ``scheduler`` and, when an engine model (or an
engine's own dump) supplies it, ``engine``; invariants that need the engine's view
are skipped without it (``Invariant.needs_engine``).

Ids I1-I15 follow docs/vllm-semantics.md §12.1; C1 is its completeness property;
C2-C4 are the properties of the ``repair`` policy (policy issue). Every violation
names its id and the blocks or requests involved.

The catalogue covers two managers, and a snapshot says which it holds (``manager``; absent in
the first manager's snapshots): ``simple`` (SimpleCPUOffload, the ids above, ``CATALOGUE``)
and ``offloading`` (the OffloadingConnector's ``CPUOffloadingManager``, ids O1-O10,
``OFFLOADING_CATALOGUE``; SPEC.md §9 puts the two side by side and names the invariants of
one that mean the same as the other's). Ids are unique across both; ``check`` judges a
snapshot with its own manager's invariants only and refuses an id of the other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from kvspec.contract.errors import ConfigError
from kvspec.model.rules import window_floor

Snapshot = dict[str, Any]

@dataclass(frozen=True)
class Violation:
    id: str
    message: str
    blocks: tuple[int, ...] = ()
    requests: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = []
        if self.requests:
            where.append("requests " + ",".join(self.requests))
        if self.blocks:
            where.append("blocks " + ",".join(map(str, self.blocks)))
        return f"{self.id}: {self.message}" + (f" [{'; '.join(where)}]" if where else "")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "message": self.message, "blocks": list(self.blocks),
                "requests": list(self.requests)}


@dataclass(frozen=True)
class Invariant:
    id: str
    title: str
    statement: str
    fn: Callable[[Snapshot], list[Violation]]
    needs_engine: bool = False
    enforced_by: tuple[str, ...] = field(default=("stateful invariant",))
    manager: str = "simple"
    counterpart: str = ""  # for an O-invariant: the first manager's ids that state the same rule


CATALOGUE: dict[str, Invariant] = {}  # the first manager's (SimpleCPUOffload)
OFFLOADING_CATALOGUE: dict[str, Invariant] = {}  # the second manager's (CPUOffloadingManager)
CATALOGUES: dict[str, dict[str, Invariant]] = {"simple": CATALOGUE, "offloading": OFFLOADING_CATALOGUE}


def invariant(id_: str, title: str, needs_engine: bool = False,
              enforced_by: tuple[str, ...] = ("stateful invariant",), manager: str = "simple",
              counterpart: str = "") -> Callable[..., Any]:
    """Register ``fn`` under ``id_`` in ``manager``'s catalogue; its docstring is the statement."""

    def wrap(fn: Callable[[Snapshot], Iterable[Violation]]) -> Callable[[Snapshot], Iterable[Violation]]:
        assert all(id_ not in cat for cat in CATALOGUES.values()), f"invariant id {id_} registered twice"
        CATALOGUES[manager][id_] = Invariant(id_, title, (fn.__doc__ or "").strip(), lambda s: list(fn(s)),
                                             needs_engine, enforced_by, manager, counterpart)
        return fn

    return wrap


def manager_of(snapshot: Snapshot) -> str:
    """Which manager a snapshot holds: its ``manager`` field, ``simple`` when absent."""
    return str(snapshot.get("manager", "simple"))


def check(snapshot: Snapshot, ids: Iterable[str] | None = None) -> list[Violation]:
    """All violations of the chosen invariants (all of the snapshot's manager by default)."""
    catalogue = CATALOGUES.get(manager_of(snapshot))
    if catalogue is None:
        raise ConfigError(f"snapshot of unknown manager {manager_of(snapshot)!r:.40}; known: {', '.join(CATALOGUES)}")
    out: list[Violation] = []
    has_engine = ("observed" if catalogue is OFFLOADING_CATALOGUE else "engine") in snapshot
    for id_ in ids if ids is not None else catalogue:
        inv = catalogue.get(id_)
        if inv is None:
            raise ConfigError(f"invariant {id_} is not one of the {manager_of(snapshot)} manager's")
        if inv.needs_engine and not has_engine:
            continue
        out.extend(inv.fn(snapshot))
    return out


# -- helpers ---------------------------------------------------------------------------------


def _pools(s: Snapshot) -> list[tuple[str, dict[str, Any]]]:
    return [("gpu", s["gpu_pool"]), ("cpu", s["cpu_pool"])]


def _live_store_transfers(sched: dict[str, Any]) -> list[tuple[str, dict[str, list[int]]]]:
    """Store transfers not yet completed and not abandoned: events, then queued flushes."""
    out = [(f"event {e}", t) for e, t in sched["store_events"].items()]
    out += [(f"flush {i}", t) for i, t in enumerate(sched["pending_finished_stores"])]
    return out


def _all_store_transfers(sched: dict[str, Any]) -> list[tuple[str, dict[str, list[int]]]]:
    out = _live_store_transfers(sched)
    out += [(f"abandoned event {e}", t) for e, t in sched["abandoned_store_events"].items()]
    return out


def _live_stores(sched: dict[str, Any]) -> list[dict[str, list[int]]]:
    """The live store transfers, unlabelled: what a check iterates (a violation's message takes
    its label from ``_live_store_transfers``, which formats one per transfer). O(transfers)."""
    return [*sched["store_events"].values(), *sched["pending_finished_stores"]]


def _all_stores(sched: dict[str, Any]) -> list[dict[str, list[int]]]:
    """``_live_stores`` and the abandoned store events, unlabelled. O(transfers)."""
    return [*sched["store_events"].values(), *sched["pending_finished_stores"],
            *sched["abandoned_store_events"].values()]


def _load_transfers(sched: dict[str, Any]) -> list[dict[str, Any]]:
    """The loads, pending and abandoned, without their requests. O(loads)."""
    return [*sched["reqs_to_load"].values(), *sched["abandoned_reqs_to_load"].values()]


def _loads(sched: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return list(sched["reqs_to_load"].items()) + list(sched["abandoned_reqs_to_load"].items())


def _hash_of(key_text: str | None) -> str | None:
    return None if key_text is None else key_text.rpartition(":")[0]


def _active_store_requests(s: Snapshot) -> Iterable[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(rid, store state, engine request) for requests with live, unfinished store state."""
    reqs = s["engine"]["requests"]
    for rid, st in s["scheduler"]["reqs_to_store"].items():
        r = reqs.get(rid)
        if st["finished"] or r is None or r["status"] == "finished":
            continue
        yield rid, st, r


def _floor(groups: list[dict[str, Any]], g: int, r: dict[str, Any], block_size: int) -> int:
    """First position of group ``g`` still in the window of request ``r`` (0 for full attention)."""
    if g < len(groups) and groups[g]["kind"] == "sliding":
        return window_floor(r["num_computed_tokens"], r["num_output_placeholders"], groups[g]["sliding_window"],
                            block_size)
    return 0


def owned_below_cursor(s: Snapshot) -> Iterable[tuple[str, int, int, int, str]]:
    """(rid, group, position, block, key) for every position below a live cursor whose
    block the request still owns (its live table holds it) and that is hashed. A
    sliding-window position that has left the window of the confirmed tokens (below
    ``(computed - placeholders - window + 1) // block_size``, ``rules.window_floor``) is not
    owned, even before the scheduler's next ``remove_skipped_blocks`` frees it: the request
    never reads it again. Placeholders do not count: speculative drafts among them may be
    rejected, and the rejection brings positions back into the window."""
    gpu_hash = s["gpu_pool"]["block_hash"]
    groups = s["engine"]["config"]["groups"]
    bs = _block_size(s)
    for rid, st, r in _active_store_requests(s):
        hashes = r["block_hashes"]
        for g, cursor in enumerate(st["num_stored_blocks"]):
            table = r["table"][g] if g < len(r["table"]) else []
            for p in range(_floor(groups, g, r, bs), min(cursor, len(table))):
                b = table[p]
                key = gpu_hash[b] if b != 0 else None
                if key is not None and key.rpartition(":")[0] == (hashes[p] if p < len(hashes) else None):
                    yield rid, g, p, b, key


def covered_keys(s: Snapshot) -> set[str]:
    """Keys cached on CPU or being stored by a live transfer."""
    gpu_hash = s["gpu_pool"]["block_hash"]
    keys = set(s["cpu_pool"]["cached"])
    for t in _live_stores(s["scheduler"]):
        keys.update(gpu_hash[g] for g in t["gpu"] if gpu_hash[g] is not None)
    return keys


def observe_plan(pre: Snapshot, post: Snapshot, copies: list[int], finishing: str | None = None) -> dict[str, Any]:
    """What one planning step (or finish flush) did, measured from outside the policy: the facts
    C3, C5 and C6 judge, kept in the engine section as ``last_plan``.

    ``pre`` is the engine snapshot just before the target planned, ``post`` the target's snapshot
    just after, ``copies`` the GPU ids of the store copies this plan ordered (from the connector
    metadata or the queued flush), ``finishing`` the request whose finish flush this is. A copy is
    *new work* when some active request holds its block at or after its cursor (the cursor before
    the step, or after it when the step reset it); a copy of a block some active request holds
    only below its cursor is a *re-store*; the rest (blocks no request holds, e.g. a stale
    sliding-window id) count with new work. Ambiguous copies count as new work, so these facts
    can miss a bug but never invent one. A position is
    *passed* when a cursor moved over it in the step, or, for a finish flush (which moves no
    cursor), when the flush copied a later position of the same group.
    O(requests x table + CPU map + copies)."""
    seen = _plan_positions(pre, post, set(copies), finishing)
    gpu_hash = pre["gpu_pool"]["block_hash"]
    owners: dict[str, list[tuple[str, int, int]]] = {}
    for rid, g, p, _, key in owned_below_cursor(pre):
        owners.setdefault(key, []).append((rid, g, p))
    covered_before, covered_after = covered_keys(pre), covered_keys(post)
    evicted = set(pre["cpu_pool"]["cached"]) - set(post["cpu_pool"]["cached"])
    lost = {k for k in owners if k not in covered_before or k in evicted}
    restores = [b for b in copies if b in seen.held and b not in seen.new_work]
    restored_keys = {gpu_hash[b] if gpu_hash[b] is not None else f"(unhashed GPU block {b})" for b in restores}
    reqs = pre["engine"]["requests"]

    def useful(key: str) -> bool:
        """Its chain prefix is still reachable on CPU (or it is a first block)."""
        for rid, g, p in owners[key]:
            if p == 0:
                return True
            parent = f"{reqs[rid]['block_hashes'][p - 1]}:{g}"
            if parent in covered_before and parent not in evicted:
                return True
        return False

    return {
        "copies": len(copies),
        "new_work_copies": len(copies) - len(restores),  # new work and copies of blocks no request holds
        "restore_copies": len(restores),
        "lost_keys": len(lost),
        "unlost_restores": sorted(restored_keys - lost),
        "judged_cached_evicted": sorted({k for k in seen.passed if k in pre["cpu_pool"]["cached"]
                                         and k not in covered_after}),
        "live_useful_evicted": sorted(k for k in evicted if k in owners and useful(k)),
    }


@dataclass
class _PlanPositions:
    """What the active requests' tables say about one plan: the blocks held at or after a cursor
    (``new_work``), every block held (``held``), and the keys of the positions a cursor passed."""

    new_work: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)
    passed: list[str] = field(default_factory=list)


def _plan_positions(pre: Snapshot, post: Snapshot, copied: set[int], finishing: str | None) -> _PlanPositions:
    """``observe_plan``'s walk over the active requests' tables. O(requests x table)."""
    groups, bs = pre["engine"]["config"]["groups"], _block_size(pre)
    before, after = pre["scheduler"]["reqs_to_store"], post["scheduler"]["reqs_to_store"]
    gpu_hash = pre["gpu_pool"]["block_hash"]
    out = _PlanPositions()
    for rid, r in pre["engine"]["requests"].items():
        st, st_after = before.get(rid), after.get(rid)
        if r["status"] == "finished":
            continue
        live_after = st_after is not None and not st_after["finished"]
        for g, table in enumerate(r["table"]):
            cursor = 0 if st is None or st["finished"] else st["num_stored_blocks"][g]
            if live_after:
                cursor = min(cursor, st_after["num_stored_blocks"][g])
            out.new_work.update(b for b in table[cursor:] if b != 0)
            out.held.update(table)
            if st is None or st["finished"]:
                continue
            if rid == finishing:
                end = max((p + 1 for p in range(cursor, len(table)) if table[p] in copied), default=cursor)
            elif live_after:
                end = st_after["num_stored_blocks"][g]
            else:
                continue
            for p in range(max(st["num_stored_blocks"][g], _floor(groups, g, r, bs)),
                           min(end, len(table), len(r["block_hashes"]))):
                b = table[p]
                if b != 0 and gpu_hash[b] == f"{r['block_hashes'][p]}:{g}":
                    out.passed.append(gpu_hash[b])
    return out


# -- I1-I3: pools ----------------------------------------------------------------------------


@invariant("I1", "queue/ref", enforced_by=("model assertion", "stateful invariant", "CrossHair contract"))
def _i1(s: Snapshot) -> Iterable[Violation]:
    """In each pool, a non-null block is in the free queue iff its ref count is 0; ref counts
    are >= 0; the queue holds no block twice; the pool's own free count is the queue's length."""
    for name, p in _pools(s):
        queue = p["free_queue"]
        if "free_count" in p:
            yield Violation("I1", f"{name}: free count {p['free_count']} but {len(queue)} blocks in the free queue")
        queued = set(queue)
        if len(queued) < len(queue):
            for b, n in Counter(queue).items():
                if n > 1:
                    yield Violation("I1", f"{name}: block {b} is queued {n} times", (b,))
        refs = p["ref_cnt"]
        for b in range(1, p["num_blocks"]):
            ref = refs[b]
            if ref < 0:
                yield Violation("I1", f"{name}: block {b} has ref count {ref}", (b,))
            elif (b in queued) != (ref == 0):
                yield Violation("I1", f"{name}: block {b} ref {ref} but {'in' if b in queued else 'not in'} "
                                "the free queue", (b,))


@invariant("I2", "null block", enforced_by=("model assertion", "stateful invariant"))
def _i2(s: Snapshot) -> Iterable[Violation]:
    """The null block 0 is never queued, cached, hashed, referenced, or part of a transfer or pin."""
    for name, p in _pools(s):
        if 0 in p["free_queue"] or p["ref_cnt"][0] != 0 or p["block_hash"][0] is not None:
            yield Violation("I2", f"{name}: null block is queued, referenced or hashed", (0,))
        if any(0 in ids for ids in p["cached"].values()):
            yield Violation("I2", f"{name}: null block is in the prefix map", (0,))
    sched = s["scheduler"]
    if any(0 in t["gpu"] or 0 in t["cpu"] for t in _all_stores(sched)):  # then name them
        for where, t in _all_store_transfers(sched):
            if 0 in t["gpu"] or 0 in t["cpu"]:
                yield Violation("I2", f"null block in store {where}", (0,))
    for rid, ls in _loads(sched):
        if 0 in ls["gpu"] or 0 in ls["cpu"]:
            yield Violation("I2", "null block in a load", (0,), (rid,))


@invariant("I3", "map consistency", enforced_by=("model assertion", "stateful invariant"))
def _i3(s: Snapshot) -> Iterable[Violation]:
    """Every block a map lists carries that key, and is listed once (vLLM's map holds a key's
    blocks by id); a free hashed block is in the map under it; on the CPU a block is hashed iff
    it is in the map, and store destinations are unhashed."""
    for name, p in _pools(s):
        for key, ids in p["cached"].items():
            if len(ids) > 1 and len(set(ids)) < len(ids):
                for b, n in Counter(ids).items():
                    if n > 1:
                        yield Violation("I3", f"{name}: map lists block {b} {n} times under {key}", (b,))
            for b in ids:
                if p["block_hash"][b] != key:
                    yield Violation("I3", f"{name}: map lists block {b} under {key} but it carries "
                                    f"{p['block_hash'][b]}", (b,))
        listed = {b for ids in p["cached"].values() for b in ids}
        hashes = p["block_hash"]
        if len(hashes) - hashes.count(None) == sum(1 for b in listed if 0 <= b < len(hashes) and hashes[b] is not None):
            continue  # every hashed block is listed (counted at C speed): none to name below
        queued = set(p["free_queue"])
        for b, key in enumerate(hashes):
            if key is None or b in listed:
                continue
            if name == "cpu" or b in queued:
                yield Violation("I3", f"{name}: block {b} is hashed {key} but not in the map", (b,))
    cpu_hash = s["cpu_pool"]["block_hash"]
    sched = s["scheduler"]
    if any(cpu_hash[c] is not None for t in _all_stores(sched) for c in t["cpu"]):  # then name them
        for where, t in _all_store_transfers(sched):
            for c in t["cpu"]:
                if cpu_hash[c] is not None:
                    yield Violation("I3", f"store {where}: destination CPU block {c} is already hashed", (c,))


# -- I4-I8: transfers, pins, ref accounting --------------------------------------------------


@invariant("I4", "CPU ref accounting", enforced_by=("model assertion", "stateful invariant"))
def _i4(s: Snapshot) -> Iterable[Violation]:
    """A CPU block's ref count equals its listings as a store destination (pending, queued or
    abandoned) + in loads (including abandoned ones) + in pending pins."""
    sched = s["scheduler"]
    want = Counter([b for pin in sched["pending_cpu_hits"].values() for g in pin["blocks"] for b in g if b != 0])
    for t in (*_all_stores(sched), *_load_transfers(sched)):
        want.update(t["cpu"])
    yield from _ref_accounting("I4", "CPU", s["cpu_pool"]["ref_cnt"], want, "transfers and pins")


@invariant("I5", "GPU ref accounting", needs_engine=True)
def _i5(s: Snapshot) -> Iterable[Violation]:
    """A GPU block's ref count equals the request tables holding it + its listings in store
    transfers (pending, queued, abandoned) + in loads + in the engine's deferred frees (blocks a
    batch in flight still writes)."""
    sched = s["scheduler"]
    # counted at C speed; the null block's count is never compared (``_ref_accounting``)
    want = Counter(chain.from_iterable(t for r in s["engine"]["requests"].values() for t in r["table"]))
    for blocks in s["engine"].get("deferred_frees", ()):
        want.update(blocks)
    for t in (*_all_stores(sched), *_load_transfers(sched)):
        want.update(t["gpu"])
    yield from _ref_accounting("I5", "GPU", s["gpu_pool"]["ref_cnt"], want, "owners and transfers")


def _ref_accounting(id_: str, side: str, ref: list[int], want: Counter[int], owners: str) -> Iterable[Violation]:
    """I4 and I5: every non-null block's ref count is ``want``'s count of it. O(blocks)."""
    expected = [0] * len(ref)
    for b, n in want.items():
        if 0 < b < len(ref):
            expected[b] = n
    if expected[1:] == ref[1:]:  # the common case, compared at C speed
        return
    count = want.get
    for b in range(1, len(ref)):
        if ref[b] != count(b, 0):
            yield Violation(id_, f"{side} block {b} has ref {ref[b]}, {owners} account for {want[b]}", (b,))


@invariant("I6", "in-flight protection", enforced_by=("model assertion", "stateful invariant"))
def _i6(s: Snapshot) -> Iterable[Violation]:
    """Every block of a pending, queued or abandoned transfer has ref >= 1 on its side."""
    sched = s["scheduler"]
    sides = _all_stores(sched) + _load_transfers(sched)
    for t in sides:
        for side, pool in (("gpu", s["gpu_pool"]), ("cpu", s["cpu_pool"])):
            for b in t[side]:
                if pool["ref_cnt"][b] < 1:
                    yield Violation("I6", f"{side.upper()} block {b} is in a transfer with ref 0", (b,))


@invariant("I7", "in-flight set", enforced_by=("model assertion", "stateful invariant"))
def _i7(s: Snapshot) -> Iterable[Violation]:
    """Eager mode: the in-flight GPU set equals the GPU ids of live store transfers (an id listed
    in two live transfers may leave early). Lazy mode keeps it empty."""
    sched = s["scheduler"]
    listed: Counter[int] = Counter()
    for t in _live_stores(sched):
        listed.update(set(t["gpu"]))
    in_flight = set(sched["in_flight"])
    if sched["lazy"]:
        if in_flight:
            yield Violation("I7", "lazy mode has in-flight ids", tuple(sorted(in_flight)))
        return
    for b in sorted(in_flight - set(listed)):
        yield Violation("I7", f"GPU block {b} is marked in flight but no live store lists it", (b,))
    for b in sorted(set(listed) - in_flight):
        if listed[b] == 1:
            yield Violation("I7", f"GPU block {b} is being stored but not marked in flight", (b,))


@invariant("I8", "no duplicate transfers", enforced_by=("stateful invariant",))
def _i8(s: Snapshot) -> Iterable[Violation]:
    """No GPU id twice in live store transfers (one event or two); no CPU id the destination
    of two stores."""
    sched = s["scheduler"]
    gpu_listed: Counter[int] = Counter()
    for t in _live_stores(sched):
        gpu_listed.update(t["gpu"])
    for b, n in gpu_listed.items():
        if n > 1:
            yield Violation("I8", f"GPU block {b} is listed {n} times in live stores", (b,))
    dests: Counter[int] = Counter()
    for t in _all_stores(sched):
        dests.update(t["cpu"])
    for b, n in dests.items():
        if n > 1:
            yield Violation("I8", f"CPU block {b} is the destination of {n} stores", (b,))


# -- I9-I15: cursors, fidelity, lifecycle ----------------------------------------------------


@invariant("I9", "cursor bounds", enforced_by=("model assertion", "stateful invariant", "Z3 proof"))
def _i9(s: Snapshot) -> Iterable[Violation]:
    """0 <= num_stored_blocks[g] <= len(block_ids[g]) for every request and group."""
    for rid, st in s["scheduler"]["reqs_to_store"].items():
        for g, (c, ids) in enumerate(zip(st["num_stored_blocks"], st["block_ids"], strict=True)):
            if not 0 <= c <= len(ids):
                yield Violation("I9", f"group {g} cursor {c} outside 0..{len(ids)}", (), (rid,))


@invariant("I10", "confirmed-only stores", needs_engine=True, enforced_by=("stateful invariant", "Z3 proof"))
def _i10(s: Snapshot) -> Iterable[Violation]:
    """Every GPU block of a live store event was, when the event was planned, held by a request at
    a position below its confirmed tokens (or held by none and already holding its key's data)."""
    sched, eng = s["scheduler"], s["engine"]
    for e, flags in eng["store_selection_confirmed"].items():
        t = sched["store_events"].get(e)
        if t is None:
            continue
        for g, ok in zip(t["gpu"], flags, strict=True):
            if not ok:
                yield Violation("I10", f"store event {e} planned GPU block {g}, which no request had "
                                "confirmed", (g,))


@invariant("I11", "hash fidelity", needs_engine=True)
def _i11(s: Snapshot) -> Iterable[Violation]:
    """A CPU block cached under a key holds the data of that key."""
    data = s["engine"]["cpu_data"]
    for key, ids in s["cpu_pool"]["cached"].items():
        for b in ids:
            if data[b] != _hash_of(key):
                yield Violation("I11", f"CPU block {b} cached as {key} holds data {data[b]}", (b,))


@invariant("I12", "load fidelity", needs_engine=True)
def _i12(s: Snapshot) -> Iterable[Violation]:
    """Each load pair copies a CPU block cached under the request's key for the GPU position,
    into an unhashed GPU block; every computed position of a request whose tokens are known (not
    still in flight as placeholders) holds its key's data."""
    eng, sched = s["engine"], s["scheduler"]
    cpu_hash, gpu_hash = s["cpu_pool"]["block_hash"], s["gpu_pool"]["block_hash"]
    for rid, ls in sched["reqs_to_load"].items():
        r = eng["requests"].get(rid)
        if r is None or r["status"] == "finished":
            continue
        for gb, cb in zip(ls["gpu"], ls["cpu"], strict=True):
            pos = [(g, t.index(gb)) for g, t in enumerate(r["table"]) if gb in t]
            want = {(r["block_hashes"][p], g) for g, p in pos if p < len(r["block_hashes"])}
            got = cpu_hash[cb]
            if got is None or (_hash_of(got), int(got.rpartition(":")[2])) not in want:
                yield Violation("I12", f"load CPU {cb} ({got}) -> GPU {gb} does not match the position's key",
                                (gb, cb), (rid,))
            if gpu_hash[gb] is not None:
                yield Violation("I12", f"load destination GPU {gb} is already hashed {gpu_hash[gb]}", (gb,), (rid,))
    bs = _block_size(s)
    groups = eng["config"]["groups"]
    for rid, r in eng["requests"].items():
        if r["status"] not in ("running", "loaded"):
            continue
        for g, table in enumerate(r["table"]):
            # positions outside the window are neither loaded nor read
            for p in range(_floor(groups, g, r, bs), min(r["num_computed_tokens"] // bs, len(table),
                                                         len(r["block_hashes"]))):
                b = table[p]
                if b != 0 and eng["gpu_data"][b] != r["block_hashes"][p]:
                    yield Violation("I12", f"group {g} position {p}: GPU block {b} holds data "
                                    f"{eng['gpu_data'][b]}, expected {r['block_hashes'][p]}", (b,), (rid,))


def _block_size(s: Snapshot) -> int:
    return int(s["engine"]["config"]["block_size"])


@invariant("I13", "event lifecycle", enforced_by=("model assertion", "stateful invariant"))
def _i13(s: Snapshot) -> Iterable[Violation]:
    """Event ids are below their counters; partial counts stay below world_size and name issued
    events; with an engine, the events the scheduler still holds are exactly those whose
    reports are not all in."""
    sched = s["scheduler"]
    live = set(sched["store_events"]) | set(sched["abandoned_store_events"])
    for e in live:
        if not 0 <= int(e) < sched["store_event_counter"]:
            yield Violation("I13", f"store event {e} is not below the counter {sched['store_event_counter']}")
    for e in sched["load_event_to_reqs"]:
        if not 0 <= int(e) < sched["load_event_counter"]:
            yield Violation("I13", f"load event {e} is not below the counter {sched['load_event_counter']}")
    if "engine" not in s:
        return
    world = int(s["engine"]["config"]["world_size"])
    left = s["engine"]["reports_left"]
    for e in sorted(live - set(left), key=int):
        yield Violation("I13", f"store event {e} has all reports but was not processed")
    for e in sorted(set(left) - live, key=int):
        yield Violation("I13", f"store event {e} was processed before all {world} reports")
    for e, c in sched["store_event_pending_counts"].items():
        if e in left and c != world - left[e]:
            yield Violation("I13", f"store event {e} counts {c} reports, the workers sent {world - left[e]}")


@invariant("I14", "finished requests", needs_engine=True)
def _i14(s: Snapshot) -> Iterable[Violation]:
    """A finished request holds no pin; its store state survives only while marked finished with
    store events outstanding; its load state only while its load is in flight."""
    sched, reqs = s["scheduler"], s["engine"]["requests"]
    for rid, st in sched["reqs_to_store"].items():
        if st["finished"] and not st["store_events"]:
            yield Violation("I14", "finished store state with no events left", (), (rid,))
        if reqs.get(rid, {}).get("status") == "finished" and not st["finished"]:
            yield Violation("I14", "finished request still has live store state", (), (rid,))
    for rid, r in reqs.items():
        if r["status"] != "finished":
            continue
        if rid in sched["pending_cpu_hits"]:
            yield Violation("I14", "finished request still holds a CPU pin", (), (rid,))
        ls = sched["reqs_to_load"].get(rid)
        if ls is not None and ls["load_event"] is None:
            yield Violation("I14", "finished request has an unsent load", (), (rid,))


@invariant("I15", "reset result", needs_engine=True)
def _i15(s: Snapshot) -> Iterable[Violation]:
    """reset() returns True iff no abandoned store or load remains, and then the CPU map is empty."""
    eng, sched = s["engine"], s["scheduler"]
    if eng.get("last_op") != "reset":
        return
    ok = eng["last_result"][1]
    abandoned = bool(sched["abandoned_store_events"] or sched["abandoned_reqs_to_load"])
    if ok == abandoned:
        yield Violation("I15", f"reset returned {ok} with{'' if abandoned else ' no'} abandoned transfers")
    if ok and s["cpu_pool"]["cached"]:
        yield Violation("I15", "reset returned True but the CPU map is not empty")


# -- C1-C4: completeness and the repair policy's properties ----------------------------------


@invariant("C1", "completeness", needs_engine=True, enforced_by=("stateful invariant", "Z3 proof"))
def _c1(s: Snapshot) -> Iterable[Violation]:
    """For an active request and every position below its cursor where it still owns a hashed
    block, that key is cached on CPU or being stored (vLLM 0.33.0 violates this: the FIXME)."""
    covered = covered_keys(s)
    for rid, g, p, b, key in owned_below_cursor(s):
        if key not in covered:
            yield Violation("C1", f"group {g} position {p}: key {key} is below the cursor, "
                            "neither cached on CPU nor being stored", (b,), (rid,))


@invariant("C2", "completeness modulo pending repair", needs_engine=True,
           enforced_by=("stateful invariant", "Z3 proof"))
def _c2(s: Snapshot) -> Iterable[Violation]:
    """As C1, but a position recorded as lost and pending repair also counts as covered."""
    covered = covered_keys(s)
    pending = {(r, g, p) for r, g, p in s["scheduler"]["policy_state"].get("lost", [])}
    for rid, g, p, b, key in owned_below_cursor(s):
        if key not in covered and (rid, g, p) not in pending:
            yield Violation("C2", f"group {g} position {p}: key {key} is lost and not recorded for repair",
                            (b,), (rid,))


@invariant("C3", "no amplification", needs_engine=True, enforced_by=("stateful invariant", "Z3 proof"))
def _c3(s: Snapshot) -> Iterable[Violation]:
    """Re-store copies planned by a step (or finish flush) never exceed the distinct keys that
    were lost (owned below a live cursor, and not covered before planning or evicted by it),
    each re-stored key was one of them, and no key is being stored twice at once (dedup by
    hash across requests and in-flight stores). Counted by the engine from the copies the
    connector metadata ordered, never from the policy's own counters."""
    plan = s["engine"].get("last_plan")
    if plan:
        if plan["restore_copies"] > plan["lost_keys"]:
            yield Violation("C3", f"{plan['restore_copies']} re-store copies planned for "
                            f"{plan['lost_keys']} lost keys")
        for key in plan["unlost_restores"]:
            yield Violation("C3", f"key {key} was re-stored but was not lost (it was cached or being stored)")
    sched = s["scheduler"]
    gpu_hash = s["gpu_pool"]["block_hash"]
    seen: dict[str, int] = {}
    for t in _live_stores(sched):
        for g in t["gpu"]:
            key = gpu_hash[g]
            if key is not None and seen.setdefault(key, g) != g:
                yield Violation("C3", f"key {key} is being stored from GPU blocks {seen[key]} and {g}",
                                (seen[key], g))


@invariant("C4", "convergence", needs_engine=True)
def _c4(s: Snapshot) -> Iterable[Violation]:
    """After a planning step that began with no transfer or pin outstanding, scheduled no tokens,
    and had CPU capacity >= the live working set, no hole below a cursor remains (C1 holds)."""
    if s["engine"].get("last_op") != "step" or not s["engine"].get("converging_step"):
        return
    for v in _c1(s):
        yield Violation("C4", "hole survived a converging step: " + v.message, v.blocks, v.requests)


@invariant("C5", "same-step protection", needs_engine=True)
def _c5(s: Snapshot) -> Iterable[Violation]:
    """No CPU entry that a planning step (or finish flush) passed over as already cached is
    evicted by that same step's allocations (T3): every owned position a cursor passed in the
    step, or the flush covered, whose key was cached before it is still covered after it."""
    plan = s["engine"].get("last_plan")
    for key in plan["judged_cached_evicted"] if plan else ():
        yield Violation("C5", f"key {key} was passed as already cached and evicted by the same step")


@invariant("C6", "no thrash", needs_engine=True)
def _c6(s: Snapshot) -> Iterable[Violation]:
    """No re-store evicts a live entry whose chain prefix is still reachable on CPU (H6): the live,
    useful entries a step's allocations evicted are at most its new-work copies (each allocation
    evicts at most one entry, and only new work may take a live, useful one)."""
    plan = s["engine"].get("last_plan")
    if plan and len(plan["live_useful_evicted"]) > plan["new_work_copies"]:
        keys = ", ".join(plan["live_useful_evicted"][:4])
        yield Violation("C6", f"{len(plan['live_useful_evicted'])} live, reachable entries evicted ({keys}) "
                        f"with {plan['new_work_copies']} new-work copies: re-stores evicted the rest")


def observe_finish(pre: Snapshot, post: Snapshot, rid: str, keys: list[str]) -> dict[str, Any]:
    """What one finish flush did, measured from outside the policy: the facts C7 and C8 judge, kept
    in the engine section's ``finishes`` (an operation may finish several requests: an abort, or
    every request a step's output stops at ``max_tokens``; each flush is measured right after it,
    before the next can evict what it stored).

    ``pre`` and ``post`` are the target's snapshots just before and just after the connector's
    ``request_finished`` for request ``rid``, ``keys`` the keys the flush had to cover (owned,
    hashed, confirmed positions at or after the cursor, measured by the engine). Facts: ``keys``;
    ``fresh``, those neither cached on CPU nor being stored before the finish; ``unstored``, those
    neither cached nor being stored right after it; ``out_of_space``, whether the flush ran out of
    CPU space (every CPU block still free afterwards holds one of the request's own cached keys,
    which its released pins freed). O(CPU map + live stores)."""
    before, after = covered_keys(pre), covered_keys(post)
    cached = post["cpu_pool"]["cached"]
    return {"rid": rid, "keys": list(keys), "fresh": [k for k in keys if k not in before],
            "unstored": [k for k in keys if k not in after],
            "out_of_space": len(post["cpu_pool"]["free_queue"]) <= sum(1 for k in keys if k in cached)}


def _flush_misses(fin: dict[str, Any], keys: Iterable[str]) -> list[str]:
    """Of ``keys``, those finish ``fin`` left neither cached nor being stored; none when its flush
    ran out of space."""
    unstored = set(fin["unstored"])
    return [] if fin["out_of_space"] else [k for k in keys if k in unstored]


@invariant("C7", "finish flush", needs_engine=True)
def _c7(s: Snapshot) -> Iterable[Violation]:
    """When a request finishes (aborted, or stopped at ``max_tokens`` by a step's output), each
    owned, hashed, confirmed position at or after its cursor is cached on CPU or being stored right
    after its finish flush (#41704), unless the flush ran out of space: every CPU block still free
    afterwards holds one of the request's own cached keys (pins it released)."""
    for fin in s["engine"].get("finishes", ()):
        for key in _flush_misses(fin, fin["keys"]):
            yield Violation("C7", f"finish left confirmed key {key} unstored", (), (fin["rid"],))


@invariant("C8", "finish flush of unstored keys", needs_engine=True)
def _c8(s: Snapshot) -> Iterable[Violation]:
    """When a request finishes, each owned, hashed, confirmed position at or after its cursor whose
    key was neither cached on CPU nor being stored just before the finish is cached or being
    stored right after it (#41704), unless the flush ran out of space (as in C7). Weaker than C7:
    a key the flush found covered and its own allocations then evicted is left to C5 and C7, so
    vLLM 0.33.0, whose flush can evict the request's own entries, keeps this rule."""
    for fin in s["engine"].get("finishes", ()):
        for key in _flush_misses(fin, fin["fresh"]):
            yield Violation("C8", f"finish left confirmed key {key} unstored (not on CPU before the finish)", (),
                            (fin["rid"],))


LOCAL_INVARIANTS = ("I1", "I2", "I3", "I4", "I6", "I7", "I9", "I13")


# -- the second manager: vLLM's CPUOffloadingManager (OffloadingConnector) ----------------------
#
# A snapshot of it (``manager: offloading``) has ``chunks`` (key -> slot and ref count), the
# ``free_list``, ``num_allocated``, the manager's two ``counters``, the ``policy``'s state and,
# from a driver (``kvspec.drivers.offloading``), ``observed``: the loads and stores the driver
# has in flight by its own calls and the last call's inputs and outputs. Invariants that read
# ``observed`` are skipped without it (``needs_engine``: the driver is this manager's engine).


def _refs(s: Snapshot) -> dict[str, int]:
    return {k: c["ref_cnt"] for k, c in s["chunks"].items()}


def _last(s: Snapshot, op: str) -> dict[str, Any] | None:
    last = s["observed"]["last"]
    return last if last.get("op") == op else None


@invariant("O1", "chunk slots", manager="offloading", counterpart="I1, I3",
           enforced_by=("model assertion", "stateful invariant", "Z3 proof"))
def _o1(s: Snapshot) -> Iterable[Violation]:
    """Every slot handed out so far is used by exactly one resident key or is on the free list
    once: resident slots are distinct, free slots are distinct and unused, together they are
    ``0..num_allocated-1``, and ``num_allocated <= num_chunks``."""
    used = Counter(c["chunk"] for c in s["chunks"].values())
    free: Counter[int] = Counter(s["free_list"])
    n = s["num_allocated"]
    if n > s["config"]["num_chunks"]:
        yield Violation("O1", f"{n} slots allocated in a pool of {s['config']['num_chunks']}")
    for slot, k in sorted((used + free).items()):
        if k > 1:
            yield Violation("O1", f"slot {slot} is held {used[slot]} times and free {free[slot]} times", (slot,))
    missing = sorted(set(range(n)) - set(used) - set(free))
    if missing:
        yield Violation("O1", "allocated slots neither used nor free (leaked)", tuple(missing))
    beyond = sorted(b for b in (used + free) if not 0 <= b < n)
    if beyond:
        yield Violation("O1", f"slots outside 0..{n - 1} used or free", tuple(beyond))


@invariant("O2", "ref counts", needs_engine=True, manager="offloading", counterpart="I4, I13",
           enforced_by=("model assertion", "stateful invariant", "Z3 proof"))
def _o2(s: Snapshot) -> Iterable[Violation]:
    """A resident key's ``ref_cnt`` is -1 ("being stored") exactly while a store of it is in
    flight, and otherwise equals the number of its loads in flight (as the driver counts its own
    ``prepare_load`` and ``complete_load`` calls)."""
    loads, stores = s["observed"]["loads"], set(s["observed"]["stores"])
    for key, ref in sorted(_refs(s).items()):
        want = -1 if key in stores else loads.get(key, 0)
        if ref != want:
            what = "a store in flight" if key in stores else f"{want} load(s) in flight"
            yield Violation("O2", f"key {key} has ref_cnt {ref} with {what}")


@invariant("O3", "in-flight protection", needs_engine=True, manager="offloading", counterpart="I6",
           enforced_by=("stateful invariant", "Z3 proof"))
def _o3(s: Snapshot) -> Iterable[Violation]:
    """A key with a load or a store in flight keeps its chunk: nothing being read or written is
    evicted, dropped or handed to another key (#46951)."""
    refs = _refs(s)
    for key in sorted(set(s["observed"]["loads"]) | set(s["observed"]["stores"])):
        if key not in refs:
            yield Violation("O3", f"key {key} lost its chunk while a transfer of it is in flight")


@invariant("O4", "no duplicate stores", needs_engine=True, manager="offloading", counterpart="I8")
def _o4(s: Snapshot) -> Iterable[Violation]:
    """A store allocates only keys it was offered that had no chunk before it, each once, and
    its store spec names the slot each key now holds."""
    last = _last(s, "store")
    if last is None or last["failed"]:
        return
    stored, offered, pre = last["stored"], set(last["offered"]), last["pre_chunks"]
    for key in sorted(k for k, n in Counter(stored).items() if n > 1):
        yield Violation("O4", f"key {key} allocated twice by one store")
    for key in stored:
        if key not in offered:
            yield Violation("O4", f"key {key} allocated but not offered")
        elif key in pre:
            yield Violation("O4", f"key {key} allocated again while it had a chunk (stored twice)")
    for key, slot in zip(stored, last["chunk_ids"], strict=False):
        held = s["chunks"].get(key, {}).get("chunk")
        if held is not None and held != slot:
            yield Violation("O4", f"store spec writes key {key} to slot {slot}, the key holds slot {held}", (slot,))


@invariant("O5", "eviction protection", needs_engine=True, manager="offloading", counterpart="C5")
def _o5(s: Snapshot) -> Iterable[Violation]:
    """A store evicts only keys that were ready and unpinned (``ref_cnt == 0``) before it and that
    it was not offered, and an evicted key has no chunk after it."""
    last = _last(s, "store")
    if last is None or last["failed"]:
        return
    for key in last["evicted"]:
        ref = last["pre_chunks"].get(key, {}).get("ref_cnt")
        if ref != 0:
            yield Violation("O5", f"evicted key {key} had ref_cnt {ref} before the store")
        if key in last["offered"]:
            yield Violation("O5", f"evicted key {key} was offered to the same store")
        if key in s["chunks"]:
            yield Violation("O5", f"evicted key {key} still has a chunk")


@invariant("O6", "no needless eviction", needs_engine=True, manager="offloading", counterpart="C6")
def _o6(s: Snapshot) -> Iterable[Violation]:
    """A store evicts exactly the shortfall: as many keys as it allocated beyond the slots free
    before it. Without a store threshold, it fails only when it must: the shortfall of the keys
    offered without a chunk exceeds the ready, unpinned keys it was not offered."""
    last = _last(s, "store")
    if last is None:
        return
    pre, offered = last["pre_chunks"], set(last["offered"])
    free = s["config"]["num_chunks"] - len(pre)
    if not last["failed"]:
        want = max(0, len(last["stored"]) - free)
        if len(last["evicted"]) != want:
            yield Violation("O6", f"store of {len(last['stored'])} keys with {free} slots free evicted "
                                  f"{len(last['evicted'])}, not {want}")
        return
    if s["config"]["store_threshold"] > 1:
        return
    shortfall = len(offered - set(pre)) - free
    evictable = sum(1 for k, c in pre.items() if c["ref_cnt"] == 0 and k not in offered)
    if shortfall <= evictable:
        yield Violation("O6", f"store failed with a shortfall of {shortfall} and {evictable} evictable keys")


@invariant("O7", "manager counters", manager="offloading", enforced_by=("model assertion", "stateful invariant"))
def _o7(s: Snapshot) -> Iterable[Violation]:
    """The manager's two counters equal what they count: ``evictable`` the resident keys with
    ``ref_cnt == 0``, ``write_pending`` those with ``ref_cnt == -1`` (a drifted count makes
    ``prepare_store`` fail or evict wrongly). Skipped for a manager without them."""
    if s["counters"] is None:  # a vLLM release without these counters
        return
    refs = list(_refs(s).values())
    for name, want in (("evictable", refs.count(0)), ("write_pending", refs.count(-1))):
        if s["counters"][name] != want:
            yield Violation("O7", f"counter {name} is {s['counters'][name]}, the chunks say {want}")


@invariant("O8", "lookup truth", needs_engine=True, manager="offloading", counterpart="I3")
def _o8(s: Snapshot) -> Iterable[Violation]:
    """A lookup answers from the chunk: ``HIT`` for a ready key, ``HIT_PENDING`` for one being
    stored, ``MISS`` for a key without a chunk (what is cached is loadable, nothing else is)."""
    last = _last(s, "lookup")
    if last is None:
        return
    refs = _refs(s)
    for key, got in last["results"].items():
        ref = refs.get(key)
        want = "MISS" if ref is None else ("HIT_PENDING" if ref < 0 else "HIT")
        if got != want:
            yield Violation("O8", f"lookup of {key} answered {got}, the chunk says {want}")


def _key_bytes(text: str) -> bytes:
    h, _, g = text.rpartition(":")
    return h.encode() + int(g).to_bytes(4, "big")


@invariant("O9", "LRU order", manager="offloading")
def _o9(s: Snapshot) -> Iterable[Violation]:
    """Under ``lru``: the eviction order lists exactly the ready, unpinned keys, by
    ``(rank, key bytes)`` (where the manager ranks keys); a store evicts the first keys of the
    order it saw that it was not offered."""
    lru = s["policy"].get("lru")
    if lru is None:
        return
    refs = _refs(s)
    if set(lru["order"]) != {k for k, r in refs.items() if r == 0} or len(lru["order"]) != len(set(lru["order"])):
        yield Violation("O9", "the eviction order is not exactly the keys with ref_cnt 0")
    elif lru["ranks"] is not None and lru["order"] != sorted(lru["order"],
                                                               key=lambda k: (lru["ranks"][k], _key_bytes(k))):
        yield Violation("O9", "the eviction order is not by (rank, key)")
    last = _last(s, "store") if "observed" in s else None
    if last is not None and not last["failed"] and last["pre_order"] is not None:
        head = [k for k in last["pre_order"] if k not in last["offered"]][:len(last["evicted"])]
        if sorted(head) != sorted(last["evicted"]):
            yield Violation("O9", f"store evicted {last['evicted']}, the least recent were {head}")


@invariant("O10", "ARC lists", manager="offloading")
def _o10(s: Snapshot) -> Iterable[Violation]:
    """Under ``arc``: T1 and T2 are disjoint and hold exactly the resident keys; the ghost lists
    B1 and B2 are disjoint, hold no resident key and at most ``num_chunks`` keys each; the
    target size of T1 is in ``[0, num_chunks]``."""
    arc = s["policy"].get("arc")
    if arc is None:
        return
    t1, t2, b1, b2 = (set(arc[n]) for n in ("t1", "t2", "b1", "b2"))
    cap = s["config"]["num_chunks"]
    if t1 & t2 or t1 | t2 != set(s["chunks"]):
        yield Violation("O10", "T1 and T2 are not a partition of the resident keys")
    if b1 & b2 or (b1 | b2) & set(s["chunks"]):
        yield Violation("O10", "a ghost key is in both ghost lists or resident")
    if len(arc["b1"]) > cap or len(arc["b2"]) > cap:
        yield Violation("O10", f"a ghost list holds more than {cap} keys")
    if not 0 <= arc["target_t1_size"] <= cap:
        yield Violation("O10", f"target size {arc['target_t1_size']} outside [0, {cap}]")


# -- the second manager's connector: vLLM's OffloadingConnectorScheduler ---------------------
#
# A snapshot of a real scheduler with the OffloadingConnector (``kvspec.adapters.
# vllm_offloading_connector``) is the connector's manager (``manager: offloading``), ``observed``
# (the keys of the transfer jobs in flight since the last cache reset, so O2 and O3 judge the
# manager as the connector drives it) and ``connector``: the last ``schedule()``'s index
# (``step``), the GPU blocks the pool handed out in it and the requests holding each after it
# (``fresh``), the jobs it issued and flushed, the jobs in flight (issued, not yet reported by
# the workers) with their GPU blocks, CPU chunks and the keys holding those chunks at issue,
# the GPU ref counts, and each request's block table, block positions and block hashes. The
# invariants below read only ``connector`` and are skipped without it.


def _conn(s: Snapshot) -> dict[str, Any] | None:
    conn: dict[str, Any] | None = s.get("connector")
    return conn


def _job_groups(job: dict[str, Any]) -> list[tuple[int, int]]:
    out, start = [], 0
    for g, n in enumerate(job["group_sizes"]):
        out += [(g, b) for b in job["gpu"][start:start + n]]
        start += n
    return out


@invariant("O11", "store sources fenced before reuse", needs_engine=True, manager="offloading", counterpart="I6")
def _o11(s: Snapshot) -> Iterable[Violation]:
    """A GPU block that a store job in flight reads (issued, not reported, not yet flushed) is
    handed out by the GPU pool in a step only if that step's metadata flushes the job (the
    workers copy it before the step's forward pass), or the block goes to the job's own request
    in the step that issued the job (whose forward pass writes it before the store reads it)
    (#46951)."""
    c = _conn(s)
    if c is None:
        return
    step = c["step"]
    for jid, job in sorted(c["jobs"].items(), key=lambda kv: int(kv[0])):
        if job["kind"] != "store" or (job["flushed"] is not None and job["flushed"] <= step):
            continue
        for b in job["gpu"]:
            if str(b) not in c["fresh"]:
                continue
            holders = c["fresh"][str(b)]
            if job["issued"] == step and job["req"] in holders:
                continue
            yield Violation("O11", f"block {b}, read by store job {jid} of {job['req']} in flight and not flushed, "
                                   f"was handed out in step {step} (now held by {','.join(holders) or 'nobody'})",
                            (b,), (job["req"],))


@invariant("O12", "load destinations", needs_engine=True, manager="offloading", counterpart="I12")
def _o12(s: Snapshot) -> Iterable[Violation]:
    """A load job writes only blocks of its own request's table (in the job's group), each
    once, none in another unfinished request's table; while it is in flight and not flushed,
    each of them stays allocated (GPU ref count > 0) and is handed to no other request."""
    c = _conn(s)
    if c is None:
        return
    reqs = c["requests"]
    for jid in c["issued"]:
        job = c["jobs"].get(str(jid))
        if job is None or job["kind"] != "load":
            continue
        rid = job["req"]
        table = reqs[rid]["table"]
        for b in sorted(b for b, n in Counter(job["gpu"]).items() if n > 1):
            yield Violation("O12", f"load job {jid} writes block {b} twice", (b,), (rid,))
        for g, b in _job_groups(job):
            if g >= len(table) or b not in table[g]:
                yield Violation("O12", f"load job {jid} of {rid} writes block {b}, not in its group-{g} table",
                                (b,), (rid,))
            others = sorted(o for o, r in reqs.items() if o != rid and not r["finished"]
                            and any(b in t for t in r["table"]))
            if others:
                yield Violation("O12", f"load job {jid} of {rid} writes block {b}, held by {','.join(others)}",
                                (b,), (rid, *others))
    for jid, job in sorted(c["jobs"].items(), key=lambda kv: int(kv[0])):
        if job["kind"] != "load" or job["flushed"] is not None:
            continue
        for b in job["gpu"]:
            if c["gpu_refs"][b] <= 0:
                yield Violation("O12", f"block {b} freed while load job {jid} of {job['req']} writes it",
                                (b,), (job["req"],))
            others = sorted(set(c["fresh"].get(str(b), ())) - {job["req"]})
            if others:
                yield Violation("O12", f"block {b} handed to {','.join(others)} while load job {jid} of "
                                       f"{job['req']} writes it", (b,), (job["req"],))


@invariant("O13", "transfer chunks keyed", needs_engine=True, manager="offloading", counterpart="I3")
def _o13(s: Snapshot) -> Iterable[Violation]:
    """Every CPU chunk of a job a step issues is held by a key of the manager when the step ends
    (a load reads a resident key's chunk, a store writes the chunk of the key it allocated), and
    the job's chunks are distinct."""
    c = _conn(s)
    if c is None:
        return
    for jid in c["issued"]:
        job = c["jobs"].get(str(jid))
        if job is None:
            continue
        for chunk, key in zip(job["chunks"], job["keys"], strict=True):
            if key is None:
                yield Violation("O13", f"{job['kind']} job {jid} of {job['req']} names chunk {chunk}, held by no key",
                                (chunk,), (job["req"],))
        for chunk in sorted(ch for ch, n in Counter(job["chunks"]).items() if n > 1):
            yield Violation("O13", f"{job['kind']} job {jid} names chunk {chunk} twice", (chunk,), (job["req"],))


def _fidelity(id_: str, c: dict[str, Any], kind: str, current_table: bool) -> Iterable[Violation]:
    """The keys of each issued ``kind`` job are exactly the request's block hashes at the
    positions of its GPU blocks (one block per chunk)."""
    if c["blocks_per_chunk"] != 1:
        return
    for jid in c["issued"]:
        job = c["jobs"].get(str(jid))
        if job is None or job["kind"] != kind or None in job["keys"]:
            continue
        rid = job["req"]
        req = c["requests"][rid]
        want: list[str] = []
        for g, b in _job_groups(job):
            if current_table:
                table = req["table"][g] if g < len(req["table"]) else []
                pos = table.index(b) if b in table else None
            else:
                pos = req["positions"].get(str(g), {}).get(str(b))
            if pos is None:
                yield Violation(id_, f"{kind} job {jid} of {rid}: block {b} is not in its group-{g} table",
                                (b,), (rid,))
                return
            if pos >= len(req["hashes"]):
                yield Violation(id_, f"{kind} job {jid} of {rid}: block {b} at position {pos} is not full",
                                (b,), (rid,))
                return
            want.append(f"{req['hashes'][pos]}:{g}")
        if sorted(want) != sorted(job["keys"]):
            yield Violation(id_, f"{kind} job {jid} of {rid} pairs its blocks with keys {sorted(job['keys'])}, "
                                 f"the blocks' positions hold {sorted(want)}", tuple(job["gpu"]), (rid,))


@invariant("O14", "store fidelity", needs_engine=True, manager="offloading", counterpart="I10")
def _o14(s: Snapshot) -> Iterable[Violation]:
    """A store job stores under each key the GPU block at that key's position in its request
    (the key is the request's block hash there and the block's group): the keys of its chunks
    are exactly the hashes at the positions its source blocks last held in the request's table
    (one GPU block per chunk)."""
    c = _conn(s)
    if c is not None:
        yield from _fidelity("O14", c, "store", current_table=False)


@invariant("O15", "load fidelity and reset flush", needs_engine=True, manager="offloading", counterpart="I12")
def _o15(s: Snapshot) -> Iterable[Violation]:
    """A load job writes each key into the block at that key's position in its request's table
    (one GPU block per chunk). After a reset of the connector's cache, the first metadata flushes
    every job that was in flight at the reset (the workers may still write chunks the reset
    freed)."""
    c = _conn(s)
    if c is None:
        return
    yield from _fidelity("O15", c, "load", current_table=True)
    missing = sorted(set(c["reset_unflushed"]) - set(c["flush"]))
    if missing:
        yield Violation("O15", f"jobs {missing} in flight at the cache reset are not flushed by step {c['step']}")


# The connector-level invariants: judged only on snapshots of vLLM's real scheduler and connector
# (a ``connector`` section), tested by breaking such snapshots in tests/test_vllm_offloading_connector.py.
CONNECTOR_INVARIANTS = ("O11", "O12", "O13", "O14", "O15")
# The manager-level ones: what a snapshot of the manager alone (a driver's) is judged by.
MANAGER_INVARIANTS = tuple(i for i in OFFLOADING_CATALOGUE if i not in CONNECTOR_INVARIANTS)
