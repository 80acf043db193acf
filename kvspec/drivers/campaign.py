"""Campaigns on every core: the same fuzzing job in N processes, findings deduplicated.

Worker ``i`` of ``n`` runs with seed ``seed * n + i`` (distinct for every worker and, for one
worker, the campaign's own seed), for the whole budget or until its first finding. Two findings
are the same when they break the same invariant (or crash the same way) with the same shrunk
trace up to renaming the requests (``dedupe_key``). The job is a picklable function of one
worker's seed (``Job``); results come back in worker order.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvspec.contract.errors import ConfigError

R = TypeVar("R")
MAX_WORKERS = 256


def worker_seeds(seed: int, workers: int) -> list[int]:
    """The distinct seed of each worker (worker 0 of 1 keeps ``seed``)."""
    return [seed * workers + i for i in range(workers)]


def check_workers(workers: object) -> int:
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise ConfigError(f"--workers must be an integer in 1..{MAX_WORKERS}, got {str(workers)[:20]!r}")
    return workers


def run_workers(job: Callable[[int], R], seed: int, workers: int) -> list[R]:
    """``job(worker_seed)`` for each worker, in N processes (in this one when N is 1)."""
    seeds = worker_seeds(seed, check_workers(workers))
    if workers == 1:
        return [job(seeds[0])]
    ctx = multiprocessing.get_context("spawn")  # no state shared with the parent beyond the job
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return list(pool.map(job, seeds))


def canonical_ops(ops: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ops`` with request ids renamed ``r0, r1, ...`` in order of first appearance."""
    names: dict[str, str] = {}

    def rename(rid: Any) -> Any:
        if not isinstance(rid, str):
            return rid
        return names.setdefault(rid, f"r{len(names)}")

    out = []
    for op in ops:
        new = dict(op)
        if "rid" in new:
            new["rid"] = rename(new["rid"])
        for key in ("admit", "preempt"):
            if isinstance(new.get(key), list):
                new[key] = [rename(r) for r in new[key]]
        out.append(new)
    return out


def dedupe_key(signature: tuple[str | None, str | None], config: dict[str, Any],
               ops: Iterable[dict[str, Any]]) -> str:
    """What makes two findings one: kind and invariant (or crash), configuration, shrunk trace
    up to renaming the requests."""
    import json

    return json.dumps([list(signature), config, canonical_ops(ops)], sort_keys=True)


@dataclass
class Distinct:
    """Findings by ``dedupe_key``: ``first`` keeps each key's first finding, ``count`` how many
    workers found it."""

    first: dict[str, Any] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, finding: Any) -> bool:
        """True when ``finding`` is new."""
        self.count[key] = self.count.get(key, 0) + 1
        if key in self.first:
            return False
        self.first[key] = finding
        return True
