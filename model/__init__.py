"""kvspec's executable specification: plain Python, no torch.

``make_scheduler(config)`` builds the model target for ``config.policy``:
``baseline`` (vLLM 0.33.0), ``signal-rescan`` (PR #47235) or ``repair`` (kvspec's).
"""

from kvspec.contract.config import OffloadConfig
from kvspec.model.block_pool import BlockPool
from kvspec.model.repair import RepairScheduler
from kvspec.model.scheduler import OffloadScheduler
from kvspec.model.signal_rescan import SignalRescanScheduler

POLICY_CLASSES: dict[str, type[OffloadScheduler]] = {
    "baseline": OffloadScheduler,
    "signal-rescan": SignalRescanScheduler,
    "repair": RepairScheduler,
}


def make_scheduler(config: OffloadConfig) -> OffloadScheduler:
    """A model scheduler for ``config.policy`` with a fresh GPU pool bound to it."""
    config.validate()
    return POLICY_CLASSES[config.policy](config, BlockPool(config.num_gpu_blocks, "gpu", config.num_groups))


__all__ = ["POLICY_CLASSES", "BlockPool", "OffloadScheduler", "RepairScheduler", "SignalRescanScheduler",
           "make_scheduler"]
