"""The re-store policy contract: one Protocol for the model's and the implementation's policies.

A *policy* decides which GPU blocks an eager-mode scheduler stores to CPU and what it does
when the CPU pool evicts a cached entry. The scheduler around it (model or implementation)
owns the mechanism: pools, pins, events, completions, finishes, resets. The policy is told
about each of those through the methods below, with the same names in ``kvspec.model`` and
``kvspec.impl``; only the types of the step batch, of an eviction report and of a completed
transfer differ (lists in the model, tensors in the implementation), hence the three type
parameters.

``POLICY_REGISTRY`` is the one list of policies: every command, the oracle, the targets and
the documentation read the names, the summaries and where each side's class lives from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:  # the configuration reads the registry; the types module reads the configuration
    from kvspec.contract.types import RequestView, SchedulerOutput

BatchT_contra = TypeVar("BatchT_contra", contravariant=True)
EvictedT_contra = TypeVar("EvictedT_contra", contravariant=True)
CompletedT_contra = TypeVar("CompletedT_contra", contravariant=True)


class StorePolicy(Protocol[BatchT_contra, EvictedT_contra, CompletedT_contra]):
    """What a scheduler asks of its re-store policy. Each method is called by the scheduler
    only, at the point its name says, after the scheduler's own checks passed (a policy never
    sees a call that will be rejected)."""

    name: ClassVar[str]

    def plan_eager(self, out: SchedulerOutput, batch: BatchT_contra) -> None:
        """Plan the eager stores of one step into ``batch`` (GPU ids, CPU ids, requests served);
        runs inside ``build_connector_meta`` before the step's finish-flush transfers join."""

    def finish_flush(self, request: RequestView, block_ids: list[list[int]]) -> None:
        """A request finishes with this live block table: queue the stores its finish flush
        needs (they join the next store event)."""

    def on_cpu_evictions(self, evicted: EvictedT_contra) -> None:
        """The last CPU allocation evicted these cached entries (CPU block and its key)."""

    def on_store_completed(self, completed: CompletedT_contra) -> None:
        """A live store transfer completed at ``world_size`` and was registered on CPU."""

    def on_request_finished(self, rid: str) -> None:
        """The request's store state is finished or gone."""

    def on_reset(self) -> None:
        """``reset`` ran: forget policy state that refers to abandoned work."""

    def snapshot(self) -> dict[str, Any]:
        """Policy-specific state for the snapshot's ``policy_state`` (empty when none)."""


@dataclass(frozen=True)
class PolicyEntry:
    """One policy: its name, a one-line summary, and where each side's class lives
    (``module:attribute``, imported lazily so the contract imports neither side)."""

    name: str
    summary: str
    model: str
    impl: str


POLICY_REGISTRY: dict[str, PolicyEntry] = {
    e.name: e
    for e in (
        PolicyEntry("baseline", "vLLM 0.33.0 as it ships (the FIXME: an entry evicted below a cursor is never "
                    "stored again)", "kvspec.model.baseline:BaselinePolicy", "kvspec.impl.policies:BaselinePolicy"),
        PolicyEntry("signal-rescan", "PR #47235 as described: a pool-wide eviction flag triggers a rescan "
                    "below each cursor", "kvspec.model.signal_rescan:SignalRescanPolicy",
                    "kvspec.impl.policies:SignalRescanPolicy"),
        PolicyEntry("repair", "kvspec's exact loss records: every evicted position still owned is re-stored",
                    "kvspec.model.repair:RepairPolicy", "kvspec.impl.repair:RepairPolicy"),
    )
}
