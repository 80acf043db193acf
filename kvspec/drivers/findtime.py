"""Time to find: how soon a search meets a bug, as a median over seeds.

One search per seed gives one *sample*: whether it found the bug, and the seconds of searching
and the operations applied until the first finding (or, when it found nothing, until its budget
ran out). A search that found nothing is *censored*: the bug would have been found later, or
never, so its sample counts as longer than any found one. The median over the seeds is then the
middle sample in that order; when the middle is a censored sample (more than half of the seeds
found nothing, or, for an even number of seeds, half of them) there is no median: the bug is not
found in a median of ``budget`` seconds, and ``median_seconds`` is None.

``kvspec bugs --seeds K`` and ``kvspec history --seeds K`` report these per bug (per release and
finding); ``scripts/time_to_find.py`` prints the table the README quotes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One seed's search: found or not, its seconds and operations until the finding (or the end)."""

    seed: int
    found: bool
    seconds: float
    ops: int

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "found": self.found, "seconds": round(self.seconds, 3), "ops": self.ops}


@dataclass(frozen=True)
class TimeToFind:
    """The median over a bug's samples (None when the middle sample found nothing)."""

    samples: tuple[Sample, ...]
    median_seconds: float | None
    median_ops: float | None

    @property
    def seeds(self) -> int:
        return len(self.samples)

    @property
    def found_seeds(self) -> int:
        return sum(1 for s in self.samples if s.found)

    def to_json(self) -> dict[str, Any]:
        return {"seeds": self.seeds, "found_seeds": self.found_seeds,
                "median_seconds": None if self.median_seconds is None else round(self.median_seconds, 3),
                "median_ops": self.median_ops, "per_seed": [s.to_json() for s in self.samples]}


def _median(values: Sequence[float]) -> float | None:
    m = statistics.median(values)
    return None if math.isinf(m) else float(m)


def time_to_find(samples: Sequence[Sample]) -> TimeToFind:
    """The medians of ``samples`` (at least one), censored samples counted as infinitely long.
    O(K log K) for K samples."""
    if not samples:
        raise ValueError("time_to_find needs at least one sample")
    secs = [s.seconds if s.found else math.inf for s in samples]
    ops = [float(s.ops) if s.found else math.inf for s in samples]
    return TimeToFind(tuple(samples), _median(secs), _median(ops))


def describe(t: TimeToFind, budget: float) -> tuple[str, str]:
    """The table's two cells: median seconds and median operations (``> budget`` when censored)."""
    if t.median_seconds is None or t.median_ops is None:
        return f">{budget:g}", "-"
    return f"{t.median_seconds:.2f}", f"{t.median_ops:,.0f}"
