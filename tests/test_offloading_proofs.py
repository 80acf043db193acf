"""The second manager's proofs (specs/offloading_*.py): the obligations, what breaks them, and
the refinement check that ties the encoding to the model.

* every obligation of ``offloading_obligations()`` gives its expected result, and ``kvspec
  prove`` lists and runs them;
* each mutation obligation names a transition whose unmutated form the proof accepts, and the
  mutation breaks exactly the property it is about; broken existence and witnesses are seen;
* random traces of the model (the driver's generator, LRU and ARC) are runs of the transitions
  with every state invariant; planted model bugs and tampered snapshots are rejected.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvspec.cli import main
from kvspec.contract.errors import KVSpecError
from kvspec.contract.offloading import OffloadingConfig, OffloadKey, key_bytes
from kvspec.drivers.offloading import Driver, Generator, random_offloading_config
from kvspec.model.offloading import make_offloading_manager
from kvspec.model.offloading.lru import LRUPolicy
from kvspec.model.offloading.manager import OffloadingManager
from kvspec.specs import offloading_encoding as E
from kvspec.specs import offloading_obligations as O
from kvspec.specs.obligations import PASS
from kvspec.specs.offloading_refinement import KeyNumbers, Rejection, abstract, canonical, check_initial, check_op

OBLIGATIONS = O.offloading_obligations()
TRACES = 300
OPS = 30


@pytest.mark.parametrize("ob", OBLIGATIONS, ids=[ob.name for ob in OBLIGATIONS])
def test_obligation(ob: Any) -> None:
    res = ob.run()
    assert res.result == PASS[ob.kind], f"{ob.name}: {res.result} {res.detail}"


def test_catalogue_has_each_kind_and_a_mutation_per_proof() -> None:
    kinds = {ob.kind for ob in OBLIGATIONS}
    assert kinds == {"proof", "bounded", "existence", "witness", "vacuity", "mutation"}
    assert {ob.policy for ob in OBLIGATIONS} == {"offloading"}
    proofs = {ob.name.removeprefix("offloading:") for ob in OBLIGATIONS if ob.kind == "proof"}
    assert proofs == {p for p, _ in O.PROOFS}
    assert {m.breaks for m in E.MUTATIONS} == proofs


def test_prove_lists_and_runs_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prove", "--list", "--json", "-k", "offloading"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [o["name"] for o in listed] == [ob.name for ob in OBLIGATIONS]
    assert main(["prove", "--json", "-k", "offloading:mutation"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out) == len(E.MUTATIONS) and all(r["result"] == "caught" and r["ok"] for r in out)


@pytest.mark.parametrize("m", E.MUTATIONS, ids=[m.name for m in E.MUTATIONS])
def test_each_mutation_breaks_its_property_at_its_transition(m: E.Mutation) -> None:
    """The unmutated proof holds; under the mutation it fails, at the mutated transition."""
    assert O.inductive(E.Quant(), m.breaks)[0] == "holds"
    r, detail, _ = O.inductive(E.Quant(), m.breaks, m)
    assert r == "fails" and detail.startswith(m.transition + ":"), (r, detail)
    # and on the unrolled encoding too (without the every-N hint)
    r, detail, _ = O.inductive(E.Unrolled(3, 3), m.breaks, m)
    assert r == "fails" and detail.startswith(m.transition + ":"), (r, detail)


def _patched(monkeypatch: pytest.MonkeyPatch, name: str, fn: E.TransitionFn) -> None:
    monkeypatch.setitem(E.TRANSITIONS, name, fn)


def test_existence_fails_without_the_free_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``prepare_store`` that only takes fresh slots has no successor from a full pool with a
    free slot, which its precondition admits: both existence checks fail at it."""
    def fresh_only(B: E.Backend, s: E.OState, p: E.Params) -> E.Step:
        st = E.prepare_store(B, s, p)
        return replace(st, cons=[*st.cons, s.nalloc < s.n])

    _patched(monkeypatch, "prepare_store", fresh_only)
    for B in (E.Quant(), E.Unrolled(3, 3)):
        r, detail, _ = O.existence(B)
        assert (r, detail) == ("fails", "prepare_store: a state without a successor")


