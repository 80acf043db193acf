"""kvspec's torch-backed implementation, held to the model operation by operation.

``make_scheduler(config, device="cpu")`` builds the target for ``config.policy`` with
its own GPU pool; every piece of state is a tensor on ``device`` (nothing needs a
GPU). See ``kvspec.impl.scheduler`` for the shape of the state and
``kvspec.impl.planner`` for how a step is planned.
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
