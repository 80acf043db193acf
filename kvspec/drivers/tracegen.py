"""Random engine traces: valid operation sequences for ``kvspec.drivers.engine.Engine``.

``random_ops(config, rng, n_ops)`` returns ``n_ops`` operation dicts (``{"op": ...}``) that the
engine accepts in order. They come from the one operation generator
(``kvspec.drivers.opgen.OpGenerator``: its docstring describes the mix), applied through the
harness' run loop (``kvspec.drivers.harness.generate``) to a shadow engine over the model's
``baseline`` policy, since the engine's own state, not the policy, decides what is valid. The
traces also re-admit requests in the step that preempts them (``OpMix.readmit_preempted``):
they serve conformance (two targets must agree), not an oracle.

With ``invalid_rate > 0`` a fraction of the operations is deliberately invalid (unknown request
or event, a second finish, admitting a running request, a zero chunk...). Those carry
``"expect": "error"``, as in the trace format (``kvspec.drivers.trace``): drop that key before
``Engine.apply``, which must reject the operation without changing anything. Same config, same
``rng`` state, same trace. O(n_ops x engine snapshot).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.drivers.harness import generate
from kvspec.drivers.opgen import FAMILIES, OpMix

SHADOW_POLICY = "baseline"


def random_ops(config: OffloadConfig, rng: random.Random, n_ops: int, *, num_families: int = FAMILIES,
               invalid_rate: float = 0.0) -> list[dict[str, Any]]:
    """``n_ops`` engine operations for ``config``, drawn with ``rng``; see the module doc.
    ``AssertionError`` if the shadow engine refuses a valid operation or accepts an invalid one
    (the generator and the engine disagree: a bug in kvspec)."""
    from kvspec.model import make_scheduler

    shadow = replace(config, policy=SHADOW_POLICY)
    mix = OpMix(num_families, invalid_rate, readmit_preempted=True)
    ops, out = generate(shadow, make_scheduler, rng, n_ops, (), mix=mix, strict=True)
    if out.failed:
        raise AssertionError(f"the generated trace is not what its operations say: {out.describe()}")
    return ops
