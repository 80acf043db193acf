"""kvspec's engine operations on vLLM's real scheduler: ``VllmSchedulerDriver``.

The driver takes the operation alphabet of ``kvspec.drivers.engine.Engine`` (``add``,
``step``, ``report``, ``load_done``, ``finish``, ``reset``) and runs each on a
``kvspec.adapters.vllm_scheduler.VllmScheduler`` (vLLM 0.33.0's ``Scheduler`` or
``AsyncScheduler`` with the real SimpleCPUOffloadConnector; that module says how each
operation reaches vLLM). It plays the engine's part around vLLM and nothing else:

* **Requests** get the engine's prompts (``prompt_tokens(family, n)``) and the engine's sampled
  tokens (one id per request and output position), so that vLLM and the engine see the same
  tokens and hence the same block hashes.
* **Workers**: as in the engine, a store event shipped in the metadata owes one report per
  rank, and a load shipped is in flight until ``load_done``.
* **Checks**: every operation is checked as ``Engine.apply`` checks it, with the same
  ``KVSpecError`` subclass for the same bad input and nothing changed. An operation the engine
  accepts but vLLM has no counterpart for (preempting a request whose load completed but that
  vLLM has not scheduled again: vLLM preempts running requests only) raises
  ``OutsideVllmError``, nothing changed. Whatever vLLM raises propagates as what it is: a crash.

``snapshot()`` is vLLM's state in kvspec's format, with the unfinished requests' phases under
the engine's names; ``last_step`` is the last ``schedule()`` as a ``StepObservation``.
"""

from __future__ import annotations

from typing import Any

from kvspec.adapters.vllm_scheduler import SchedulerOptions, StepObservation, VllmScheduler
from kvspec.contract.checks import check_count, check_max_tokens
from kvspec.contract.config import OffloadConfig
from kvspec.contract.errors import (
    InvalidCountError,
    InvalidOperationError,
    UnknownEventError,
    UnknownRequestError,
    echo,
)
from kvspec.drivers.engine import (
    FINISHED,
    LOADED,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_ID,
    PREEMPTED,
    RUNNING,
    WAITING,
    WAITING_FOR_REMOTE,
    bind_operation,
    check_step_args,
    prompt_tokens,
)

SAMPLED_TOKEN_BASE = 2_000_000_000  # the engine's sampled token ids (EngineRequest.append_output_token)
SAMPLED_TOKENS_PER_REQUEST = 100_000


class OutsideVllmError(Exception):
    """An operation the engine accepts that has no counterpart in vLLM's scheduler (nothing was
    changed). Neither a rejection of bad input nor a crash."""


