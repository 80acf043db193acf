"""Random engine traces: valid operation sequences for ``kvspec.drivers.engine.Engine``.

``random_ops(config, rng, n_ops)`` returns ``n_ops`` operation dicts (``{"op": ...}``)
that the engine accepts in order. To know what is valid at each point it runs a
shadow engine over the model (the ``baseline`` policy; the engine's own state, not
the policy, decides validity). The mix aims at what the offload bookkeeping finds
hard:

* **adds** draw prompts from a few *families*, so requests share prefixes and hit
  each other's blocks on GPU and CPU; prompt lengths hit block boundaries often;
* **steps** admit waiting and preempted requests in random order, preempt running
  ones, vary the chunk size (prefill in several chunks, off-boundary chunks) and
  the resume style (``mrv1``/``mrv2``);
* **reports** deliver store completions one rank count at a time or several at
  once, for any in-flight event, in any order;
* **load_done** completes shipped loads in any order;
* **finishes** hit requests in every phase (waiting, running, waiting for a load,
  loaded, preempted), preferring those that are done;
* **resets** happen rarely, with transfers in flight or not.

With ``invalid_rate > 0`` a fraction of the operations is deliberately invalid
(unknown request or event, a second finish, admitting a running request, a zero
chunk). Those carry ``"expect": "error"``, as in the trace format
(``kvspec.drivers.trace``): drop that key before ``Engine.apply``, which must reject the
operation without changing anything. Same config, same ``rng`` state, same trace.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import KVSpecError

_ACTIVE = ("waiting", "running", "waiting_for_remote_kvs", "loaded", "preempted")


def random_ops(config: OffloadConfig, rng: random.Random, n_ops: int, *, num_families: int = 3,
               invalid_rate: float = 0.0) -> list[dict[str, Any]]:
    """``n_ops`` engine operations for ``config``, drawn with ``rng``; see the module doc."""
    from kvspec.drivers.engine import Engine
    from kvspec.model import make_scheduler

    shadow = Engine(make_scheduler(replace(config, policy="baseline")))
    gen = _Generator(config, rng, num_families)
    ops: list[dict[str, Any]] = []
    while len(ops) < n_ops:
        if invalid_rate > 0 and rng.random() < invalid_rate:
            op = gen.invalid(shadow)
            try:
                shadow.apply(op)
            except KVSpecError:
                ops.append({**op, "expect": "error"})
                continue
            raise AssertionError(f"operation meant to be invalid was accepted: {op}")
        op = gen.valid(shadow)
        shadow.apply(op)
        ops.append(op)
    return ops


class _Generator:
    def __init__(self, config: OffloadConfig, rng: random.Random, num_families: int) -> None:
        self.config = config
        self.rng = rng
        self.num_families = max(1, num_families)
        self.next_id = 0
        B = config.block_size
        self.chunks = sorted({B, 2 * B, 3 * B, B + 1, max(1, B - 1), config.max_num_batched_tokens, 5 * B})

    # -- valid operations ----------------------------------------------------------------

    def valid(self, eng: Any) -> dict[str, Any]:
        reqs = eng.requests
        active = [rid for rid, r in reqs.items() if r.status in _ACTIVE]
        weights: dict[str, float] = {"add": 3.0 if len(active) < 6 else 0.5, "step": 6.0}
        if eng.reports_left:
            weights["report"] = 4.0
        if eng.loads_shipped:
            weights["load_done"] = 3.0
        if active:
            weights["finish"] = 1.5
        weights["reset"] = 0.15
        kind = self.rng.choices(list(weights), list(weights.values()))[0]
        make_op: Callable[[Any], dict[str, Any]] = getattr(self, f"_{kind}")
        return make_op(eng)

    def _add(self, eng: Any) -> dict[str, Any]:
        rng, B = self.rng, self.config.block_size
        rid = f"r{self.next_id}"
        self.next_id += 1
        blocks = rng.randint(0, 6)
        extra = rng.choice([0, 0, 1, 1, rng.randint(1, B)])
        prompt_len = max(1, blocks * B + extra)
        max_tokens = rng.choice([0, 1, 1, 2, 3, B, B + 2])
        return {"op": "add", "rid": rid, "family": rng.randrange(self.num_families),
                "prompt_len": prompt_len, "max_tokens": max_tokens}

    def _step(self, eng: Any) -> dict[str, Any]:
        rng = self.rng
        waiting = [rid for rid, r in eng.live.items() if r.status in ("waiting", "preempted")]
        running = [rid for rid, r in eng.live.items() if r.status in ("running", "loaded")]
        preempt = [rid for rid in running if rng.random() < 0.08]
        admissible = waiting + preempt
        admit = [rid for rid in admissible if rng.random() < 0.7]
        rng.shuffle(admit)
        op: dict[str, Any] = {"op": "step", "admit": admit, "chunk": rng.choice(self.chunks)}
        if preempt:
            op["preempt"] = preempt
        if preempt or any(eng.requests[r].was_preempted for r in admit):
            op["resume"] = rng.choice(["mrv1", "mrv2"])
        return op

    def _report(self, eng: Any) -> dict[str, Any]:
        event = self.rng.choice(sorted(eng.reports_left))
        left = eng.reports_left[event]
        count = left if self.rng.random() < 0.5 else self.rng.randint(1, left)
        return {"op": "report", "event": event, "count": count}

    def _load_done(self, eng: Any) -> dict[str, Any]:
        return {"op": "load_done", "rid": self.rng.choice(sorted(eng.loads_shipped))}

    def _finish(self, eng: Any) -> dict[str, Any]:
        reqs = eng.requests
        active = [rid for rid, r in reqs.items() if r.status in _ACTIVE]
        done = [rid for rid in active
                if reqs[rid].status == "running" and len(reqs[rid].output) >= reqs[rid].max_tokens
                and reqs[rid].num_computed_tokens >= reqs[rid].num_tokens - 1]
        pool = done if done and self.rng.random() < 0.7 else active
        return {"op": "finish", "rid": self.rng.choice(pool)}

    def _reset(self, eng: Any) -> dict[str, Any]:
        return {"op": "reset"}

    # -- invalid operations --------------------------------------------------------------

    def invalid(self, eng: Any) -> dict[str, Any]:
        reqs = eng.requests
        finished = [rid for rid, r in reqs.items() if r.status == "finished"]
        running = [rid for rid, r in reqs.items() if r.status == "running"]
        choices: list[dict[str, Any]] = [
            {"op": "finish", "rid": "no-such-request"},
            {"op": "load_done", "rid": "no-such-request"},
            {"op": "report", "event": 10_000 + self.rng.randrange(100), "count": 1},
            {"op": "step", "admit": [], "chunk": 0},
            {"op": "add", "rid": "", "family": 0, "prompt_len": 1},
        ]
        if finished:
            choices.append({"op": "finish", "rid": self.rng.choice(finished)})
        if running:
            choices.append({"op": "step", "admit": [self.rng.choice(running)]})
        if reqs:
            rid = self.rng.choice(sorted(reqs))
            choices.append({"op": "add", "rid": rid, "family": 0, "prompt_len": 4})
        if eng.reports_left:
            e = self.rng.choice(sorted(eng.reports_left))
            choices.append({"op": "report", "event": e, "count": eng.reports_left[e] + 1})
        return self.rng.choice(choices)
