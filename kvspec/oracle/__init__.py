"""Layer 2, the oracle: what judges a run, shared by every target.

``catalogue`` holds the invariants (stable ids I1-I15, C1-C8), each a function of a snapshot
(and, for the plan invariants, of the observed plan); ``oracles`` names and parses sets of ids
(``claims``, ``all``, ``C1,I9``). What a policy or a bug variant claims is read from the targets
(``kvspec.adapters.claims``). Depends on the contract (and the pure rules) only.
"""
