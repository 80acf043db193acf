"""The second manager's executable specification: vLLM 0.33.0's ``CPUOffloadingManager``
with its LRU and ARC cache policies (``vllm/v1/kv_offload/cpu/``), plain Python.

``make_offloading_manager(config)`` builds the model target (``OffloadingManagerTarget``,
``kvspec.contract.offloading``).
"""

from kvspec.model.offloading.manager import OffloadingManager, make_offloading_manager

__all__ = ["OffloadingManager", "make_offloading_manager"]
