"""Tensor forms of the scalar rules of ``kvspec.model.rules``, one element per candidate.

The scalar paths of the implementation call the rule functions themselves; the batched
paths use these, which tests/test_impl_rules.py holds to the rule functions on random
inputs. (``kvspec.impl.planner.classify`` and its scan are the batched
``classify_store_candidate`` and ``scan_group``, held to them by the same tests.)
"""

from __future__ import annotations

import torch


def ready_blocks(done: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """``rules.ready_blocks`` per (request, group): ``done[i]`` = computed tokens minus output
    placeholders of request i, ``lengths[i, g]`` its number of ids in group g; ``[k, G]``. O(k * G)."""
    confirmed = torch.div(done.clamp(min=0), block_size, rounding_mode="floor")
    return torch.minimum(lengths, confirmed.view(-1, 1))


def window_floors(confirmed: torch.Tensor, windows: torch.Tensor, block_size: int) -> torch.Tensor:
    """``rules.window_floor`` elementwise: ``confirmed[i]`` = computed tokens minus output
    placeholders (``windows`` >= 1 where the result is read). O(len)."""
    return torch.div((confirmed - windows + 1).clamp(min=0), block_size, rounding_mode="floor")
