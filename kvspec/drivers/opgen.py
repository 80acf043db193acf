"""State-aware random operations for the fuzzer: always valid for the engine's current state.

``next_op(engine, rng)`` looks at the engine (requests by status, store events still
awaiting reports, loads in flight) and draws one operation a real engine could
perform next. Shared prefixes are on purpose: prompts come from a few families.
Weights favour steps and reports so that CPU pressure (evictions under live
cursors, re-stores, out-of-space) builds up in short traces.
"""

from __future__ import annotations

import random
from typing import Any

from kvspec.drivers.engine import LOADED, PREEMPTED, RUNNING, WAITING, Engine

FAMILIES = 3


def random_config_kwargs(rng: random.Random) -> dict[str, Any]:
    """Small pools so that the rare paths are common."""
    return {
        "num_gpu_blocks": rng.choice([12, 16, 24]),
        "num_cpu_blocks": rng.choice([4, 5, 6, 8]),
        "world_size": rng.choice([1, 1, 2]),
    }


def next_op(engine: Engine, rng: random.Random) -> dict[str, Any]:
    reqs = engine.live  # finished requests cannot be named by any operation
    B = engine.B
    waiting = [r for r, q in reqs.items() if q.status in (WAITING, PREEMPTED)]
    running = [r for r, q in reqs.items() if q.status in (RUNNING, LOADED)]
    live = [r for r, q in reqs.items() if q.status != "finished"]
    choices: list[tuple[float, str]] = [(2.0, "add") if len(live) < 6 else (0.2, "add"), (6.0, "step")]
    if engine.reports_left:
        choices.append((4.0, "report"))
    if engine.loads_shipped:
        choices.append((3.0, "load_done"))
    if live:
        choices.append((1.0, "finish"))
    choices.append((0.15, "reset"))
    total = sum(w for w, _ in choices)
    x = rng.uniform(0, total)
    kind = choices[-1][1]
    for w, name in choices:
        x -= w
        if x <= 0:
            kind = name
            break
    if kind == "add":
        n = engine.num_added
        blocks = rng.randint(1, 6)
        return {"op": "add", "rid": f"r{n}", "family": rng.randrange(FAMILIES),
                "prompt_len": blocks * B + rng.choice([0, 1, B // 2]), "max_tokens": rng.choice([1, 2, B, 2 * B])}
    if kind == "step":
        admit = [r for r in waiting if rng.random() < 0.7]
        preempt = [r for r in running if rng.random() < 0.08]
        return {"op": "step", "admit": admit, "chunk": rng.choice([B, 2 * B, 4 * B]), "preempt": preempt,
                "resume": rng.choice(["mrv1", "mrv2"])}
    if kind == "report":
        event = rng.choice(sorted(engine.reports_left))
        return {"op": "report", "event": event, "count": rng.randint(1, engine.reports_left[event])}
    if kind == "load_done":
        return {"op": "load_done", "rid": rng.choice(sorted(engine.loads_shipped))}
    if kind == "finish":
        return {"op": "finish", "rid": rng.choice(live)}
    return {"op": "reset"}