class VllmSchedulerDriver:
    """vLLM's scheduler behind the engine's operations (``apply(op)``, one trace operation)."""

    OPS = ("add", "step", "report", "load_done", "finish", "reset")

    def __init__(self, config: OffloadConfig, options: SchedulerOptions | None = None) -> None:
        self.config = config
        self.options = options or SchedulerOptions()
        self.vllm = VllmScheduler(config, self.options, self._token)
        self.serial: dict[str, int] = {}  # creation order of every request ever added
        self.reports_left: dict[int, int] = {}
        self.loads_shipped: dict[str, int] = {}

    @property
    def last_step(self) -> StepObservation:
        return self.vllm.last_step

    def _token(self, rid: str, num_output_tokens: int) -> int:
        """The engine's sampled token at output position ``num_output_tokens`` of ``rid``."""
        return SAMPLED_TOKEN_BASE + self.serial[rid] * SAMPLED_TOKENS_PER_REQUEST + num_output_tokens

    # -- dispatch ----------------------------------------------------------------------------

    def apply(self, op: dict[str, Any]) -> Any:
        """Run one trace operation, checked as ``Engine.apply`` checks it (same rejections)."""
        _, handler, args = bind_operation(self, op, self.OPS)
        return handler(**args)

    # -- operations --------------------------------------------------------------------------

    def op_add(self, rid: str, family: int, prompt_len: int, max_tokens: int = 4,
               format: int | None = None) -> None:
        """A new request with the engine's prompt for ``family`` (``max_tokens`` as ``Engine.op_add``)."""
        if not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID:
            raise InvalidOperationError(f"request id must be a string of 1..{MAX_REQUEST_ID} characters, "
                                        f"got {echo(rid)}")
        if rid in self.serial:
            raise InvalidOperationError(f"request {echo(rid)} already exists")
        check_count(family, "family")
        check_count(prompt_len, "prompt_len", MAX_PROMPT_TOKENS)
        check_max_tokens(max_tokens, MAX_PROMPT_TOKENS, format)
        if prompt_len == 0:
            raise InvalidCountError("prompt_len must be >= 1")
        self.serial[rid] = len(self.serial)
        self.vllm.add_request(rid, prompt_tokens(family, prompt_len), max_tokens)

    def op_step(self, admit: list[str] | None = None, chunk: int = 64, preempt: list[str] | None = None,
                resume: str = "mrv1", budget: int | None = None, accept: int = 0) -> StepObservation:
        """One engine-core step; the workers receive its metadata."""
        admit_ids, preempt_ids = self._check_step(admit, chunk, preempt, resume, budget, accept)
        observed = self.vllm.step(admit_ids, chunk, preempt_ids, resume, budget, accept)
        meta = observed.metadata
        if meta["store_event"] >= 0:
            self.reports_left[meta["store_event"]] = self.config.world_size
        if meta["load_event"] >= 0:
            for rid in meta["load_event_to_reqs"].get(str(meta["load_event"]), []):
                self.loads_shipped[rid] = meta["load_event"]
        return observed

    def _check_step(self, admit: object, chunk: object, preempt: object, resume: object,
                    budget: object, accept: object) -> tuple[list[str], list[str]]:
        """The engine's checks of a step, then ``OutsideVllmError`` for preempting a request vLLM
        does not hold as running. Changes nothing."""
        admit_ids, preempt_ids = check_step_args(admit, chunk, preempt, resume, budget, self.status, accept,
                                                 self.config.num_speculative_tokens)
        for rid in preempt_ids:
            if not self.vllm.is_running(rid):
                raise OutsideVllmError(f"preempt {rid}: its load completed but vLLM has not scheduled it "
                                       "again; vLLM preempts running requests only")
        return admit_ids, preempt_ids

    def op_report(self, event: int, count: int = 1) -> None:
        """``count`` ranks report store ``event`` done."""
        if not isinstance(event, int) or isinstance(event, bool) or event not in self.reports_left:
            raise UnknownEventError(f"store event {echo(event)} is not in flight")
        check_count(count, "count", self.reports_left[event])
        if count == 0:
            raise InvalidCountError("count must be >= 1")
        self.vllm.report(event, count)
        self.reports_left[event] -= count
        if self.reports_left[event] == 0:
            del self.reports_left[event]

    def op_load_done(self, rid: str) -> None:
        """The workers report ``rid``'s load complete."""
        if not isinstance(rid, str) or rid not in self.loads_shipped:
            raise UnknownRequestError(f"{echo(rid)} has no load in flight")
        self.vllm.load_done(rid)
        del self.loads_shipped[rid]

    def op_finish(self, rid: str) -> None:
        """``rid`` is aborted, in whatever phase it is."""
        if self.status(rid) == FINISHED:
            raise InvalidOperationError(f"{rid} already finished")
        self.vllm.finish(rid)

    def op_reset(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``."""
        return self.vllm.reset()

    # -- observation --------------------------------------------------------------------------

    def status(self, rid: object) -> str:
        """The engine's name for ``rid``'s phase; ``UnknownRequestError`` for an id never added.

        vLLM's ``WAITING_FOR_REMOTE_KVS`` is ``loaded`` once the load is reported, and so is a
        waiting request that holds computed tokens (a loaded one vLLM could not schedule yet)."""
        if not isinstance(rid, str) or rid not in self.serial:
            raise UnknownRequestError(f"unknown request {echo(rid)}")
        phase = self.vllm.phase(rid)
        if phase.finished:
            return FINISHED
        if phase.status == "WAITING_FOR_REMOTE_KVS":
            return LOADED if phase.load_reported else WAITING_FOR_REMOTE
        if phase.status == "RUNNING":
            return RUNNING
        if phase.num_computed_tokens > 0:
            return LOADED
        return PREEMPTED if phase.status == "PREEMPTED" else WAITING

    def snapshot(self) -> dict[str, Any]:
        """vLLM's state in kvspec's format; each unfinished request with its phase. O(state)."""
        snap = self.vllm.snapshot()
        snap["requests"] = {rid: {"status": self.status(rid), **view} for rid, view in snap["requests"].items()}
        return snap
