"""kvspec's executable specification: plain Python, no torch.

``make_scheduler(config)`` builds the model target for ``config.policy``: an
``OffloadScheduler`` (the mechanism, ``kvspec.model.scheduler``) holding the policy the
registry names (``kvspec.contract.policy.POLICY_REGISTRY``): ``baseline`` (vLLM 0.33.0,
``kvspec.model.baseline``), ``signal-rescan`` (PR #47235) or ``repair`` (kvspec's).
``POLICY_CLASSES`` maps each name to its model policy class (whose ``claims(config)`` the
oracle reads).
"""

from kvspec.contract.config import OffloadConfig
from kvspec.contract.policy import POLICY_REGISTRY
from kvspec.model.baseline import BaselinePolicy
from kvspec.model.block_pool import BlockPool
from kvspec.model.repair import RepairPolicy
from kvspec.model.scheduler import OffloadScheduler, PolicyClass, policy_class
from kvspec.model.signal_rescan import SignalRescanPolicy

POLICY_CLASSES: dict[str, PolicyClass] = {name: policy_class(name) for name in POLICY_REGISTRY}


def make_scheduler(config: OffloadConfig) -> OffloadScheduler:
    """A model scheduler for ``config.policy`` with a fresh GPU pool bound to it."""
    config.validate()
    return OffloadScheduler(config, BlockPool(config.num_gpu_blocks, "gpu", config.num_groups))


__all__ = ["POLICY_CLASSES", "BaselinePolicy", "BlockPool", "OffloadScheduler", "RepairPolicy", "SignalRescanPolicy",
           "make_scheduler"]
