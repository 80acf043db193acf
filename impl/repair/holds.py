"""CPU entries ``repair`` pins until the planning step (or finish flush) ends.

R5 (same-step protection): an entry the scan judged already cached is pinned so that the
step's own allocations cannot evict it; R7 (c): a live, useful entry the victim walk met
is refreshed. Both are released together (an LRU refresh) by ``release``, which also
forgets the keys judged already cached this step (an eviction of one of them during the
step is counted as a self-eviction).
"""

from __future__ import annotations

import torch

from kvspec.impl.block_pool import TensorBlockPool
from kvspec.impl.convert import int_tensor


class StepHolds:
    def __init__(self, cpu_pool: TensorBlockPool, device: torch.device) -> None:
        self.cpu_pool = cpu_pool
        self.device = device
        self.held: list[int] = []
        self.judged_cached: set[int] = set()

    def pin(self, blocks: list[int]) -> None:
        """Pin CPU blocks (one ref each listing) until ``release``. O(len)."""
        if blocks:
            self.cpu_pool.touch_t(int_tensor(blocks, self.device))
            self.held.extend(blocks)

    def pin_tensor(self, blocks: torch.Tensor) -> None:
        if blocks.numel():
            self.cpu_pool.touch_t(blocks)
            self.held.extend(blocks.tolist())

    def release(self) -> None:
        """The step ends: unpin everything held (in pin order), forget the judged keys."""
        self.judged_cached.clear()
        if self.held:
            held, self.held = self.held, []
            self.cpu_pool.free_t(int_tensor(held, self.device))