def test_witnesses_fail_when_their_branch_is_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(B: E.Backend, s: E.OState, prot: Any, v: Any) -> Any:
        return B.And(E.evictable(B, s, prot, v), B.sel(prot, v))  # only protected keys: none

    def no_failure(B: E.Backend, s: E.OState, p: E.Params) -> E.Step:
        return E.complete_store_ok(B, s, p)  # a failed store that succeeds

    def no_unload(B: E.Backend, s: E.OState, p: E.Params) -> E.Step:
        st = E.complete_load(B, s, p)
        return replace(st, act=False, post=s)  # every completion refused

    by_name = {name: (run, cond) for name, run, cond, _ in O.WITNESSES}
    for name, transition, fn in (("eviction", "evict", E._evict_with(never)),
                                 ("failed-store", "complete_store_fail", no_failure),
                                 ("load-completion", "complete_load", no_unload)):
        assert O.reach(*by_name[name])[0] == "reached"
        with monkeypatch.context() as mp:
            _patched(mp, transition, fn)
            assert O.reach(*by_name[name])[0] == "unreached", name


def test_a_broken_invariant_that_holds_is_reported_vacuous() -> None:
    """``refuted`` must not pass a 'broken' invariant that is in fact a consequence of the proved one."""
    assert O.refuted(lambda B, s: B.forall("key", lambda k: B.sel(s.loads, k) >= 0))[0] == "vacuous"


# -- refinement -----------------------------------------------------------------------------------


def _ops(seed: int, config: OffloadingConfig | None = None, ops: int = OPS,
         ) -> Iterator[tuple[Driver, dict[str, Any], dict[str, Any], dict[str, Any], KeyNumbers]]:
    """A generated trace on the model: (driver, op, snapshot before, snapshot after, key numbers)
    for each accepted operation."""
    rng = random.Random(seed)
    cfg = config or random_offloading_config(rng)
    driver = Driver(make_offloading_manager(cfg))
    gen = Generator(rng)
    keys = KeyNumbers()
    assert check_initial(driver.snapshot(), keys)
    for _ in range(ops):
        for op in gen.next_ops():
            before = driver.snapshot()
            try:
                result = driver.apply(op)
            except KVSpecError:
                continue  # refused: nothing changed
            gen.feed(op, result)
            yield driver, op, before, driver.snapshot(), keys


def _first_rejection(seed: int, config: OffloadingConfig | None = None) -> Rejection | None:
    for _, op, before, after, keys in _ops(seed, config):
        rej = check_op(before, after, op, keys)
        if rej is not None:
            return rej
    return None


def test_every_model_operation_is_a_run_of_the_transitions() -> None:
    seen: dict[str, int] = {}
    policies = set()
    for seed in range(TRACES):
        for driver, op, before, after, keys in _ops(seed):
            rej = check_op(before, after, op, keys)
            assert rej is None, f"seed {seed}: {rej}"
            policies.add(driver.target.config.policy)
            last = after["observed"]["last"]
            kind = op["op"]
            if kind == "store" and last.get("evicted"):
                kind = "store-evicting-" + driver.target.config.policy
            if kind == "store_done" and not op.get("success", True):
                kind = "store_done-failed"
            seen[kind] = seen.get(kind, 0) + 1
    assert policies == {"lru", "arc"}
    # the traces reach every transition, evictions and failed stores included
    for kind in ("store", "store-evicting-lru", "store-evicting-arc", "store_done", "store_done-failed", "load",
                 "load_done", "reset"):
        assert seen.get(kind, 0) > 0, (kind, seen)


def _lru_evicts_any(self: LRUPolicy) -> list[OffloadKey]:
    """The planted bug: LRU's eviction order takes every resident key, whatever its ref count."""
    return sorted(self.chunks, key=lambda k: (self.ranks[k], key_bytes(k)))


