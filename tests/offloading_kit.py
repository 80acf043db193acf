"""Shared by the offloading tests: the driver's snapshots along generated traces."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from kvspec.contract.errors import KVSpecError
from kvspec.contract.offloading import OffloadingFactory
from kvspec.drivers import offloading_fuzz as ofz
from kvspec.drivers.offloading import Driver, Generator


def generated_snapshots(factory: OffloadingFactory, seeds: range, rounds: int = 40
                        ) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(seed, operation, the driver's snapshot after it) for every operation the target accepts,
    along ``rounds`` rounds of the connector-shaped generator per seed (``random_offloading_config``:
    both policies, thresholds); refused operations are skipped."""
    for seed in seeds:
        rng = random.Random(seed)
        driver, gen = Driver(factory(ofz.random_offloading_config(rng))), Generator(rng)
        for _ in range(rounds):
            for op in gen.next_ops():
                try:
                    result = driver.apply(op)
                except KVSpecError:
                    continue
                gen.feed(op, result)
                yield seed, op, driver.snapshot()
