"""Layer 4, the drivers: what runs targets and records what happened.

``engine`` plays vLLM's scheduler and KV-cache manager around a target; ``opgen`` and
``tracegen`` generate operations; ``trace`` reads and writes traces; ``harness`` runs
operations against a target under an oracle (one run loop: fuzz, replay, shrink). Depends on
the contract, the oracle and the target registry.
"""
