"""The records that planning and the scheduler's bookkeeping pass around, on tensors.

* ``Transfer``: vLLM ``TransferMeta``, GPU and CPU block ids in pair order;
* ``StoreBatch``: what one planning step selects (the model's ``StoreBatch``), kept as
  tensor pieces that are concatenated once, when the step's store event is made;
* ``Evictions``: the cached CPU entries one allocation evicted, what a policy's
  ``on_cpu_evictions`` is told.

All block ids and key ids are int64 tensors on the scheduler's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvspec.contract.snapshot import Transfer as TransferPair


@dataclass
class Transfer:
    """A transfer: GPU and CPU block ids in pair order."""

    gpu: torch.Tensor
    cpu: torch.Tensor

    def pair(self) -> TransferPair:
        """The snapshot's form: (GPU ids, CPU ids) as lists. O(len)."""
        return self.gpu.tolist(), self.cpu.tolist()


@dataclass
class StoreBatch:
    """The stores one planning step selects, in order, and the requests they serve."""

    gpu: list[torch.Tensor] = field(default_factory=list)
    cpu: list[torch.Tensor] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)

    def add(self, gpu: torch.Tensor, cpu: torch.Tensor) -> None:
        """Append one piece of (GPU, CPU) pairs. O(1)."""
        self.gpu.append(gpu)
        self.cpu.append(cpu)


class Evictions(NamedTuple):
    """Cached CPU entries an allocation evicted: ``blocks[i]`` held key id ``kids[i]``."""

    blocks: torch.Tensor
    kids: torch.Tensor
