"""The engine model: the environment that drives a target in vLLM's call order.

It plays the parts of vLLM's scheduler, KV-cache manager and workers around the
offload manager under test (docs/vllm-semantics.md §6), under vLLM's synchronous
``Scheduler`` or, when ``config.async_scheduling`` (vLLM 0.33.0's default), its
``AsyncScheduler`` stepped as engine core's batch queue steps it:

* **Requests** have prompt tokens drawn from a *family* (same family, same prefix,
  same chained hashes), so prefixes are shared on purpose; sampled tokens are
  unique per request.
* **step** is one ``schedule()`` of vLLM 0.33.0's synchronous ``Scheduler`` (``op_step`` gives
  the order; judged against the real one by ``kvspec.drivers.lockstep``): explicit
  preemptions first (blocks freed in reverse order per group); the running queue in
  admission order, with vLLM's preemption from its tail when an allocation fails;
  sliding-window blocks that left the window are freed before a request's allocation
  (``remove_skipped_blocks``; the connector is not told); then the requests holding a load
  (a completed one through the "already computed" branch) and the admissions: the GPU-local
  lookup, the connector lookup, the whole-sequence and async-load reservations, the
  allocation and ``update_state_after_alloc``. ``chunk`` and ``budget`` are vLLM's long-prefill
  threshold and step token budget. Then ``build_connector_meta``, then the computed counts
  advance (so tokens are *confirmed one step late*), GPU blocks were hashed at schedule
  time, the forward runs and a token is sampled where the prompt is done.
* **Async scheduling** (``config.async_scheduling``): each step schedules a batch and then
  processes the oldest batch's output only once two are in flight (or nothing else can be
  scheduled), so sampled tokens come back one step late. A request that will sample counts an
  *output placeholder* (``num_computed_tokens`` includes it; confirmed tokens are computed minus
  placeholders); the running pass skips a request whose placeholders already reach
  ``max_tokens``; a request stops at ``max_tokens`` in the processing of the batch that sampled
  its last token (and then finishes, blocks freed, finish flush queued); blocks of a request whose
  last batch is still in flight are freed only once that batch is processed (vLLM's
  ``defer_block_free``: the connector can load); no request whose blocks are in flight is preempted
  to make room; out-of-window blocks are freed on processed tokens (computed minus in flight); a
  preempted request's output still in flight is appended on return, and the request is not
  admitted again until it has drained. Synchronous scheduling processes each batch in its own step
  and keeps a request until ``finish`` (it samples nothing past ``max_tokens``).
* **Workers**: loads copy CPU data to GPU when shipped; stores copy GPU data after
  the step's forward (the compute-done barrier) and land in the CPU when the last
  rank reports. ``report`` delivers one rank count for one event, in any order.
* **finish** (stop or abort, in any phase) calls ``request_finished_all_groups``
  with the live table clipped to the computed tokens, then frees the GPU blocks in
  reverse order (after the load, for a request still waiting on one).
* **reset** is ``reset_prefix_cache(reset_connector=True)``: GPU pool, then target.

Content model: ``gpu_data``/``cpu_data`` hold, per block, the hash of the tokens
really written into it (None when nothing full was written). Data is what the
forward computed or what a copy moved, never what the bookkeeping says, so a wrong
copy or a store of unconfirmed data shows up as data != key (I10-I12).

Every operation checks its arguments first and raises a ``KVSpecError`` without
changing anything when they are wrong.
"""

from __future__ import annotations

import inspect
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvspec.contract.checks import check_count, check_max_tokens
from kvspec.contract.config import MAX_BATCHED_TOKENS
from kvspec.contract.errors import (
    InvalidCountError,
    InvalidOperationError,
    KVSpecError,
    UnknownEventError,
    UnknownRequestError,
    echo,
)
from kvspec.contract.types import (
    CachedRequestData,
    ConnectorMetadata,
    KVConnectorOutput,
    NewRequestData,
    OffloadTarget,
    SchedulerOutput,
)
from kvspec.model.block_pool import NULL_BLOCK
from kvspec.model.hashing import ROOT_HASH, BlockHash, BlockKey, block_hashes, chain_hash
from kvspec.model.hit_search import find_longest_cache_hit
from kvspec.model.rules import window_floor
from kvspec.oracle.catalogue import observe_finish, observe_plan

WAITING, RUNNING, WAITING_FOR_REMOTE, LOADED, PREEMPTED, FINISHED = (
    "waiting", "running", "waiting_for_remote_kvs", "loaded", "preempted", "finished",
)
MAX_PROMPT_TOKENS = 1 << 16
MAX_REQUEST_ID = 256


def _request_list(value: object, what: str) -> list[str]:
    """``admit``/``preempt``: None or a list of request-id strings."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidOperationError(f"{what} must be a list of request ids (strings), got {echo(value)}")
    return list(value)


def bind_operation(driver: object, op: object, ops: tuple[str, ...]) -> tuple[str, Callable[..., Any], dict[str, Any]]:
    """A trace operation bound to ``driver``'s handler ``op_<name>`` before it runs: an operation
    that is not a dict, an unknown name or arguments the handler's signature refuses are an
    ``InvalidOperationError`` (nothing ran), so whatever the handler raises later is its own.
    Shared by every driver that takes the engine's operations. Returns (name, handler, args)."""
    if not isinstance(op, dict):
        raise InvalidOperationError(f"an operation must be a dict with an \"op\" key, got {echo(op)}")
    name = op.get("op")
    if not isinstance(name, str) or name not in ops:
        raise InvalidOperationError(f"unknown operation {echo(name)}; known: {', '.join(ops)}")
    handler = getattr(driver, f"op_{name}")
    args = {k: v for k, v in op.items() if k != "op"}
    signature, names, required = _handler_signature(type(driver), name)
    if names is None or not (args.keys() <= names and required <= args.keys()):
        try:
            signature.bind(None, **args)
        except TypeError as exc:
            raise InvalidOperationError(f"bad arguments for {name}: {exc}") from None
    return name, handler, args


_SIGNATURES: dict[tuple[type, str], tuple[inspect.Signature, frozenset[str] | None, frozenset[str]]] = {}


def _handler_signature(driver_type: type, name: str) -> tuple[inspect.Signature, frozenset[str] | None, frozenset[str]]:
    """The signature of ``driver_type.op_<name>`` (``self`` included), computed once per class and
    operation (reading it costs more than most operations do), with the names of its keyword
    arguments and of the required ones: arguments whose names are among the first and include the
    second bind without ``Signature.bind`` (which still runs for anything else, and words the
    error). Names are None when the handler takes a variadic or positional-only argument."""
    key = (driver_type, name)
    if key not in _SIGNATURES:
        signature = inspect.signature(getattr(driver_type, f"op_{name}"))
        params = list(signature.parameters.values())[1:]
        plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD or p.kind is inspect.Parameter.KEYWORD_ONLY
                    for p in params)
        _SIGNATURES[key] = (signature, frozenset(p.name for p in params) if plain else None,
                            frozenset(p.name for p in params if p.default is inspect.Parameter.empty))
    return _SIGNATURES[key]


