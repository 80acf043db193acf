"""Layer 1, the contract: what every target offers and every other layer relies on.

``config`` (``OffloadConfig``), ``types`` (vLLM-shaped inputs and outputs, the ``OffloadTarget``
and ``GpuPool`` Protocols), ``policy`` (the ``StorePolicy`` Protocol of the re-store policies),
``checks`` (input checks shared by every target), ``errors`` (the ``KVSpecError`` hierarchy and
exit codes), ``snapshot`` (the canonical state format) and ``snapshot_io`` (reading and
validating snapshot files). Imports nothing else of kvspec.
"""
