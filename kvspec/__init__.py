"""kvspec: the reference for KV-cache block bookkeeping with CPU offload.

``kvspec.model`` is the executable specification, ``kvspec.impl`` the torch-backed
implementation, ``kvspec.specs`` the proofs; this package holds the shared
contract (``kvspec.interfaces``), the errors, the trace format and the CLI.
"""

from kvspec.errors import KVSpecError
from kvspec.interfaces import KVGroup, OffloadConfig

__version__ = "0.1.0"
__all__ = ["KVGroup", "KVSpecError", "OffloadConfig", "__version__"]
