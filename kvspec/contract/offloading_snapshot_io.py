"""Validating snapshots of the second manager (``manager: offloading``) against
``kvspec/contract/schema/offloading-snapshot.schema.json``.

A snapshot of vLLM's CPUOffloadingManager as ``OffloadingManagerTarget.snapshot()`` writes it
(the model, the implementation, vLLM's own manager through ``kvspec.adapters.vllm_offloading``),
with the ``observed`` section a driver adds (``kvspec.drivers.offloading.Driver.snapshot``).
``kvspec check-snapshot`` reads it as it reads the first manager's: the same passes (depth, the
format version, the schema through ``kvspec.contract.schema_check``), then the cross-field rules
the schema cannot state (``_consistency_issues``): the policy section is the configured policy's,
and an LRU order's keys have ranks when ranks are given. After them every O-invariant of the
catalogue evaluates without an index or key error.

A snapshot of the connector harness (``kvspec.adapters.vllm_offloading_connector``) adds a
``connector`` section (vLLM's scheduler, GPU blocks and transfer jobs); this format does not
describe it, and such a snapshot is refused by name. Cost: one compiled predicate pass and
one pass over the LRU order.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

from kvspec.contract.schema_check import FormatIssue, SchemaValidator, depth_issue, packaged_schema

SCHEMA_RESOURCE = "offloading-snapshot.schema.json"
MAX_DEPTH = 64  # as the first manager's format (this one needs six levels)

DEF_NOUNS = {
    "key": ('a cache key "<hash>:<group>"', 'cache keys "<hash>:<group>"'),
    "count": ("a non-negative integer", "non-negative integers"),
    "request_id": ("a request id (a non-empty string)", "request ids (non-empty strings)"),
}


@cache
def load_offloading_schema() -> dict[str, Any]:
    """The offloading snapshot schema shipped with kvspec (checked to use only supported keywords)."""
    return packaged_schema(SCHEMA_RESOURCE)


@cache
def _validator() -> SchemaValidator:
    return SchemaValidator(load_offloading_schema(), DEF_NOUNS, "offloading snapshot schema")


def offloading_snapshot_issues(snapshot: dict[str, Any]) -> list[FormatIssue]:
    """Every problem of ``snapshot`` (a dict whose ``manager`` is ``offloading``): the depth
    problem alone if any, a ``connector`` section by name, else every schema problem, else
    every cross-field problem."""
    deep = depth_issue(snapshot, MAX_DEPTH)
    if deep is not None:
        return [deep]
    if "connector" in snapshot:
        return [FormatIssue("connector", "a section of the OffloadingConnector harness (vLLM's scheduler, GPU "
                            "blocks, transfer jobs), which this format does not describe: its invariants O11-O15 "
                            "are judged where the harness runs; drop the section to check the manager's")]
    issues = _validator().issues(snapshot)
    return issues or list(_consistency_issues(snapshot))


def _consistency_issues(s: dict[str, Any]) -> Iterator[FormatIssue]:
    """The policy section names the configured policy only; an LRU order's keys are ranked."""
    policy = s["config"]["policy"]
    if set(s["policy"]) != {policy}:
        yield FormatIssue("policy", f"must hold exactly the configured policy's state ({policy!r}), "
                          f"has {sorted(s['policy']) or 'none'}")
        return
    lru = s["policy"].get("lru")
    if lru is not None and lru["ranks"] is not None:
        unranked = [k for k in lru["order"] if k not in lru["ranks"]]
        if unranked:
            yield FormatIssue("policy.lru.order", f"key {unranked[0][:60]!r} has no entry in policy.lru.ranks"
                              + (f" (and {len(unranked) - 1} more)" if len(unranked) > 1 else ""))
