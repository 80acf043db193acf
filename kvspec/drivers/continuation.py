"""Running on from a bug: the traces that reached a violation, kept so later traces start there.

A violation's trace ends in a state where a bug has shown itself, and what that bug does next
(a free queue corrupted by a block freed twice, walked by a later allocation into its sentinel)
is reached only by running on from that state. A fresh trace must meet the first bug again by
chance before it can meet the second; a trace that starts from the kept one's operations is
there at once. A search that takes a found violation's invariant out of its oracle (as
``kvspec history`` does) judges such a continuation on everything else it breaks.

``Continuations.draw`` gives each trace its start: with probability ``share`` (while any trace
is kept) one kept trace, drawn uniformly, whose operations the new trace replays before it
draws its own; otherwise a fresh start. Nothing is kept but violations: a crash leaves nothing
to run on, and a refused operation changed nothing. A kept trace replays to the same state
because the engine and every target are deterministic in the operations, and the generator
draws its request ids from the engine (``Engine.unused_request_id``), so it can go on from any
trace, a shrunk one included.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvspec.contract.config import OffloadConfig

SHARE = 0.5
"""The share of traces that start from a kept violation's trace once one is kept (measured in
README.md's time-to-find table: the crash that follows #42571's I1 within seconds of it, against
the fresh traces given up for it)."""


@dataclass(frozen=True)
class Kept:
    """One kept trace: its configuration, its operations (the last one broke ``finding``)."""

    config: OffloadConfig
    ops: tuple[dict[str, Any], ...]
    finding: str


@dataclass
class Continuations:
    """Kept violation traces and the share of traces that start from one. ``keep`` O(len(ops));
    ``draw`` O(1)."""

    share: float = SHARE
    kept: list[Kept] = field(default_factory=list)

    def keep(self, config: OffloadConfig, ops: list[dict[str, Any]], finding: str) -> None:
        """Keep the trace ``ops`` on ``config``, whose last operation broke invariant ``finding``."""
        if ops:
            self.kept.append(Kept(config, tuple(ops), finding))

    def draw(self, rng: random.Random) -> Kept | None:
        """A kept trace to start from, or None for a fresh start (always None while none is kept
        or with ``share`` 0; no draw from ``rng`` then, so a search that keeps nothing draws
        exactly what it drew before)."""
        if not self.kept or self.share <= 0 or rng.random() >= self.share:
            return None
        return rng.choice(self.kept)
