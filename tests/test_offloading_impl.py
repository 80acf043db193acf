"""The second manager's implementation on tensors (``kvspec.impl.offloading``) held to its model
(``kvspec.model.offloading``): equal results and equal snapshots after every operation.

(a) lockstep on random traces drawn as vLLM's connector calls the manager (``Generator``),
    both policies, with and without the store threshold, with counts of the rare paths each
    batch went through; (b) a Hypothesis state machine running both side by side; (c) every
    kind of refused call, refused alike and changing nothing; (d) planted bugs in the
    implementation that the lockstep must report.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvspec.contract.errors import InvalidOperationError, KVSpecError, UnknownRequestError
from kvspec.contract.offloading import OffloadingConfig, OffloadingManagerTarget, OffloadKey, key_bytes
from kvspec.drivers.offloading import Driver, Generator, random_offloading_config
from kvspec.impl.offloading import TensorOffloadingManager, make_offloading_impl
from kvspec.impl.offloading.arc import TensorARC
from kvspec.impl.offloading.lru import TensorLRU
from kvspec.model.offloading import OffloadingManager, make_offloading_manager
from kvspec.model.offloading.arc import ARCPolicy

Factory = Callable[[OffloadingConfig], OffloadingManagerTarget]

# -- (a) lockstep ---------------------------------------------------------------------------------


@dataclass
class Lockstep:
    """One batch of traces: how many operations ran, the first divergence of each diverging
    trace, and how often the rare paths were taken."""

    traces: int = 0
    operations: int = 0
    divergences: list[str] = field(default_factory=list)
    paths: Counter[str] = field(default_factory=Counter)


def config_for(seed: int, rng: random.Random) -> OffloadingConfig:
    """The generator's random config, with policy and store threshold cycling with the seed so
    that every batch covers the four classes (LRU/ARC x threshold 1/2)."""
    cfg = random_offloading_config(rng)
    threshold = 2 if seed % 4 >= 2 else 1
    return replace(cfg, policy=("lru", "arc")[seed % 2], store_threshold=threshold,
                   max_tracker_size=rng.choice((3, 6, 64_000)) if threshold > 1 else 64_000)


def _count_paths(paths: Counter[str], op: dict[str, Any], result: Any, before: dict[str, Any],
                 after: dict[str, Any]) -> None:
    if op["op"] == "store":
        if result is None:
            paths["store refused (no room)"] += 1
        elif result["evicted_keys"]:
            paths["store with evictions"] += 1
    if op["op"] == "store_done" and not op["success"]:
        paths["store failed"] += 1
    if op["op"] == "reset":
        paths["reset"] += 1
    arc = after["policy"].get("arc")
    if arc is not None and arc["target_t1_size"] != before["policy"]["arc"]["target_t1_size"]:
        paths["ARC ghost hit (target adapted)"] += 1
    lru = after["policy"].get("lru")
    if lru is not None:
        ranks = [tuple(lru["ranks"][k]) for k in lru["order"]]
        if any(a == b for a, b in pairwise(ranks)):
            paths["LRU order tie broken by key bytes"] += 1


def lockstep(reference: Factory, target: Factory, seeds: range, steps: int) -> Lockstep:
    """Run each seed's trace on both targets (the generator fed the reference's results);
    stop a trace at its first difference in a result, a refusal or the full snapshot."""
    out = Lockstep()
    for seed in seeds:
        rng = random.Random(seed)
        config = config_for(seed, rng)
        ref, tgt = Driver(reference(config)), Driver(target(config))
        gen = Generator(rng)
        out.traces += 1
        before = ref.snapshot()
        diverged = False
        for step in range(steps):
            for op in gen.next_ops():
                out.operations += 1
                r_ref = _outcome(ref, op)
                r_tgt = _outcome(tgt, op)
                s_ref, s_tgt = ref.snapshot(), tgt.snapshot()
                if r_ref != r_tgt or s_ref != s_tgt:
                    field_ = next((k for k in s_ref if s_ref[k] != s_tgt.get(k)), "result")
                    out.divergences.append(f"seed {seed} step {step} {op}: {field_} differs "
                                           f"(reference {r_ref!r:.200}, target {r_tgt!r:.200})")
                    diverged = True
                    break
                _count_paths(out.paths, op, r_ref, before, s_ref)
                before = s_ref
                gen.feed(op, r_ref)
            if diverged:
                break
    return out


def _outcome(driver: Driver, op: dict[str, Any]) -> Any:
    try:
        return driver.apply(op)
    except KVSpecError as exc:
        return ("refused", type(exc).__name__)


@pytest.mark.parametrize("batch", [0, *(pytest.param(b, marks=pytest.mark.deep) for b in (1, 2, 3))])
def test_impl_agrees_with_the_model_on_random_traces(batch: int) -> None:
    """60 traces per batch (each batch all four config classes), 60 generator steps each; the
    default run takes the first batch, the deep run the other three."""
    result = lockstep(make_offloading_manager, make_offloading_impl, range(batch * 60, batch * 60 + 60), steps=60)
    assert result.divergences == []
    assert result.traces == 60 and result.operations > 60 * 60
    # The batch went through the rare paths, so agreement on them was checked.
    for path in ("store with evictions", "store refused (no room)", "store failed",
                 "ARC ghost hit (target adapted)", "LRU order tie broken by key bytes"):
        assert result.paths[path] > 0, (path, result.paths)


def test_impl_own_invariants_hold_along_traces() -> None:
    """``_check()`` of the implementation (and of the model) after every operation."""
    for seed in range(12):
        rng = random.Random(1000 + seed)
        config = config_for(seed, rng)
        model, impl = make_offloading_manager(config), make_offloading_impl(config)
        dm, di, gen = Driver(model), Driver(impl), Generator(rng)
        for _ in range(60):
            for op in gen.next_ops():
                result = dm.apply(op)
                assert di.apply(op) == result
                model._check()
                impl._check()
                gen.feed(op, result)


def test_lru_tie_is_broken_by_vllm_key_bytes_not_by_tuple_order() -> None:
    """Keys of one request at one position share a rank; vLLM orders them by packed bytes.
    ("a", 0x22000000) packs to ``a 22 00 00 00`` and ("a!", 0) to ``a 21 00 00 00 00``: bytes
    put ("a!", 0) first although tuple order puts ("a", ...) first. Both targets evict it first."""
    low, high = ("a!", 0), ("a", 0x22000000)
    assert key_bytes(low) < key_bytes(high) and high < low
    cfg = OffloadingConfig(num_chunks=2, policy="lru")
    evicted = []
    for t in (make_offloading_manager(cfg), make_offloading_impl(cfg)):
        t.on_new_request("r")
        t.set_key_positions("r", [(high, 16), (low, 16)])
        t.prepare_store("r", [high, low])
        t.complete_store("r", [high, low])
        assert t.snapshot()["policy"]["lru"]["order"] == ["a!:0", f"a:{0x22000000}"]
        out = t.prepare_store("r", [("c", 0)])
        assert out is not None
        evicted.append(out.evicted_keys)
    assert evicted == [[low], [low]]


# -- (b) the model and the implementation side by side under Hypothesis --------------------------

KEYS: list[OffloadKey] = [(f"h{i}", g) for i in range(6) for g in range(2)]
key_st = st.sampled_from(KEYS)
keys_st = st.lists(key_st, min_size=1, max_size=5, unique=True)


class ModelAndImpl(RuleBasedStateMachine):
    """Every rule makes one valid call on both; results equal; after every step the model's
    ``_check()``, the implementation's ``_check()`` and equal snapshots."""

    open_reqs = Bundle("open_reqs")
    finished_reqs = Bundle("finished_reqs")

    def __init__(self) -> None:
        super().__init__()
        self.model: OffloadingManager | None = None
        self.impl: TensorOffloadingManager | None = None
        self.loads: list[tuple[str, list[OffloadKey]]] = []
        self.stores: list[tuple[str, list[OffloadKey]]] = []
        self.serial = 0

    policy = "lru"

    @initialize(num_chunks=st.integers(2, 5), threshold=st.sampled_from([1, 1, 2]),
                tracker=st.sampled_from([3, 64_000]))
    def setup(self, num_chunks: int, threshold: int, tracker: int) -> None:
        cfg = OffloadingConfig(num_chunks=num_chunks, policy=self.policy, store_threshold=threshold,
                               max_tracker_size=tracker)
        self.model, self.impl = make_offloading_manager(cfg), make_offloading_impl(cfg)

    def _both(self, call: Callable[[OffloadingManagerTarget], Any]) -> Any:
        assert self.model is not None and self.impl is not None
        target_before = self._arc_target()
        out = call(self.model)
        assert call(self.impl) == out
        if self._arc_target() != target_before:
            event("ARC ghost hit (target adapted)")
        return out

    def _arc_target(self) -> float | None:
        assert self.model is not None
        arc = self.model.snapshot()["policy"].get("arc")
        return None if arc is None else float(arc["target_t1_size"])

    def _ready(self) -> list[OffloadKey]:
        assert self.model is not None
        return sorted(k for k, c in self.model.policy.resident().items() if c.is_ready)

    @rule(target=open_reqs)
    def new(self) -> str:
        self.serial += 1
        rid = f"r{self.serial}"
        self._both(lambda t: t.on_new_request(rid))
        return rid

    @rule(req=open_reqs, keys=keys_st, positions=st.lists(st.integers(0, 5), min_size=5, max_size=5))
    def positions(self, req: str, keys: list[OffloadKey], positions: list[int]) -> None:
        pairs = [(k, p * 16) for k, p in zip(keys, positions, strict=False)]
        self._both(lambda t: t.set_key_positions(req, pairs))

    @rule(req=open_reqs, key=key_st)
    def lookup(self, req: str, key: OffloadKey) -> None:
        event(f"lookup {self._both(lambda t: t.lookup(req, key))}")

    @precondition(lambda self: self.model is not None and bool(self._ready()))
    @rule(req=open_reqs, data=st.data())
    def load(self, req: str, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self._ready()), min_size=1, max_size=4, unique=True))
        self._both(lambda t: t.prepare_load(req, keys))
        self.loads.append((req, keys))

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def load_done(self, data: st.DataObject) -> None:
        req, keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self._both(lambda t: t.complete_load(req, keys))

    @rule(req=open_reqs, keys=keys_st)
    def touch(self, req: str, keys: list[OffloadKey]) -> None:
        self._both(lambda t: t.touch(req, keys))

    def _store(self, req: str, keys: list[OffloadKey], done: str) -> None:
        out = self._both(lambda t: t.prepare_store(req, keys))
        if out is None:
            event("store refused (no room)")
            return
        if out.evicted_keys:
            event("store with evictions")
        if not out.keys_to_store:
            return
        if done == "later":
            self.stores.append((req, out.keys_to_store))
            return
        if done == "fails now":
            event("store failed")
        self._both(lambda t: t.complete_store(req, out.keys_to_store, done == "now"))

    @rule(req=open_reqs, keys=keys_st)
    def store(self, req: str, keys: list[OffloadKey]) -> None:
        """A store whose copy completes in a later step."""
        self._store(req, keys, "later")

    @rule(req=open_reqs, keys=keys_st, fails=st.sampled_from([False, False, False, True]))
    def store_now(self, req: str, keys: list[OffloadKey], fails: bool) -> None:
        """A store completed at once: the next calls find ready chunks to load, reuse, evict."""
        self._store(req, keys, "fails now" if fails else "now")

    @rule(req=open_reqs, keys=keys_st)
    def lookup_then_load(self, req: str, keys: list[OffloadKey]) -> None:
        """The connector's pattern: look keys up in turn, load the prefix of hits."""
        hits = []
        for key in keys:
            if self._both(lambda t, key=key: t.lookup(req, key)) != "HIT":  # type: ignore[misc]
                break
            hits.append(key)
        if hits:
            event("load after lookup")
            self._both(lambda t: t.prepare_load(req, hits))
            self.loads.append((req, hits))

    def _ghosts(self) -> list[OffloadKey]:
        policy = self.model.policy if self.model is not None else None
        return sorted([*policy.b1, *policy.b2]) if isinstance(policy, ARCPolicy) else []

    @precondition(lambda self: bool(self._ghosts()))
    @rule(req=open_reqs, data=st.data(), how=st.sampled_from(["store", "touch"]))
    def ghost_again(self, req: str, data: st.DataObject, how: str) -> None:
        """ARC: a key evicted to a ghost list is offered or touched again (a ghost hit)."""
        key = data.draw(st.sampled_from(self._ghosts()))
        if how == "touch":
            self._both(lambda t: t.touch(req, [key]))
        else:
            self._store(req, [key], "now")

    @precondition(lambda self: bool(self.stores))
    @rule(data=st.data(), success=st.booleans())
    def store_done(self, data: st.DataObject, success: bool) -> None:
        req, keys = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        if not success:
            event("store failed")
        self._both(lambda t: t.complete_store(req, keys, success))

    @rule(target=finished_reqs, req=consumes(open_reqs))
    def finish(self, req: str) -> str:
        self._both(lambda t: t.on_request_finished(req))
        return req

    @rule(req=finished_reqs)
    def finish_again(self, req: str) -> None:
        self._both(lambda t: t.on_request_finished(req))

    @precondition(lambda self: self.model is not None)
    @rule(now=st.sampled_from([False] * 15 + [True]))
    def reset(self, now: bool) -> None:
        """A reset, rarely when this rule is drawn (else nothing)."""
        if not now:
            return
        event("reset")
        self._both(lambda t: t.reset_cache())
        self.loads.clear()  # vLLM's connector completes no transfer from before a reset
        self.stores.clear()

    @invariant()
    def agree(self) -> None:
        if self.model is None or self.impl is None:
            return
        self.model._check()
        self.impl._check()
        assert self.impl.snapshot() == self.model.snapshot()


