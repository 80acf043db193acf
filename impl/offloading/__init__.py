"""The second manager's implementation on tensors: vLLM 0.33.0's ``CPUOffloadingManager``
with its LRU and ARC policies, held to the model (``kvspec.model.offloading``) operation by
operation.

``make_offloading_impl(config, device="cpu")`` builds the target (``OffloadingManagerTarget``).
Where to read on: ``kvspec.impl.offloading.manager`` (the calls), ``.pool`` (slots, ref
counts, the free stack), ``.keys`` (keys interned to ids and the per-key columns), ``.lru``
and ``.arc`` (the policies' columns and their vectorised eviction). ``_check()`` runs every
structure's invariants.
"""

from __future__ import annotations

import torch

from kvspec.contract.offloading import OffloadingConfig
from kvspec.impl.offloading.manager import TensorOffloadingManager


def make_offloading_impl(config: OffloadingConfig, device: str | torch.device = "cpu") -> TensorOffloadingManager:
    return TensorOffloadingManager(config, device=device)


__all__ = ["TensorOffloadingManager", "make_offloading_impl"]