def test_an_lru_eviction_ignoring_ref_counts_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LRUPolicy, "eviction_order", _lru_evicts_any)
    cfg = OffloadingConfig(num_chunks=3, policy="lru")
    found = [rej for seed in range(40) if (rej := _first_rejection(seed, cfg)) is not None]
    assert found, "no trace reached an eviction of a key in use"
    assert all(rej.transition == "evict" and rej.op["op"] == "store" for rej in found)
    for rej in found:  # the victim is in use: a load or a store in flight (or every candidate protected)
        assert rej.reason.startswith(("choice not admitted", "precondition fails")), rej.reason
        assert rej.state["ref"][rej.params["v"]] != 0 or rej.reason.startswith("precondition"), rej
    assert any(rej.state["ref"][rej.params["v"]] == -1 for rej in found)
    assert any(rej.state["ref"][rej.params["v"]] > 0 for rej in found)


def _complete_load_keeps_ref(self: OffloadingManager, req_id: str, keys: list[OffloadKey]) -> None:
    """The planted bug: completions are checked, but no ref count is taken back."""
    self._ctx(req_id, submit=False)
    for key in keys:
        chunk = self.policy.get(key)
        if chunk is None or chunk.ref_cnt <= 0:
            raise KVSpecError("no load in flight")


def test_a_load_completion_keeping_its_ref_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OffloadingManager, "complete_load", _complete_load_keeps_ref)
    found = [rej for seed in range(40) if (rej := _first_rejection(seed)) is not None]
    assert found
    assert all(rej.op["op"] == "load_done" and rej.transition is None and "the run ends in" in rej.reason
               for rej in found)


def _tampered(mutate: Callable[[dict[str, Any]], None]) -> Rejection | None:
    """The first store of seed 0's trace that allocates, its after snapshot tampered with."""
    for _, op, before, after, keys in _ops(0, OffloadingConfig(num_chunks=4)):
        if op["op"] == "store" and after["observed"]["last"].get("stored"):
            assert check_op(before, after, op, keys) is None
            bad = json.loads(json.dumps(after))
            mutate(bad)
            return check_op(before, bad, op, keys)
    pytest.fail("no allocating store in the trace")


def test_tampered_snapshots_are_rejected() -> None:
    def slot_twice(s: dict[str, Any]) -> None:  # two keys on one slot
        chunks = list(s["chunks"].values())
        chunks[-1]["chunk"] = chunks[0]["chunk"] if len(chunks) > 1 else chunks[0]["chunk"] + 1

    def ready_at_once(s: dict[str, Any]) -> None:  # a new chunk ready although its store is in flight
        key = s["observed"]["last"]["stored"][0]
        s["chunks"][key]["ref_cnt"] = 0

    def slot_leaked(s: dict[str, Any]) -> None:
        s["num_allocated"] += 1

    for mutate in (slot_twice, ready_at_once, slot_leaked):
        rej = _tampered(mutate)
        assert rej is not None, mutate.__name__


def test_the_abstraction_reads_the_snapshot() -> None:
    driver = Driver(make_offloading_manager(OffloadingConfig(num_chunks=4)))
    driver.apply({"op": "new", "req": "r"})
    out = driver.apply({"op": "store", "req": "r", "keys": [["a", 0], ["b", 0]]})
    assert out["chunk_ids"] == [0, 1]
    driver.apply({"op": "store_done", "req": "r", "keys": [["a", 0]], "success": True})
    driver.apply({"op": "load", "req": "r", "keys": [["a", 0]]})
    keys = KeyNumbers()
    c = canonical(abstract(driver.snapshot(), keys))
    a, b = keys("a:0"), keys("b:0")
    assert c == {"res": [a, b], "slot": {a: 0, b: 1}, "ref": {a: 1, b: -1}, "loads": {a: 1}, "stores": [b],
                 "used": [0, 1], "free": [], "owner": {0: a, 1: b}, "nalloc": 2, "N": 4}
