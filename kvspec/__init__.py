"""kvspec: the reference for KV-cache block bookkeeping with CPU offload.

``kvspec.model`` is the executable specification, ``kvspec.impl`` the torch-backed
implementation, ``kvspec.specs`` the proofs; this package holds the shared
contract (``kvspec.contract``), the errors, the trace format and the CLI.
"""

import warnings

# A CPU torch without NumPy warns once, when imported, that it cannot use NumPy; kvspec never
# hands tensors to NumPy, and the warning would be two stray stderr lines in every command that
# loads the implementation. Set here, before any kvspec module imports torch.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from kvspec.contract.config import KVGroup, OffloadConfig  # noqa: E402
from kvspec.contract.errors import KVSpecError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["KVGroup", "KVSpecError", "OffloadConfig", "__version__"]
