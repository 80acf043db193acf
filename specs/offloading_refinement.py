"""Refinement for the second manager: every driver operation on the model is a run of the
transitions of ``offloading_encoding.py``, and every state on the way meets the proved invariant.

* **The abstraction** ``abstract(snapshot, keys)`` maps a driver snapshot
  (``Driver(...).snapshot()``: the manager's canonical snapshot plus ``observed``) to a
  concrete ``OState``: per key (numbered in order of appearance by ``keys``, a ``KeyNumbers``
  kept for the trace) ``res`` = the key is in ``chunks``, ``slot`` its ``chunk``, ``ref`` its
  ``ref_cnt``, ``loads`` = ``observed.loads``, ``stores`` = the key is in ``observed.stores``;
  per slot ``used`` = a chunk of ``chunks`` is there (``owner`` its key), ``free`` = on the
  ``free_list``; ``nalloc`` = ``num_allocated``; ``N`` = ``config.num_chunks``. Nothing else of
  the snapshot (the policy's order, the requests, the offer counts) is in the abstraction.
* **The operation's run** ``run_of(op, after)``: ``load`` is ``prepare_load`` per key,
  ``load_done`` ``complete_load`` per key, ``store_done`` ``complete_store_ok`` or
  ``_fail`` per key, ``store`` (read off the driver's observation of its output,
  ``observed.last``) one ``evict`` per evicted key (protected: the offered keys; the victim is
  the policy's choice) then one ``prepare_store`` per stored key (its slot: the chunk id
  returned), nothing when the store failed; ``reset`` is ``reset_cache``; ``new``,
  ``positions``, ``lookup``, ``touch`` and ``finish`` are no transition (the state must not move).
* **The check** ``check_op(before, after, op, keys)`` evaluates, on the concrete values (the
  ``Concrete`` backend: the same transition code the proofs are about), each transition's
  precondition and choice constraints, the invariant ``inv`` of every state of the run, and that
  the run ends in the abstraction of ``after``. O(keys x slots) per transition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvspec.specs.offloading_encoding import TRANSITIONS, CArray, Concrete, OState, init, inv

NO_TRANSITION = ("new", "positions", "lookup", "touch", "finish")
NO_OWNER = -1


@dataclass
class KeyNumbers:
    """Keys (``hash:group`` text) numbered in order of appearance, for one trace."""

    numbers: dict[str, int] = field(default_factory=dict)

    def __call__(self, key: str) -> int:
        return self.numbers.setdefault(key, len(self.numbers))


def _key_text(key: Any) -> str:
    """A key as an operation writes it (``[hash, group]``) or as a snapshot does (``hash:group``)."""
    return key if isinstance(key, str) else f"{key[0]}:{key[1]}"


def abstract(snap: Mapping[str, Any], keys: KeyNumbers) -> OState:
    chunks = snap["chunks"]
    observed = snap.get("observed") or {"loads": {}, "stores": []}
    res = {keys(k): True for k in chunks}
    slot = {keys(k): c["chunk"] for k, c in chunks.items()}
    ref = {keys(k): c["ref_cnt"] for k, c in chunks.items()}
    return OState(
        res=CArray(False, res), slot=CArray(0, {k: v for k, v in slot.items() if v != 0}),
        ref=CArray(0, {k: v for k, v in ref.items() if v != 0}),
        loads=CArray(0, {keys(k): n for k, n in observed["loads"].items() if n}),
        stores=CArray(False, {keys(k): True for k in observed["stores"]}),
        used=CArray(False, {c["chunk"]: True for c in chunks.values()}),
        free=CArray(False, {j: True for j in snap["free_list"]}),
        owner=CArray(NO_OWNER, {c["chunk"]: keys(k) for k, c in chunks.items()}),
        nalloc=snap["num_allocated"], n=snap["config"]["num_chunks"])


def canonical(s: OState) -> dict[str, Any]:
    """What an abstract state says: ``slot``, ``ref`` only where ``res``, ``owner`` where ``used``."""
    res = sorted(k for k, v in s.res.data.items() if v)
    used = sorted(j for j, v in s.used.data.items() if v)
    return {"res": res, "slot": {k: s.slot.get(k) for k in res}, "ref": {k: s.ref.get(k) for k in res},
            "loads": {k: v for k, v in sorted(s.loads.data.items()) if v},
            "stores": sorted(k for k, v in s.stores.data.items() if v),
            "used": used, "free": sorted(j for j, v in s.free.data.items() if v),
            "owner": {j: s.owner.get(j) for j in used}, "nalloc": s.nalloc, "N": s.n}


def run_of(op: Mapping[str, Any], after: Mapping[str, Any], keys: KeyNumbers) -> list[tuple[str, dict[str, Any]]]:
    """The transitions (name, concrete inputs and choices) that ``op`` is, in order."""
    kind = op["op"]
    if kind in NO_TRANSITION:
        return []
    if kind == "reset":
        return [("reset_cache", {})]
    ks = [keys(_key_text(k)) for k in op.get("keys", [])]
    if kind == "load":
        return [("prepare_load", {"k": k}) for k in ks]
    if kind == "load_done":
        return [("complete_load", {"k": k}) for k in ks]
    if kind == "store_done":
        name = "complete_store_ok" if op.get("success", True) else "complete_store_fail"
        return [(name, {"k": k}) for k in ks]
    if kind != "store":
        raise ValueError(f"unknown operation {kind!r}")
    last = after["observed"]["last"]
    if last.get("failed"):
        return []
    prot = CArray(False, dict.fromkeys(ks, True))
    out: list[tuple[str, dict[str, Any]]] = [("evict", {"prot": prot, "v": keys(v)}) for v in last["evicted"]]
    out += [("prepare_store", {"k": keys(k), "j": j}) for k, j in zip(last["stored"], last["chunk_ids"], strict=True)]
    return out


@dataclass(frozen=True)
class Rejection:
    """Why an operation is not a run of the transitions."""

    op: Mapping[str, Any]
    transition: str | None  # None: the run's end, or the state before it
    reason: str
    state: dict[str, Any]  # canonical: the state the transition starts from (the run's end)
    params: Mapping[str, Any] = field(default_factory=dict)  # the transition's inputs and choices

    def __str__(self) -> str:
        where = f"transition {self.transition}" if self.transition else "the run"
        return f"{self.op.get('op')} {self.op.get('keys', '')}: {where}: {self.reason}; state {self.state}"


def _backend(states: list[OState], params: list[dict[str, Any]]) -> Concrete:
    """Quantifiers over every key and slot the states and inputs mention, plus one key and the
    slots -1 and N where nothing is (there a ForAll over the integers is decided)."""
    keys: set[int] = set()
    slots: set[int] = set()
    for s in states:
        for a in (s.res, s.slot, s.ref, s.loads, s.stores):
            keys |= set(a.data)
        for a in (s.used, s.free, s.owner):
            slots |= set(a.data)
        slots |= set(range(-1, s.n + 1))
    for p in params:
        keys |= {v for name, v in p.items() if name in ("k", "v")}
        slots |= {v for name, v in p.items() if name == "j"}
    keys.add(max(keys, default=-1) + 1)
    return Concrete(keys, slots)


def check_op(before: Mapping[str, Any], after: Mapping[str, Any], op: Mapping[str, Any],
             keys: KeyNumbers) -> Rejection | None:
    """None when ``op`` took the abstraction of ``before`` to that of ``after`` by its run,
    every precondition and choice constraint met and every state on the way invariant."""
    s, end = abstract(before, keys), abstract(after, keys)
    run = run_of(op, after, keys)
    B = _backend([s, end], [p for _, p in run])
    if not inv(B, s):
        return Rejection(op, None, "the state before is not invariant", canonical(s))
    for name, params in run:
        st = TRANSITIONS[name](B, s, params)
        if not B.And(*st.pre):
            return Rejection(op, name, f"precondition fails for {params}", canonical(s), params)
        if not B.And(*st.cons):
            return Rejection(op, name, f"choice not admitted: {params}", canonical(s), params)
        s = st.post
        if not inv(B, s):
            return Rejection(op, name, "the successor is not invariant", canonical(s), params)
    if canonical(s) != canonical(end):
        return Rejection(op, None, f"the run ends in {canonical(s)}, the snapshot after shows", canonical(end))
    return None


def check_initial(snap: Mapping[str, Any], keys: KeyNumbers) -> bool:
    """A new manager and driver are the encoding's initial state."""
    s = abstract(snap, keys)
    return bool(init(_backend([s], []), s))
