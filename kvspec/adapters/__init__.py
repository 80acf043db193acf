"""Layer 3, the targets kvspec does not own and the registry of all targets.

``vllm`` puts real vLLM's offload manager behind the ``OffloadTarget`` Protocol; ``targets``
names every target (``model``, ``impl``, ``vllm``, ``bug:<name>``) and builds it lazily.
"""