class ModelAndImplARC(ModelAndImpl):
    policy = "arc"


TestModelAndImplLRU = ModelAndImpl.TestCase
TestModelAndImplLRU.settings = settings(max_examples=30, stateful_step_count=60)
TestModelAndImplARC = ModelAndImplARC.TestCase
TestModelAndImplARC.settings = settings(max_examples=30, stateful_step_count=60)


# -- (c) refused calls ----------------------------------------------------------------------------

A, B, C, D = ("a", 0), ("b", 0), ("c", 1), ("d", 0)
ABSENT = ("zz", 0)


def _scene(t: OffloadingManagerTarget) -> None:
    """Request r open, request done finished; A loaded once, B ready, C being stored."""
    t.on_new_request("r")
    t.on_new_request("done")
    t.set_key_positions("r", [(A, 16), (B, 32), (C, 48)])
    for _ in range(t.config.store_threshold):
        t.prepare_store("r", [A, B, C])
    t.complete_store("r", [A, B])
    t.prepare_load("r", [A])
    t.on_request_finished("done")


BAD: dict[str, tuple[type[KVSpecError], Callable[[OffloadingManagerTarget], object]]] = {
    # unknown request, on every call that names one
    "lookup unknown request": (UnknownRequestError, lambda t: t.lookup("nope", A)),
    "load unknown request": (UnknownRequestError, lambda t: t.prepare_load("nope", [B])),
    "touch unknown request": (UnknownRequestError, lambda t: t.touch("nope", [B])),
    "store unknown request": (UnknownRequestError, lambda t: t.prepare_store("nope", [D])),
    "load_done unknown request": (UnknownRequestError, lambda t: t.complete_load("nope", [A])),
    "store_done unknown request": (UnknownRequestError, lambda t: t.complete_store("nope", [C])),
    "positions unknown request": (UnknownRequestError, lambda t: t.set_key_positions("nope", [(D, 16)])),
    "finish unknown request": (UnknownRequestError, lambda t: t.on_request_finished("nope")),
    "request id not a string": (UnknownRequestError, lambda t: t.lookup(7, A)),  # type: ignore[arg-type]
    # a finished request submitting
    "lookup finished request": (InvalidOperationError, lambda t: t.lookup("done", A)),
    "load finished request": (InvalidOperationError, lambda t: t.prepare_load("done", [B])),
    "touch finished request": (InvalidOperationError, lambda t: t.touch("done", [B])),
    "store finished request": (InvalidOperationError, lambda t: t.prepare_store("done", [D])),
    "positions finished request": (InvalidOperationError, lambda t: t.set_key_positions("done", [(D, 16)])),
    # a key twice in one call
    "store key twice": (InvalidOperationError, lambda t: t.prepare_store("r", [D, D])),
    "load key twice": (InvalidOperationError, lambda t: t.prepare_load("r", [B, B])),
    "touch key twice": (InvalidOperationError, lambda t: t.touch("r", [B, A, B])),
    "load_done key twice": (InvalidOperationError, lambda t: t.complete_load("r", [A, A])),
    "store_done key twice": (InvalidOperationError, lambda t: t.complete_store("r", [C, C])),
    # malformed keys and positions
    "empty hash": (InvalidOperationError, lambda t: t.prepare_store("r", [("", 0)])),
    "negative group": (InvalidOperationError, lambda t: t.prepare_store("r", [D, ("x", -1)])),
    "group too large": (InvalidOperationError, lambda t: t.lookup("r", ("x", 2**32))),
    "group a bool": (InvalidOperationError, lambda t: t.touch("r", [("x", True)])),
    "hash with a line break": (InvalidOperationError, lambda t: t.prepare_store("r", [("x\ny", 0)])),
    "key a list": (InvalidOperationError, lambda t: t.prepare_load("r", [["a", 0]])),  # type: ignore[list-item]
    "keys a string": (InvalidOperationError, lambda t: t.prepare_store("r", "a:0")),  # type: ignore[arg-type]
    "negative position": (InvalidOperationError, lambda t: t.set_key_positions("r", [(D, 16), (A, -1)])),
    "position not a pair": (InvalidOperationError, lambda t: t.set_key_positions("r", [D])),  # type: ignore[list-item]
    # loading a key that is not ready
    "load a key being stored": (InvalidOperationError, lambda t: t.prepare_load("r", [B, C])),
    "load a key not cached": (InvalidOperationError, lambda t: t.prepare_load("r", [B, ABSENT])),
    # completing a load that is not in flight
    "load_done of a ready key": (InvalidOperationError, lambda t: t.complete_load("r", [A, B])),
    "load_done of a key being stored": (InvalidOperationError, lambda t: t.complete_load("r", [C])),
    "load_done of a key not cached": (InvalidOperationError, lambda t: t.complete_load("done", [ABSENT])),
    # requests and flags
    "request twice": (InvalidOperationError, lambda t: t.on_new_request("r")),
    "empty request id": (InvalidOperationError, lambda t: t.on_new_request("")),
    "success not a bool": (InvalidOperationError, lambda t: t.complete_store("r", [C], 1)),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("threshold", [1, 2])
@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_alike_and_nothing_changes(case: str, policy: str, threshold: int) -> None:
    expected, call = BAD[case]
    cfg = OffloadingConfig(num_chunks=4, policy=policy, store_threshold=threshold)
    model, impl = make_offloading_manager(cfg), make_offloading_impl(cfg)
    for t in (model, impl):
        _scene(t)
        if threshold == 2:  # offer D twice so that it is admitted in the calls below
            t.prepare_store("r", [D])
    before, interned = impl.snapshot(), len(impl.keys)
    assert before == model.snapshot()
    raised = []
    for t in (model, impl):
        with pytest.raises(KVSpecError) as info:
            call(t)
        raised.append(type(info.value))
    assert raised == [expected, expected]
    assert impl.snapshot() == before == model.snapshot()
    assert len(impl.keys) == interned  # not even a key interned
    impl._check()
    # and both go on alike: the next valid call gives the same answer
    assert impl.prepare_store("r", [D]) == model.prepare_store("r", [D])
    assert impl.snapshot() == model.snapshot()


# -- (d) planted bugs -----------------------------------------------------------------------------


@contextmanager
def planted(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, value: object) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(cls, name, value)
        yield


def _ignores_ref_counts_lru(self: TensorLRU, protected: torch.Tensor) -> torch.Tensor:
    return self.pool.resident() & ~protected  # planted: loaded and being-stored chunks evictable


def _ignores_ref_counts_arc(self: TensorARC, protected: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda slots: ~protected[slots]  # planted: the same bug in ARC


def _ties_by_slot(self: TensorLRU, out: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    return out  # planted: tied ranks left in slot order, not key-bytes order


@pytest.mark.parametrize(("policy", "cls", "name", "bug"), [
    ("lru", TensorLRU, "_candidates", _ignores_ref_counts_lru),
    pytest.param("arc", TensorARC, "_usable", _ignores_ref_counts_arc, marks=pytest.mark.deep),
    pytest.param("lru", TensorLRU, "_break_ties", _ties_by_slot, marks=pytest.mark.deep),
])
def test_lockstep_catches_a_planted_bug(monkeypatch: pytest.MonkeyPatch, policy: str, cls: type, name: str,
                                        bug: object) -> None:
    seeds = range(0 if policy == "lru" else 1, 80, 2)  # config_for: even seeds LRU, odd ARC
    assert lockstep(make_offloading_manager, make_offloading_impl, seeds, steps=60).divergences == []
    with planted(monkeypatch, cls, name, bug):
        found = lockstep(make_offloading_manager, make_offloading_impl, seeds, steps=60)
    assert found.divergences, f"{cls.__name__}.{name} planted bug not caught in {found.traces} traces"