def check_step_args(admit: object, chunk: object, preempt: object, resume: object, budget: object,
                    status_of: Callable[[object], str], accept: object = 0,
                    num_speculative_tokens: int = 0) -> tuple[list[str], list[str]]:
    """The checks of a ``step`` operation's arguments, shared by every driver that takes the
    engine's operations: request lists, a chunk of 1..MAX_PROMPT_TOKENS (with speculative decoding,
    at least the 1 + k rows of a padded decode: vLLM asserts that a padded decode keeps them all,
    and a long-prefill threshold below that would cut it), a budget of None or
    1..MAX_BATCHED_TOKENS, the resume mode, ``accept`` in 0..k (k = ``num_speculative_tokens``),
    only running requests preempted (vLLM preempts only what runs: a request whose load completed
    and that waits to be scheduled cannot be), only waiting or preempted ones admitted, no request
    repeated. ``status_of`` reads a request's status. Returns (admit, preempt); changes nothing."""
    admit_ids, preempt_ids = _request_list(admit, "admit"), _request_list(preempt, "preempt")
    chunk = check_count(chunk, "chunk", MAX_PROMPT_TOKENS)
    if chunk == 0:
        raise InvalidCountError("chunk must be >= 1")
    if num_speculative_tokens and chunk <= num_speculative_tokens:
        raise InvalidCountError(f"chunk must be >= {1 + num_speculative_tokens} (a decode with "
                                f"{num_speculative_tokens} draft tokens), got {echo(chunk)}")
    check_count(accept, "accept", num_speculative_tokens)
    if budget is not None:
        check_count(budget, "budget", MAX_BATCHED_TOKENS)
        if budget == 0:
            raise InvalidCountError("budget must be >= 1")
    if not isinstance(resume, str) or resume not in ("mrv1", "mrv2"):
        raise InvalidOperationError(f"resume must be 'mrv1' or 'mrv2', got {echo(resume)}")
    for rid in preempt_ids:
        if (status := status_of(rid)) != RUNNING:
            raise InvalidOperationError(f"cannot preempt {rid}: it is {status}")
    for rid in admit_ids:
        if (status := status_of(rid)) not in (WAITING, PREEMPTED) and rid not in preempt_ids:
            raise InvalidOperationError(f"cannot admit {rid}: it is {status}")
    if len(set(admit_ids)) != len(admit_ids) or len(set(preempt_ids)) != len(preempt_ids):
        raise InvalidOperationError("admit and preempt must not repeat a request")
    return admit_ids, preempt_ids


@dataclass
class StepBudget:
    """vLLM's token accounting in one ``schedule()``: ``left`` tokens of the step's budget (None:
    no step budget) and the per-request cap ``threshold`` (``long_prefill_token_threshold``; 0:
    none). O(1) per call."""

    left: int | None
    threshold: int

    def open(self) -> bool:
        """Tokens are left: vLLM's passes stop at an exhausted budget."""
        return self.left is None or self.left > 0

    def share(self, need: int) -> int:
        """The tokens a request that needs ``need`` gets: capped by the threshold, then by what is
        left."""
        n = self.threshold if 0 < self.threshold < need else need
        return n if self.left is None else min(n, self.left)

    def spend(self, n: int) -> None:
        """``n`` tokens were scheduled."""
        if self.left is not None:
            self.left -= n


@dataclass
class Drafts:
    """Speculative decoding in one ``schedule()``: the draft tokens scheduled per request (vLLM's
    ``scheduled_spec_decode_tokens``), those that only pad a decode admitted from the waiting queue
    (no drafter proposed them: they are all rejected), and what the waiting pass's padding rule reads
    of the running pass (a request still prefilling was scheduled; anything was scheduled)."""

    scheduled: dict[str, int] = field(default_factory=dict)
    padded: set[str] = field(default_factory=set)
    prefill_scheduled: bool = False
    running_scheduled: bool = False


@dataclass
class Batch:
    """A scheduled batch whose output is not processed yet: tokens per request (scheduling order),
    the requests it samples a token for, and its draft tokens."""

    scheduled: dict[str, int]
    sampling: list[str]
    drafts: Drafts = field(default_factory=Drafts)

    @property
    def total(self) -> int:
        return sum(self.scheduled.values())


