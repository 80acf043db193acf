"""Layer 2, the oracle: what judges a run, shared by every target.

``catalogue`` holds the invariants (stable ids I1-I15, C1-C7), each a function of a snapshot
(and, for the plan invariants, of the observed plan); ``claims`` turns a policy, a bug or a
list of ids into the set of invariants that judges a run. Depends on the contract only.
"""
