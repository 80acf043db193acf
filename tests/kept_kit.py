"""Kept target snapshots, audited: an engine that keeps the target's snapshot between the calls
that may change it (``Engine(keep_snapshots=True)``, the fuzzer's runs) and compares every kept
snapshot it serves with one taken fresh at that moment. Shared by tests/test_kept_snapshots.py
(every target here) and the vLLM stages (real vLLM, patched or not)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from kvspec.adapters.targets import get_factory
from kvspec.drivers.engine import Engine
from kvspec.drivers.opgen import OpGenerator, RandomChoices, random_config


class AuditedEngine(Engine):
    """An engine that keeps snapshots and compares each one it serves with a fresh one: ``served``
    counts them, ``stale`` says where one differed."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, keep_snapshots=True, **kw)
        self.served = 0
        self.stale: list[str] = []

    def _target_snapshot(self) -> dict[str, Any]:
        kept = self._kept is not None
        snap = super()._target_snapshot()
        if kept:
            self.served += 1
            if snap != self.target.snapshot():
                self.stale.append(f"after {self.last_op!r}, step {self.step_index}")
        return snap


def audited_trace(target: str, policy: str, seed: int, n_ops: int = 60) -> Iterator[AuditedEngine]:
    """One random trace on an audited engine, yielding the engine after every operation."""
    rng = random.Random(seed)
    cfg = random_config(RandomChoices(rng), policy, False)
    engine = AuditedEngine(get_factory(target)(cfg))
    gen = OpGenerator(cfg, RandomChoices(rng))
    for _ in range(n_ops):
        try:
            engine.apply(gen.next_op(engine))
        except Exception:  # a rejection or a bug variant's crash: the trace ends here
            return
        engine.snapshot()
        yield engine


def stale_snapshots(target: str, policy: str, seeds: range) -> tuple[list[str], int]:
    """Where a served kept snapshot differed from a fresh one, over random traces; and how many
    kept snapshots were served (so that an empty list is not vacuous)."""
    stale, served = [], 0
    for seed in seeds:
        engines = list(audited_trace(target, policy, seed))
        if engines:
            stale += engines[-1].stale
            served += engines[-1].served
    return stale, served
