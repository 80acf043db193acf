"""kvspec's torch-backed implementation, held to the model operation by operation.

``make_scheduler(config, device="cpu")`` builds the target for ``config.policy`` with
its own GPU pool; every piece of state is a tensor on ``device`` (nothing needs a
GPU). Where to read on: ``kvspec.impl.scheduler`` (the shape of the state),
``kvspec.impl.planner`` and ``kvspec.impl.segments`` (how a step is planned),
``kvspec.impl.facade`` (what a policy sees of the scheduler), ``kvspec.impl.policies``
and ``kvspec.impl.repair`` (the policies). Every structure has a ``_check()`` of its own
invariants; ``TensorOffloadScheduler._check()`` runs them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvspec.contract.config import OffloadConfig

if TYPE_CHECKING:
    from kvspec.impl.scheduler import TensorOffloadScheduler


def make_scheduler(config: OffloadConfig, device: str | torch.device = "cpu",
                   block_shape: tuple[int, ...] = (2, 8), dtype: torch.dtype = torch.float32) -> TensorOffloadScheduler:
    """An implementation target for ``config`` (any policy, eager or lazy)."""
    from kvspec.impl.scheduler import TensorOffloadScheduler

    return TensorOffloadScheduler(config, device=device, block_shape=block_shape, dtype=dtype)


__all__ = ["make_scheduler"]
