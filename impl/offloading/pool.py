"""The chunk pool on tensors: vLLM ``CPUOffloadingManager``'s slots and ref counts.

Per slot an int32 ref count (-1 = being stored, else the loads in flight; meaningless on a
free slot) and the int64 id of the key it holds (-1 = free). New chunks take never-used slots
first (``num_allocated`` counts the slots ever handed out), then the slot freed last: the free
list is a tensor stack ``stack[:top]``, bottom first.
"""

from __future__ import annotations

import torch

STORING = -1


class ChunkPool:
    def __init__(self, num_chunks: int, device: torch.device) -> None:
        self.num_chunks = num_chunks
        self.device = device
        self.ref = torch.zeros(num_chunks, dtype=torch.int32, device=device)
        self.key = torch.full((num_chunks,), -1, dtype=torch.int64, device=device)
        self.stack = torch.zeros(num_chunks, dtype=torch.int64, device=device)
        self.top = 0
        self.num_allocated = 0

    def num_free(self) -> int:
        return self.top + self.num_chunks - self.num_allocated

    def resident(self) -> torch.Tensor:
        """Mask of slots holding a key."""
        return self.key >= 0

    def push(self, slots: torch.Tensor) -> None:
        """Free ``slots``, in order (the last one is popped first)."""
        k = slots.numel()
        self.stack[self.top:self.top + k] = slots
        self.top += k

    def allocate(self, n: int) -> torch.Tensor:
        """``n`` slots (the caller has checked there are enough): never-used ones in order,
        then the top of the free stack downwards. O(n)."""
        fresh = min(n, self.num_chunks - self.num_allocated)
        out = torch.arange(self.num_allocated, self.num_allocated + fresh, dtype=torch.int64, device=self.device)
        self.num_allocated += fresh
        popped = n - fresh
        if popped:
            out = torch.cat([out, self.stack[self.top - popped:self.top].flip(0)])
            self.top -= popped
        return out

    def free_list(self) -> list[int]:
        return [int(s) for s in self.stack[:self.top].tolist()]

    def clear(self) -> None:
        self.key.fill_(-1)
        self.top = 0
        self.num_allocated = 0