@dataclass
class EngineRequest:
    """A request as the engine sees it; also the ``RequestView`` the target reads."""

    request_id: str
    family: int
    prompt: list[int]
    max_tokens: int
    block_size: int
    num_groups: int
    serial: int
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    skip_reading_prefix_cache: bool = False
    status: str = WAITING
    table: list[list[int]] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    was_preempted: bool = False
    free_after_load: bool = False
    num_in_flight_tokens: int = 0  # scheduled in batches whose output is not processed yet
    num_stale_output_tokens: int = 0  # of those, scheduled before a preemption (output appended on return)
    last_sched_seq: int = 0  # the scheduled-step sequence number of the last batch that scheduled it
    num_spec_tokens: int = 0  # vLLM len(spec_token_ids): drafts (async: their placeholders) to verify next
    is_prefill_chunk: bool = False  # as of its last schedule: still prefilling (it sampled nothing)

    def __post_init__(self) -> None:
        self.table = [[] for _ in range(self.num_groups)]
        self.block_hashes = block_hashes(self.prompt, self.block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_at(self, position: int) -> int:
        """The token at ``position``: the prompt's, or the one the request samples there (a pure
        function of the request and the position, so known before it is sampled)."""
        if position < len(self.prompt):
            return self.prompt[position]
        return 2_000_000_000 + self.serial * 100_000 + position - len(self.prompt)

    def append_output_token(self) -> None:
        """Sample one token; a newly full block gets its chained hash."""
        self.output.append(self.token_at(self.num_tokens))
        if self.num_tokens % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            self.block_hashes.append(chain_hash(parent, tuple(self.all_tokens[-self.block_size :])))

    def written_hash(self, p: int) -> BlockHash:
        """The chained hash of the tokens a forward writes into block position ``p``: the block hash
        once the tokens are appended, before that the hash of the tokens that will be (an input
        position may hold a token sampled by a batch whose output is still in flight). O(p)."""
        if p < len(self.block_hashes):
            return self.block_hashes[p]
        h = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        for q in range(len(self.block_hashes), p + 1):
            h = chain_hash(h, tuple(self.token_at(t) for t in range(q * self.block_size, (q + 1) * self.block_size)))
        return h


def prompt_tokens(family: int, length: int) -> list[int]:
    """Prompt of ``length`` tokens of ``family``: equal families share every prefix."""
    return [family * 1_000_000 + i for i in range(length)]


OBSERVATIONS = ("last_plan", "finishes", "converging_step")
"""The facts the engine measures for the oracle from outside the target, each shown in its
snapshot's engine section: what a planning step or finish flush did (``last_plan``, C3, C5, C6:
snapshots before and after the planning), what each finish of the operation had to flush and
what it left uncovered right after its flush (``finishes``, C7, C8: an abort, or a stop at
``max_tokens`` while a step processes its output; ``catalogue.observe_finish``) and
whether a step began quiescent (``converging_step``, C4). Measuring them costs a target snapshot
before and one after each planning or finish flush; an engine told to observe fewer shows the
others as None (False) and judges nothing differently for an oracle that does not read them."""


class Engine:
    """Drives one ``OffloadTarget``; ``apply(op)`` runs one trace operation. ``observe``: which of
    ``OBSERVATIONS`` to measure (all by default). ``keep_snapshots``: the target's snapshot is
    taken once and kept until the engine next makes a call that may change the target or its
    GPU pool (the fuzzer's runs: an operation that calls nothing, such as ``add``, or a step
    whose output processing calls nothing after the planning, reads the kept one)."""

    def __init__(self, target: OffloadTarget, observe: Iterable[str] = OBSERVATIONS,
                 keep_snapshots: bool = False) -> None:
        self.target = target
        self.keep_snapshots = keep_snapshots
        self._kept: dict[str, Any] | None = None  # the target's snapshot, while no call may have changed it
        self.generation = 0  # target snapshots taken; the one kept (or last taken) is this one
        self.served_generation = 0  # the generation of the target sections the last ``snapshot()`` showed
        self.observe = frozenset(observe)
        self.config = target.config
        self.gpu = target.gpu_pool
        self.B = self.config.block_size
        self.G = self.config.num_groups
        self.K = self.config.num_speculative_tokens  # draft tokens per decode step (0: no speculative decoding)
        self.requests: dict[str, EngineRequest] = {}  # every request ever added, in creation order
        self.live: dict[str, EngineRequest] = {}  # those not finished, or still holding blocks for a load
        self.running: list[str] = []  # vLLM's running queue: admission (or resumption) order
        self.holding: list[str] = []  # vLLM's kv_holding_waiting: requests with a load, in the order they got it
        self.inflight_prefills: set[str] = set()  # vLLM's _inflight_prefills (async-load admission reservation)
        self.retired: set[str] = set()  # finished requests nothing names any more (dropped from requests)
        self.gpu_data: list[BlockHash | None] = [None] * self.config.num_gpu_blocks
        self.cpu_data: list[BlockHash | None] = [None] * self.config.num_cpu_blocks
        self.store_transfers: dict[int, tuple[list[int], list[int]]] = {}
        self.store_payload: dict[int, list[BlockHash | None]] = {}
        self.store_selection_confirmed: dict[int, list[bool]] = {}
        # block -> its key, for the blocks that requests finished since the last build held at
        # confirmed positions: a finish flush is queued then and sent at the next build (I10)
        self.finished_confirmed: dict[int, BlockKey | None] = {}
        self.reports_left: dict[int, int] = {}
        self.loads_shipped: dict[str, int] = {}
        self.preempted_since_step: set[str] = set()
        self.finished_since_step: set[str] = set()
        self.async_scheduling = self.config.async_scheduling
        self.batch_queue_size = 2 if self.async_scheduling else 1  # vLLM's max_concurrent_batches
        self.defer_block_free = self.async_scheduling  # vLLM: batches overlap and the connector loads
        self.in_flight: deque[Batch] = deque()  # newest first, as engine core's batch queue
        self.sched_step_seq = 0  # non-empty batches scheduled (vLLM's fence counters)
        self.processed_step_seq = 0  # non-empty batches processed
        # (fence, blocks in allocation order, those of them at confirmed positions when set aside)
        self.deferred_frees: deque[tuple[int, list[int], set[int]]] = deque()
        self.rule_counts: Counter[str] = Counter()  # how often each async or speculative-decoding rule applied
        self.step_index = 0
        self.last_op: str | None = None
        self.last_result: Any = None
        self.converging_step = False
        self.finishes: list[dict[str, Any]] = []  # the last operation's finishes (observe_finish)
        self.last_plan: dict[str, Any] | None = None

    # -- dispatch ----------------------------------------------------------------------------

    OPS = ("add", "step", "report", "load_done", "finish", "reset")

    def apply(self, op: dict[str, Any]) -> Any:
        """Run one operation given as a trace dict (``{"op": name, ...}``).

        The arguments are bound to the handler's signature *before* it runs, so a wrong
        argument is a rejection (``InvalidOperationError``, nothing changed) while any
        exception raised inside the handler, ``TypeError`` included, propagates as what it
        is: a crash of the engine or of the target, never "bad input"."""
        name, handler, args = bind_operation(self, op, self.OPS)
        previous_plan, self.last_plan = self.last_plan, None
        previous_finishes, self.finishes = self.finishes, []
        try:
            result = handler(**args)
        except KVSpecError:
            self.last_plan = previous_plan  # a rejection leaves the observations as they were
            self.finishes = previous_finishes
            raise
        self.last_op, self.last_result = name, result
        return result

    # -- operations --------------------------------------------------------------------------

    def op_add(self, rid: str, family: int, prompt_len: int, max_tokens: int = 4,
               format: int | None = None) -> None:
        """A new request arrives (waiting); no target call. ``max_tokens`` >= 1, or 0 with a trace
        ``format`` of 1-3 (``check_max_tokens``)."""
        if not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID:
            raise InvalidOperationError(f"request id must be a string of 1..{MAX_REQUEST_ID} characters, "
                                        f"got {echo(rid)}")
        if rid in self.requests or rid in self.retired:
            raise InvalidOperationError(f"request {echo(rid)} already exists")
        check_count(family, "family")
        check_count(prompt_len, "prompt_len", MAX_PROMPT_TOKENS)
        check_max_tokens(max_tokens, MAX_PROMPT_TOKENS, format)
        if prompt_len == 0:
            raise InvalidCountError("prompt_len must be >= 1")
        self.requests[rid] = self.live[rid] = EngineRequest(
            rid, family, prompt_tokens(family, prompt_len), max_tokens, self.B, self.G, serial=self.num_added)

    def op_step(self, admit: list[str] | None = None, chunk: int = 64, preempt: list[str] | None = None,
                resume: str = "mrv1", budget: int | None = None, accept: int = 0) -> ConnectorMetadata:
        """One engine step: ``schedule()``, ``build_connector_meta``, forward, sample.

        ``schedule()`` follows vLLM's ``Scheduler.schedule`` (synchronous): the named preemptions,
        then the running queue in its order (``_schedule_running``; a failed allocation preempts
        from the queue's tail and retries, and ends the running pass), then, only when that pass
        preempted nobody, the requests holding a load in their order (``_schedule_loaded``) and
        the admissions in ``admit``'s order (``_admit``); the first allocation that fails ends
        the waiting pass. ``chunk`` is vLLM's ``long_prefill_token_threshold`` and ``budget`` the
        step's token budget (``max_num_batched_tokens``): with a budget, vLLM drops the threshold
        when at most one request is eligible; without one, every request is capped by ``chunk``
        and the step by nothing else. ``accept``: with speculative decoding, how many of its draft
        tokens each request of the batch processed in this step gets accepted (at most as many as
        it had; padding drafts are always rejected). Engine core does not step a scheduler that
        has no request (``has_requests``): such a step does nothing and returns empty metadata."""
        admit, preempt = check_step_args(admit, chunk, preempt, resume, budget, self.status, accept, self.K)
        if not self._has_requests():
            self.converging_step = False
            if self.in_flight:  # engine core still drains the batch queue
                self._process(self.in_flight.pop(), accept)
            return ConnectorMetadata()

        self.converging_step = not admit and "converging_step" in self.observe and self._quiescent()
        out = SchedulerOutput(scheduled_cached_reqs=CachedRequestData())
        scheduled: dict[str, int] = {}
        drafts = Drafts()
        resumed_new: list[NewRequestData] = []  # mrv2: resumed requests go after the new ones
        for rid in preempt:
            self._preempt(self.requests[rid])
        eligible = len(self.running) + len(self.holding) + len(admit)
        tokens = StepBudget(budget, chunk if budget is None or eligible > 1 else 0)
        if not self._schedule_running(tokens, out, scheduled, drafts):
            self._schedule_waiting(admit, tokens, resume, out, scheduled, resumed_new, drafts)
        out.scheduled_new_reqs.extend(resumed_new)
        self.converging_step = self.converging_step and not scheduled
        out.num_scheduled_tokens = dict(scheduled)
        out.scheduled_spec_decode_tokens = {rid: [-1] * n for rid, n in drafts.scheduled.items()}
        out.preempted_req_ids = set(self.preempted_since_step)
        out.finished_req_ids = set(self.finished_since_step)
        pre = self._planning_view() if "last_plan" in self.observe else None
        meta = self._changing_target.build_connector_meta(out)
        if pre is not None:
            queued = Counter(g for t in pre["scheduler"]["pending_finished_stores"] for g in t["gpu"])
            self.last_plan = observe_plan(pre, self._target_snapshot(),
                                          list((Counter(meta.store_gpu_blocks) - queued).elements()))
        self._after_build(meta)
        batch = self._update_after_schedule(scheduled, drafts)
        self._forward(scheduled, meta)
        self.preempted_since_step.clear()
        self.finished_since_step.clear()
        self.step_index += 1
        self.in_flight.appendleft(batch)
        if len(self.in_flight) >= self.batch_queue_size or (batch.total == 0 and not self._has_requests()):
            stopped = self._process(self.in_flight.pop(), accept)
            # a request that stopped here queued its finish flush after the planning: not quiescent
            self.converging_step = self.converging_step and not stopped
        return meta

    def _update_after_schedule(self, scheduled: dict[str, int], drafts: Drafts) -> Batch:
        """vLLM ``_update_after_schedule``: computed and in-flight tokens advance; a request that is
        no longer prefilling will sample and leaves the in-flight prefills; under async scheduling it
        counts a placeholder for the token it samples and one per draft scheduled, and gets k draft
        placeholders to verify next (the drafter fills them in on the workers). O(scheduled)."""
        if self.defer_block_free and scheduled:
            self.sched_step_seq += 1
        sampling = []
        for rid, n in scheduled.items():
            r = self.requests[rid]
            r.num_computed_tokens += n
            r.num_in_flight_tokens += n
            r.last_sched_seq = self.sched_step_seq
            r.is_prefill_chunk = r.num_computed_tokens < r.num_tokens + r.num_output_placeholders
            if not r.is_prefill_chunk:
                self.inflight_prefills.discard(rid)
                sampling.append(rid)
                if self.async_scheduling:
                    r.num_output_placeholders += 1 + drafts.scheduled.get(rid, 0)
                    r.num_spec_tokens = self.K
        return Batch(dict(scheduled), sampling, drafts)

    def _process(self, batch: Batch, accept: int) -> bool:
        """vLLM ``update_from_output`` of ``batch`` with the engine's sampled tokens: deferred frees
        whose batch is now processed go back to the pool; in-flight (and stale) counts drain; each
        sampling request still unfinished gets its token, plus ``accept`` of its drafts (at most as
        many as it had, none of a padding, and under synchronous scheduling none past
        ``max_tokens``): the rejected drafts come off its computed tokens and placeholders (not for
        stale output, which is appended without touching either). Under async scheduling, or with
        speculative decoding, the newly confirmed full blocks are cached; under async scheduling a
        request that reached ``max_tokens`` stops there (tokens past it are dropped and uncounted)
        and finishes. Under synchronous scheduling the drafter then proposes k drafts for every
        request of the batch that is still below ``max_tokens`` (none for the others). Returns
        whether a request stopped. O(batch + its requests' tables)."""
        stopped = False
        if self.defer_block_free and batch.total > 0:
            self.processed_step_seq += 1
            while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
                self._changing_gpu.free_blocks(list(reversed(self.deferred_frees.popleft()[1])))
        for rid, n in batch.scheduled.items():
            r = self.requests.get(rid)
            if r is None or r.status == FINISHED:
                continue
            r.num_in_flight_tokens -= n
            stale = r.num_stale_output_tokens > 0
            if stale:
                r.num_stale_output_tokens -= n
            if rid not in batch.sampling or (not self.async_scheduling and len(r.output) >= r.max_tokens):
                self._propose_drafts(r, sampled=False)
                continue
            drafts = batch.drafts.scheduled.get(rid, 0)
            accepted = 0 if rid in batch.drafts.padded else min(accept, drafts)
            if not self.async_scheduling:
                accepted = min(accepted, r.max_tokens - len(r.output) - 1)
            if drafts and not stale:
                self.rule_counts["drafts rejected"] += drafts - accepted
                self.rule_counts["drafts accepted"] += accepted
                if r.num_computed_tokens > 0:
                    r.num_computed_tokens -= drafts - accepted
                if r.num_output_placeholders > 0:
                    r.num_output_placeholders -= drafts - accepted
            confirming = not stale and r.status == RUNNING and (r.num_output_placeholders > 0 or self.K > 0)
            stop = self._append_output(r, 1 + accepted, stale)
            if stale:
                self.rule_counts["stale output appended"] += 1
            if not stale and r.num_output_placeholders > 0:
                r.num_output_placeholders -= 1 + accepted
            if confirming:
                self._cache_blocks(r, r.num_computed_tokens - r.num_in_flight_tokens)
            if stop:
                self._finish(r)  # vLLM's check_stop: the length cap
                self.rule_counts["stop at max_tokens"] += 1
                stopped = True
            else:
                self._propose_drafts(r, sampled=True)
        return stopped

    def _append_output(self, r: EngineRequest, count: int, stale: bool) -> bool:
        """vLLM ``_update_request_with_output``: append up to ``count`` sampled tokens; under async
        scheduling stop at ``max_tokens`` (the tokens past it are dropped and, unless the output is
        stale, come off the computed tokens). Returns whether ``r`` stopped. O(count)."""
        for i in range(count):
            r.append_output_token()
            if self.async_scheduling and len(r.output) >= max(1, r.max_tokens):
                if not stale:
                    r.num_computed_tokens -= count - (i + 1)
                self.rule_counts["tokens past max_tokens dropped"] += count - (i + 1)
                return True
        return False

    def _propose_drafts(self, r: EngineRequest, sampled: bool) -> None:
        """Synchronous scheduling with speculative decoding (vLLM ``update_draft_token_ids`` after the
        step): a request still prefilling drops its drafts; the drafter proposes k for a request that
        sampled and is below ``max_tokens``, none otherwise. O(1)."""
        if self.K and not self.async_scheduling:
            r.num_spec_tokens = self.K if sampled and not r.is_prefill_chunk and len(r.output) < r.max_tokens else 0
            self.rule_counts["drafts proposed"] += r.num_spec_tokens

    def _has_requests(self) -> bool:
        """vLLM's ``Scheduler.has_requests``: an unfinished request, a finish not yet reported to a
        ``schedule()``, a finished request whose blocks wait for its load, or a store the
        connector still has queued or in flight (``has_pending_stores``)."""
        return bool(self.live) or bool(self.finished_since_step) or self.target.has_pending_stores()

    def _quiescent(self) -> bool:
        """No transfer or pin outstanding and CPU capacity >= the live working set (C4's premise)."""
        if self.reports_left or self.loads_shipped:
            return False
        snap = self._planning_view()  # owned_below_cursor judges live requests only
        sched = snap["scheduler"]
        if sched["pending_cpu_hits"] or sched["pending_finished_stores"] or sched["abandoned_store_events"]:
            return False
        from kvspec.oracle.catalogue import owned_below_cursor

        working_set = {key for *_, key in owned_below_cursor(snap)}
        return len(working_set) <= self.config.num_cpu_blocks - 1

    def op_report(self, event: int, count: int = 1) -> None:
        """``count`` worker ranks report store ``event`` done."""
        if not isinstance(event, int) or isinstance(event, bool) or event not in self.reports_left:
            raise UnknownEventError(f"store event {echo(event)} is not in flight")
        check_count(count, "count", self.reports_left[event])
        if count == 0:
            raise InvalidCountError("count must be >= 1")
        self._changing_target.update_connector_output(KVConnectorOutput(completed_store_events={event: count}))
        self.reports_left[event] -= count
        if self.reports_left[event] == 0:
            del self.reports_left[event]
            cpu_ids = self.store_transfers.pop(event)[1]
            self.store_selection_confirmed.pop(event, None)
            for c, data in zip(cpu_ids, self.store_payload.pop(event), strict=True):
                self.cpu_data[c] = data

    def op_load_done(self, rid: str) -> None:
        """The workers report ``rid``'s load complete (``finished_recving``)."""
        if not isinstance(rid, str) or rid not in self.loads_shipped:
            raise UnknownRequestError(f"{echo(rid)} has no load in flight")
        self._changing_target.update_connector_output(KVConnectorOutput(finished_recving={rid}))
        del self.loads_shipped[rid]
        r = self.requests[rid]
        if r.free_after_load:
            self._free_request_blocks(r)
            r.free_after_load = False
            del self.live[rid]
        elif r.status == WAITING_FOR_REMOTE:
            r.status = LOADED

    def op_finish(self, rid: str) -> None:
        """``rid`` stops or is aborted, in whatever phase it is."""
        if self.status(rid) == FINISHED:
            raise InvalidOperationError(f"{echo(rid)} already finished")
        self._finish(self.requests[rid], plan=True)

    def _finish(self, r: EngineRequest, plan: bool = False) -> None:
        """vLLM ``_free_request``: out-of-window blocks freed (processed tokens), the connector's
        ``request_finished`` with the table clipped to the computed tokens, then the blocks freed
        (after the load, for a request still waiting on one; after the batch in flight, for one a
        batch still writes). The finish flush is observed for C7 and C8 (``finishes``); ``plan``
        (an abort, which is an operation of its own): also as the operation's plan (C3, C5, C6)."""
        rid = r.request_id
        self._remove_skipped_blocks(r)
        ready = (r.num_computed_tokens - r.num_output_placeholders) // self.B
        self.finished_confirmed.update((b, self.gpu.block_hash[b]) for t in r.table for b in t[:ready]
                                       if b != NULL_BLOCK)
        clipped = tuple(list(t[: -(-r.num_computed_tokens // self.B)]) for t in r.table)
        plan, flush = plan and "last_plan" in self.observe, "finishes" in self.observe
        pre = self._planning_view() if plan or flush else None
        store_state = None if pre is None else pre["scheduler"]["reqs_to_store"].get(rid)
        expected = self._flush_expectation(r, clipped, store_state) if flush else []
        self._changing_target.request_finished_all_groups(r, clipped)
        if pre is not None:
            post = self._target_snapshot()
            if plan:
                queued = Counter(g for t in pre["scheduler"]["pending_finished_stores"] for g in t["gpu"])
                flushed = Counter(g for t in post["scheduler"]["pending_finished_stores"] for g in t["gpu"])
                self.last_plan = observe_plan(pre, post, list((flushed - queued).elements()), rid)
            if flush:
                self.finishes.append(observe_finish(pre, post, rid, expected))
        for queue in (self.running, self.holding):
            if rid in queue:
                queue.remove(rid)
        self.inflight_prefills.discard(rid)
        if r.status == WAITING_FOR_REMOTE and rid in self.loads_shipped:
            r.free_after_load = True
        else:
            self._free_request_blocks(r)
            del self.live[rid]
        r.status = FINISHED
        self.finished_since_step.add(rid)

    def op_reset(self) -> tuple[bool, bool]:
        """``reset_prefix_cache(reset_connector=True)``: the GPU pool, then the target."""
        gpu_ok = self._changing_gpu.reset_prefix_cache()
        return gpu_ok, self._changing_target.reset()

    def _flush_expectation(self, r: EngineRequest, table: tuple[list[int], ...], st: dict[str, Any] | None
                           ) -> list[str]:
        """Keys the finish flush must cover: owned, hashed, confirmed positions at or after the cursor
        (a sliding-window position below the window of the confirmed tokens is not owned, even while
        a batch in flight keeps its block in the table). ``st``: the request's store state in the
        target's snapshot before the finish."""
        if st is None or st["finished"]:
            return []
        confirmed_tokens = r.num_computed_tokens - r.num_output_placeholders
        confirmed = confirmed_tokens // self.B
        keys = []
        for g, ids in enumerate(table):
            start = max(st["num_stored_blocks"][g], self._skipped(g, confirmed_tokens))
            for p in range(start, min(confirmed, len(ids), len(r.block_hashes))):
                b = ids[p]
                if b != NULL_BLOCK and self.gpu.block_hash[b] == (r.block_hashes[p], g):
                    keys.append(f"{r.block_hashes[p]}:{g}")
        return keys

    @property
    def num_added(self) -> int:
        """Requests added so far (retired ones included)."""
        return len(self.requests) + len(self.retired)

    def unused_request_id(self) -> str:
        """``r<n>`` for the least n >= ``num_added`` that names no request yet: ``r<num_added>`` on a
        trace the generator drew, a later number after a recorded trace whose ids skip (a shrunk
        one). O(ids skipped)."""
        n = self.num_added
        while f"r{n}" in self.requests or f"r{n}" in self.retired:
            n += 1
        return f"r{n}"

    # -- scheduling pieces -------------------------------------------------------------------

    def status(self, rid: object) -> str:
        """The status of request ``rid``; ``UnknownRequestError`` for an id never added."""
        if isinstance(rid, str) and rid in self.retired:
            return FINISHED
        if not isinstance(rid, str) or rid not in self.requests:
            raise UnknownRequestError(f"unknown request {echo(rid)}")
        return self.requests[rid].status

    def _preempt(self, r: EngineRequest) -> None:
        """vLLM ``_preempt_request``: blocks freed (``_free_request_blocks``), computed tokens and
        placeholders reset, output still in flight marked stale, out of the running queue, reported
        preempted in this step's output."""
        self._free_request_blocks(r)
        if r.request_id in self.running:
            self.running.remove(r.request_id)
        self.inflight_prefills.discard(r.request_id)
        r.num_computed_tokens = 0
        r.num_spec_tokens = 0
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        r.status = PREEMPTED
        r.was_preempted = True
        self.preempted_since_step.add(r.request_id)

    def _free_table(self, r: EngineRequest) -> None:
        """Every block of ``r``'s table back to the pool now, each group's in reverse order."""
        for g in range(self.G):
            self._changing_gpu.free_blocks([b for b in reversed(r.table[g]) if b != NULL_BLOCK])
        r.table = [[] for _ in range(self.G)]

    def _blocks_can_be_freed(self, r: EngineRequest) -> bool:
        """No batch still in flight writes ``r``'s blocks (always, without deferred frees)."""
        return not self.defer_block_free or r.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, r: EngineRequest) -> None:
        """vLLM ``_free_request_blocks``: the table is freed now, or, while a batch in flight still
        writes it, set aside (all groups in allocation order) until the newest batch scheduled so
        far is processed, and then freed in reverse."""
        if self._blocks_can_be_freed(r):
            self._free_table(r)
            return
        blocks = [b for t in r.table for b in t if b != NULL_BLOCK]
        ready = (r.num_computed_tokens - r.num_output_placeholders) // self.B
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks, {b for t in r.table for b in t[:ready]}))
            self.rule_counts["deferred free"] += 1
        r.table = [[] for _ in range(self.G)]

    def _reaches_max_tokens(self, r: EngineRequest) -> bool:
        """Async scheduling: the placeholders already in flight are sure to reach ``max_tokens``, so
        vLLM schedules no further step for ``r``."""
        reaches = (r.num_output_placeholders > 0
                   and r.num_computed_tokens + 2 - r.num_output_placeholders >= len(r.prompt) + max(1, r.max_tokens))
        if reaches:
            self.rule_counts["placeholders reach max_tokens"] += 1
        return reaches

    def _skipped(self, g: int, num_computed_tokens: int) -> int:
        """Leading positions of group ``g`` outside the window after ``num_computed_tokens``."""
        spec = self.config.groups[g]
        if spec.kind != "sliding":
            return 0
        return window_floor(num_computed_tokens, 0, spec.sliding_window, self.B)

    def _remove_skipped_blocks(self, r: EngineRequest) -> None:
        """Sliding-window positions that left the window become null and are freed, on the processed
        tokens (computed minus in flight: a batch in flight still reads the window)."""
        for g, spec in enumerate(self.config.groups):
            if spec.kind != "sliding":
                continue
            skipped = self._skipped(g, r.num_computed_tokens - r.num_in_flight_tokens)
            blocks = r.table[g]
            removed = []
            for i in range(min(skipped, len(blocks)) - 1, -1, -1):
                if blocks[i] == NULL_BLOCK:
                    break
                removed.append(blocks[i])
                blocks[i] = NULL_BLOCK
            self._changing_gpu.free_blocks(removed)

    def _admission_cap(self, g: int) -> int | None:
        """vLLM's per-request admission cap of group ``g`` in blocks (``SlidingWindowSpec.
        max_admission_blocks_per_request``: the window plus the tokens of every batch that can be
        in flight, plus one block); None for a full-attention group, which has none."""
        spec = self.config.groups[g]
        if spec.kind != "sliding":
            return None
        in_flight_tokens = self.batch_queue_size * self.config.max_num_batched_tokens  # vLLM max_in_flight_tokens
        return -(-(spec.sliding_window - 1 + in_flight_tokens) // self.B) + 1

    def _required(self, g: int, num_tokens: int, capped: bool) -> int:
        """Blocks group ``g`` needs for ``num_tokens`` slots; ``capped``: the admission cap applies."""
        need = -(-num_tokens // self.B)
        cap = self._admission_cap(g) if capped else None
        return need if cap is None else min(need, cap)

    def _blocks_to_grow(self, r: EngineRequest, num_tokens: int, capped: bool = False) -> int:
        """vLLM ``get_num_blocks_to_allocate`` for a request that already holds its table (a
        running or loaded one): per group, the blocks past its table. O(G)."""
        return sum(max(self._required(g, num_tokens, capped) - len(r.table[g]), 0) for g in range(self.G))

    def _grow(self, r: EngineRequest, num_tokens: int, reserve_full: bool = False) -> list[list[int]] | None:
        """vLLM ``allocate_slots`` for a request holding its table: with ``reserve_full`` the whole
        sequence must fit first; then out-of-window blocks are freed and every group gets the
        blocks to hold ``num_tokens``. None (nothing allocated) if the GPU pool is short."""
        if reserve_full and self._blocks_to_grow(r, r.num_tokens, capped=True) > self.gpu.get_num_free_blocks():
            return None
        self._remove_skipped_blocks(r)  # vLLM frees them even when the allocation then fails
        if self._blocks_to_grow(r, num_tokens) > self.gpu.get_num_free_blocks():
            return None
        gpu = self._changing_gpu
        new = [gpu.get_new_blocks(max(0, -(-num_tokens // self.B) - len(r.table[g]))) for g in range(self.G)]
        for g in range(self.G):
            r.table[g].extend(new[g])
        return new

    @property
    def _spec_step_blocks(self) -> int:
        """vLLM ``_spec_decode_step_blocks``: the blocks one decode step with k drafts may need in
        every group, which an async load's admission leaves free beside the in-flight reservations
        (0 without speculative decoding). O(1)."""
        return self.G * -(-(1 + self.K) // self.B) if self.K else 0

    def _remaining_blocks(self, r: EngineRequest) -> int:
        """vLLM ``_request_remaining_blocks``: what ``r`` still needs to hold its whole sequence and,
        with speculative decoding, one decode step of 1 + k tokens past it (capped as admission
        is)."""
        return self._blocks_to_grow(r, r.num_tokens + (1 + self.K if self.K else 0), capped=True)

    def _cache_blocks(self, r: EngineRequest, num_tokens: int) -> None:
        """Hash the full blocks covering ``num_tokens`` (at schedule time, like vLLM)."""
        full = min(num_tokens, r.num_tokens) // self.B
        for g in range(self.G):
            for p in range(min(full, len(r.table[g]))):
                b = r.table[g][p]
                if b != NULL_BLOCK and self.gpu.block_hash[b] is None:
                    self._changing_gpu.insert_block_hash((r.block_hashes[p], g), b)

    def _schedule_running(self, tokens: StepBudget, out: SchedulerOutput, scheduled: dict[str, int],
                          drafts: Drafts) -> bool:
        """vLLM's running pass, in the running queue's order, while the budget lasts: a request with
        tokens to compute gets its share (out-of-window blocks freed first); when its allocation fails the queue's
        last request is preempted and the allocation retried, until it succeeds or the request
        preempted itself, which ends the pass (as does a last request whose blocks a batch in flight
        still writes). A request with nothing to compute, or whose placeholders already reach its
        ``max_tokens``, is passed over untouched. A request's drafts count among the tokens it needs;
        those the share covers are scheduled, and it keeps none. Returns whether anything was
        preempted (then nobody is admitted this step)."""
        preempted = False
        i = 0
        while i < len(self.running) and tokens.open():
            r = self.requests[self.running[i]]
            need = r.num_tokens + r.num_spec_tokens + r.num_output_placeholders - r.num_computed_tokens
            if need <= 0 or self._reaches_max_tokens(r):
                i += 1
                continue
            n = tokens.share(need)
            while (new := self._grow(r, r.num_computed_tokens + n)) is None:
                victim = self.requests[self.running[-1]]
                if not self._blocks_can_be_freed(victim):
                    self.rule_counts["no preemption of a request in flight"] += 1
                    break  # vLLM: a deferred free would not make room now
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if new is None:
                break
            self._cache_blocks(r, r.num_computed_tokens + n)
            out.scheduled_cached_reqs.req_ids.append(r.request_id)
            out.scheduled_cached_reqs.new_block_ids.append(tuple(new) if any(new) else None)
            scheduled[r.request_id] = n
            tokens.spend(n)
            drafts.running_scheduled = True
            drafts.prefill_scheduled |= r.is_prefill_chunk
            if r.num_spec_tokens:
                covered = n + r.num_computed_tokens - r.num_tokens - r.num_output_placeholders
                if covered > 0:
                    drafts.scheduled[r.request_id] = min(r.num_spec_tokens, covered)
                    self.rule_counts["drafts scheduled"] += drafts.scheduled[r.request_id]
                r.num_spec_tokens = 0
            i += 1
        return preempted

    def _schedule_waiting(self, admit: list[str], tokens: StepBudget, resume: str, out: SchedulerOutput,
                          scheduled: dict[str, int], resumed_new: list[NewRequestData], drafts: Drafts) -> None:
        """vLLM's waiting pass, while the budget lasts: the requests holding a load first (one still
        loading is passed over), then the admissions (one whose output from before a preemption is
        still in flight is passed over); the first allocation that fails ends it."""
        for rid in list(self.holding):
            r = self.requests[rid]
            if not tokens.open():
                return
            if r.status == LOADED and not self._schedule_loaded(r, tokens, resume, out, scheduled, resumed_new,
                                                                drafts):
                return
        for rid in admit:
            r = self.requests[rid]
            if not tokens.open():
                return
            if r.num_stale_output_tokens > 0:
                continue  # vLLM: its output from before the preemption is still in flight
            if not self._admit(r, tokens, resume, out, scheduled, resumed_new, drafts):
                return

    def _start(self, r: EngineRequest, n: int, resume: str, out: SchedulerOutput, scheduled: dict[str, int],
               resumed_new: list[NewRequestData]) -> None:
        """``r`` joins the running queue with ``n`` tokens scheduled: reported as a new request, or
        as a resumed one if it was ever preempted (V1 runner: cached data with the resumed flag;
        V2: new request data after the new ones)."""
        r.status = RUNNING
        self.running.append(r.request_id)
        if r.num_computed_tokens + n < r.num_tokens:
            self.inflight_prefills.add(r.request_id)
        full = tuple(list(t) for t in r.table)
        if r.was_preempted and resume == "mrv1":
            out.scheduled_cached_reqs.req_ids.append(r.request_id)
            out.scheduled_cached_reqs.new_block_ids.append(full)
            out.scheduled_cached_reqs.resumed_req_ids.add(r.request_id)
        elif r.was_preempted:
            resumed_new.append(NewRequestData(r.request_id, full))
        else:
            out.scheduled_new_reqs.append(NewRequestData(r.request_id, full))
        scheduled[r.request_id] = n

    def _padded(self, r: EngineRequest, computed: int, tokens: StepBudget, drafts: Drafts) -> int | None:
        """vLLM pads a request from the waiting queue with one token left to compute (a full hit, a
        resumed decode) to 1 + k tokens, k padding drafts, when nothing still prefilling was scheduled
        in the running pass and either something was or it has computed tokens: returns 1 + k, or
        -1 when the budget cannot hold them (vLLM then ends the waiting pass rather than schedule it
        unpadded); None when no padding applies. O(1)."""
        if not (self.K and r.num_tokens - computed == 1 and not drafts.prefill_scheduled
                and (drafts.running_scheduled or computed > 0)):
            return None
        if tokens.left is not None and 1 + self.K > tokens.left:
            self.rule_counts["padded decode refused by the budget"] += 1
            return -1
        self.rule_counts["decode padded"] += 1
        drafts.scheduled[r.request_id] = self.K
        drafts.padded.add(r.request_id)
        return 1 + self.K

    def _schedule_loaded(self, r: EngineRequest, tokens: StepBudget, resume: str, out: SchedulerOutput,
                         scheduled: dict[str, int], resumed_new: list[NewRequestData], drafts: Drafts) -> bool:
        """A request whose load completed (vLLM ``_update_waiting_for_remote_kv``, then the "already
        computed" branch): cache the loaded blocks, recompute the last token of a full hit (padded
        with drafts, ``_padded``), then allocate the chunk (whole sequence first) and
        ``update_state_after_alloc(.., 0)``. False: the GPU pool or the budget is short; it stays
        loaded and the waiting pass ends."""
        self._cache_blocks(r, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.num_computed_tokens -= 1
        n = self._padded(r, r.num_computed_tokens, tokens, drafts)
        if n is None:
            n = tokens.share(r.num_tokens - r.num_computed_tokens)
        if n < 0 or self._grow(r, r.num_computed_tokens + n, reserve_full=True) is None:
            self._unpad(r, drafts)
            return False
        self._changing_target.update_state_after_alloc(r, tuple(list(t) for t in r.table), 0)
        self._cache_blocks(r, r.num_computed_tokens + n)
        self.holding.remove(r.request_id)
        self._start(r, n, resume, out, scheduled, resumed_new)
        tokens.spend(n)
        return True

    def _admission_blocks(self, local_blocks: list[list[int]], local_len: int, computed: int,
                          num_tokens: int, capped: bool) -> int:
        """vLLM ``get_num_blocks_to_allocate`` for a request with no table yet, ``local_len`` tokens
        hit on the GPU (``local_blocks``), ``computed`` hit in all: per group, the blocks for
        ``num_tokens`` past the larger of the hit and the positions out of the window, plus the
        free hit blocks inside the window it takes from the free queue. O(hit)."""
        total = 0
        for g in range(self.G):
            skipped = self._skipped(g, computed)
            total += max(self._required(g, num_tokens, capped) - max(skipped, local_len // self.B), 0)
            total += sum(1 for b in local_blocks[g][skipped:] if b != NULL_BLOCK and self.gpu.ref_cnt[b] == 0)
        return total

    def _unpad(self, r: EngineRequest, drafts: Drafts) -> None:
        """``r`` was not scheduled after all: no padding drafts for it."""
        drafts.scheduled.pop(r.request_id, None)
        drafts.padded.discard(r.request_id)

    def _admit(self, r: EngineRequest, tokens: StepBudget, resume: str, out: SchedulerOutput,
               scheduled: dict[str, int], resumed_new: list[NewRequestData], drafts: Drafts) -> bool:
        """GPU hit, connector hit, ``allocate_slots``, ``update_state_after_alloc``. The whole
        sequence must fit (vLLM's ``scheduler_reserve_full_isl``, on by default); a CPU hit is an
        asynchronous load, admitted only beside the blocks that in-flight prefills still need.
        Hit positions already out of a sliding window get the null block, local hits there are
        not kept. False: the GPU pool is short (nothing changed on the GPU)."""
        local_blocks, local_len = find_longest_cache_hit(
            self.gpu, r.block_hashes, r.num_tokens - 1, self.config.groups, self.B
        )
        local_len -= local_len % self.B
        local_blocks = [list(blocks[: local_len // self.B]) for blocks in local_blocks]
        ext, is_async = self._changing_target.get_num_new_matched_tokens(r, local_len)
        computed = local_len + ext
        n = 0 if is_async else self._padded(r, computed, tokens, drafts)
        if n is None:
            n = tokens.share(r.num_tokens - computed)
        free = self.gpu.get_num_free_blocks()
        reserved = (sum(self._remaining_blocks(self.requests[q]) for q in self.inflight_prefills)
                    + self._spec_step_blocks) if is_async else 0
        whole = self._admission_blocks(local_blocks, local_len, computed, r.num_tokens, capped=True)
        if n < 0 or whole > free or self._admission_blocks(local_blocks, local_len, computed, computed + n,
                                                           capped=False) > free - reserved:
            self._unpad(r, drafts)
            return False
        r.table = []
        for g in range(self.G):
            skipped = self._skipped(g, computed)
            kept = local_blocks[g][skipped:]
            self._changing_gpu.touch([b for b in kept if b != NULL_BLOCK])
            r.table.append([NULL_BLOCK] * min(skipped, len(local_blocks[g])) + kept)
        for g in range(self.G):
            # external positions: null where already out of the window (vLLM's
            # ``allocate_external_computed_blocks``; the CPU hit has null there too), new blocks after
            skip = max(0, self._skipped(g, computed) - len(r.table[g]))
            r.table[g].extend([NULL_BLOCK] * skip)
            r.table[g].extend(self._changing_gpu.get_new_blocks(max(0, -(-computed // self.B) - len(r.table[g]))))
        for g in range(self.G):
            r.table[g].extend(self._changing_gpu.get_new_blocks(max(0, -(-(computed + n) // self.B) - len(r.table[g]))))
        r.num_computed_tokens = local_len
        full = tuple(list(t) for t in r.table)
        self._changing_target.update_state_after_alloc(r, full, ext)
        if is_async:
            r.num_computed_tokens = computed
            r.status = WAITING_FOR_REMOTE
            self.holding.append(r.request_id)
            self.inflight_prefills.add(r.request_id)
            return True
        self._cache_blocks(r, computed + n)
        r.num_computed_tokens = computed
        self._start(r, n, resume, out, scheduled, resumed_new)
        tokens.spend(n)
        return True

    # -- workers ------------------------------------------------------------------------------

    def _after_build(self, meta: ConnectorMetadata) -> None:
        """Record what the metadata tells the workers to copy; loads copy now (before forward)."""
        if meta.store_event >= 0:
            e = meta.store_event
            self.store_transfers[e] = (list(meta.store_gpu_blocks), list(meta.store_cpu_blocks))
            self.store_selection_confirmed[e] = self._confirmed_at_planning(meta.store_gpu_blocks)
            self.reports_left[e] = self.config.world_size
        self.finished_confirmed.clear()
        if meta.load_event >= 0:
            for g, c in zip(meta.load_gpu_blocks, meta.load_cpu_blocks, strict=True):
                self.gpu_data[g] = self.cpu_data[c]
            for rid in meta.load_event_to_reqs.get(meta.load_event, []):
                self.loads_shipped[rid] = meta.load_event

    def _confirmed_at_planning(self, gpu_ids: list[int]) -> list[bool]:
        """Per block: held by some request at a confirmed position (computed in an earlier step or
        a prefix hit; a finished request's blocks whose free waits for a batch in flight count with
        the positions it had confirmed, and so do, under the same key, the blocks a request
        finished since the last planning held confirmed: its finish flush, planned now, was queued
        then, even if another request holds the block unconfirmed now), or held by no request and
        already holding its key's data (a free cached block, or a finish flush's pinned block)."""
        confirmed: set[int] = set()
        held: set[int] = set()
        for r in self.live.values():
            ready = (r.num_computed_tokens - r.num_output_placeholders) // self.B
            for t in r.table:
                held.update(t)
                confirmed.update(t[:ready])
        for _, blocks, at_confirmed in self.deferred_frees:
            held.update(blocks)
            confirmed.update(at_confirmed)
        out = []
        for g in gpu_ids:
            key = self.gpu.block_hash[g]
            flushed = key is not None and self.finished_confirmed.get(g) == key
            out.append(g in confirmed or flushed
                       or (g not in held and key is not None and self.gpu_data[g] == key[0]))
        return out

    def _forward(self, scheduled: dict[str, int], meta: ConnectorMetadata) -> None:
        """Compute the scheduled tokens (every full block below the computed tokens holds the data of
        the tokens written into it), then the store DMA (after the compute-done barrier). The
        tokens come back when the batch is processed (``_process``)."""
        for rid in scheduled:
            r = self.requests[rid]
            for p in range(r.num_computed_tokens // self.B):
                for g in range(self.G):
                    if p < len(r.table[g]) and r.table[g][p] != NULL_BLOCK:
                        self.gpu_data[r.table[g][p]] = r.written_hash(p)
        if meta.store_event >= 0:
            self.store_payload[meta.store_event] = [self.gpu_data[g] for g in meta.store_gpu_blocks]

    # -- observation --------------------------------------------------------------------------

    @property
    def _changing_target(self) -> OffloadTarget:
        """The target, for a call that may change its state: the kept snapshot is dropped first."""
        self._kept = None
        return self.target

    @property
    def _changing_gpu(self) -> Any:
        """The GPU pool, for a call that may change its state: the kept snapshot is dropped first."""
        self._kept = None
        return self.gpu

    def _target_snapshot(self) -> dict[str, Any]:
        """The target's snapshot now: taken afresh, or, with ``keep_snapshots``, the one taken
        since the engine last made a call that may change the target or its GPU pool (every call
        but a snapshot and the counting queries ``has_pending_stores`` and
        ``get_num_free_blocks``). A new top-level dict each time; its sections are shared with
        the kept one and must not be mutated. ``kept_snapshot_is_current`` checks the premise. O(1)
        when kept, O(target state) otherwise."""
        if self._kept is None:
            self.generation += 1
            snap = self.target.snapshot()
            if not self.keep_snapshots:
                return snap
            self._kept = snap
        return dict(self._kept)

    def kept_snapshot_is_current(self) -> bool:
        """Whether the kept target snapshot (if any) equals one taken now: the premise of
        ``keep_snapshots``, that only the calls it watches change the target. O(target state)."""
        return self._kept is None or self._kept == self.target.snapshot()

    def _planning_view(self) -> dict[str, Any]:
        """What ``observe_plan`` and ``observe_finish`` read before a planning: the target's
        snapshot and an engine section of the configuration and the live requests only (they
        judge no finished request), without ``snapshot``'s other facts. O(live requests +
        target state)."""
        snap = self._target_snapshot()
        snap["engine"] = {"config": self.config.to_json(),
                          "requests": {rid: _request_json(r) for rid, r in self.live.items()}}
        return snap

    def snapshot(self) -> dict[str, Any]:
        """The target's snapshot plus the engine's view (requests, data, transfers in flight).

        ``requests`` lists every request that has not finished, and the finished ones that
        anything still names: the target's state (pins, loads, store state, events, loss
        records), a load in flight, or the finish that was the last operation. A finished
        request nothing names has no state any invariant could judge, so leaving it out keeps
        a snapshot, and the step that takes it, proportional to the live state rather than to
        the whole history. Such a request is also retired here (dropped from ``requests``, its id
        kept in ``retired``): nothing observable changes, since no snapshot would show it and no
        operation may name it again. O(live requests + target state)."""
        snap = self._target_snapshot()
        self.served_generation = self.generation
        named = _requests_named(snap["scheduler"]) | set(self.loads_shipped)
        named.update(fin["rid"] for fin in self.finishes)
        shown = {**self.live, **{rid: self.requests[rid] for rid in named if rid in self.requests}}
        for rid in [rid for rid in self.requests if rid not in shown]:  # finished, and named by nothing:
            del self.requests[rid]  # retired for good (no operation can name it again), so that the
            self.retired.add(rid)   # engine's memory, like its snapshots, follows the live state
        snap["engine"] = {
            "config": self.config.to_json(),
            "step": self.step_index,
            "requests": {rid: _request_json(r) for rid, r in sorted(shown.items(), key=_by_serial)},
            "gpu_data": list(self.gpu_data),
            "cpu_data": list(self.cpu_data),
            "store_selection_confirmed": {str(e): c for e, c in sorted(self.store_selection_confirmed.items())},
            "reports_left": {str(e): n for e, n in sorted(self.reports_left.items())},
            "loads_in_flight": sorted(self.loads_shipped),
            "deferred_frees": [list(blocks) for _, blocks, _ in self.deferred_frees],
            "last_op": self.last_op,
            "last_result": list(self.last_result) if isinstance(self.last_result, tuple) else None,
            "converging_step": self.converging_step,
            "finishes": list(self.finishes),
            "last_plan": self.last_plan,
        }
        return snap


def _by_serial(item: tuple[str, EngineRequest]) -> int:
    return item[1].serial


def _request_json(r: EngineRequest) -> dict[str, Any]:
    """One request in a snapshot's engine section."""
    return {
        "status": r.status,
        "num_tokens": r.num_tokens,
        "num_computed_tokens": r.num_computed_tokens,
        "num_output_placeholders": r.num_output_placeholders,
        "block_hashes": list(r.block_hashes),
        "table": [list(t) for t in r.table],
        "free_after_load": r.free_after_load,
    }


def _requests_named(sched: dict[str, Any]) -> set[str]:
    """Request ids a scheduler snapshot section refers to anywhere."""
    named = set(sched["pending_cpu_hits"]) | set(sched["reqs_to_load"]) | set(sched["abandoned_reqs_to_load"])
    named |= set(sched["reqs_to_store"])
    for section in ("load_event_to_reqs", "store_event_to_reqs"):
        for rids in sched[section].values():
            named.update(rids)
    named.update(str(rec[0]) for rec in sched["policy_state"].get("lost", ()))
    return named
