"""The one operation generator: state-aware engine operations, valid or deliberately invalid.

``OpGenerator(config, choices)`` looks at an engine (``kvspec.drivers.engine.Engine``:
requests by status, store events still awaiting reports, loads in flight) and proposes the
next operation a real engine could perform, or, with ``invalid_op``, one it must refuse.
Every decision is drawn from ``choices``, a ``Choices`` source:

* ``RandomChoices`` draws from a ``random.Random``: the fuzzer (``harness.fuzz``), the trace
  generator (``tracegen.random_ops``) and the invariant fuzzer of real vLLM. Same engine
  state, same ``Random`` state, same operation.
* ``HypothesisChoices`` draws from Hypothesis' ``data.draw``: the state machine
  (``harness.make_state_machine``), whose rules call the same builders (``add``, ``step``,
  ``report``...), so that Hypothesis explores and shrinks the very decisions the fuzzer makes.

The mix aims at what the offload bookkeeping finds hard, so that CPU pressure (evictions under
live cursors, re-stores, out-of-space) builds up in short traces:

* **adds** draw prompts from a few *families*, so requests share prefixes and hit each other's
  blocks on GPU and CPU; prompt lengths hit block boundaries often;
* **steps** admit waiting and preempted requests in random order, preempt running ones, vary
  the chunk size (prefill in several chunks, off-boundary chunks), the resume style
  (``mrv1``/``mrv2``) and, now and then, a step token budget that several requests share;
* **reports** deliver store completions one rank count at a time or several at once, for any
  in-flight event, in any order; **load_done** completes shipped loads in any order;
* **finishes** hit requests in every phase (waiting, running, waiting for a load, loaded,
  preempted), preferring those that are done; **resets** are rare, with transfers in flight
  or not;
* **invalid** operations name an unknown request or event, finish twice, admit a running
  request, preempt a loaded one, add a request twice or with a bad field, ask for a zero chunk
  or budget, or one report too many. Every one of them can be written in a trace (``kvspec.drivers.trace``).

``random_config`` draws the small configurations the fuzzer and the state machine run on
(small pools, so that the rare paths are common). Each builder is O(requests of the engine).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.contract.errors import ConfigError, echo
from kvspec.drivers.engine import FINISHED, LOADED, PREEMPTED, RUNNING, WAITING, Engine

T = TypeVar("T")
Op = dict[str, Any]

FAMILIES = 3  # prompt families (shared prefixes) unless a caller asks for another number
CROWDED = 6  # active requests from which adds become rare
MAX_PROMPT_BLOCKS = 6
ADMIT_CHANCE = 0.7  # each waiting or preempted request, per step
PREEMPT_CHANCE = 0.08  # each running request, per step
BUDGET_CHANCE = 0.3  # a step carries a token budget (vLLM's max_num_batched_tokens for it)
WHOLE_REPORT_CHANCE = 0.5  # a report delivers every rank still due at once
FINISH_DONE_CHANCE = 0.7  # a finish picks a request that is done, when there is one
UNKNOWN_REQUEST = "no-such-request"
UNKNOWN_EVENT = 10_000  # store event ids from here on are never issued in a generated trace
UNKNOWN_EVENT_SPREAD = 100
CHANCE_STEPS = 100  # outcomes of one Hypothesis ``chance`` draw


# -- sources of choices ----------------------------------------------------------------------


class Choices(Protocol):
    """Where the generator's decisions come from."""

    def integer(self, low: int, high: int) -> int:
        """An int in ``low..high`` (both included)."""
        ...

    def pick(self, options: Sequence[T]) -> T:
        """One of ``options`` (not empty)."""
        ...

    def chance(self, probability: float) -> bool:
        """True with ``probability`` (a random source; Hypothesis explores both)."""
        ...

    def subset(self, items: Sequence[T], probability: float) -> list[T]:
        """Some of ``items`` in their order, each kept with ``probability``."""
        ...

    def shuffled(self, items: Sequence[T]) -> list[T]:
        """``items`` in some order."""
        ...

    def weighted(self, weights: Mapping[str, float]) -> str:
        """One key of ``weights`` (positive weights), in proportion to its weight."""
        ...


class RandomChoices:
    """``Choices`` from a ``random.Random``: deterministic in its seed. O(1) per decision, O(n)
    for a subset or a shuffle."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def pick(self, options: Sequence[T]) -> T:
        return self.rng.choice(options)

    def chance(self, probability: float) -> bool:
        return self.rng.random() < probability

    def subset(self, items: Sequence[T], probability: float) -> list[T]:
        return [x for x in items if self.rng.random() < probability]

    def shuffled(self, items: Sequence[T]) -> list[T]:
        out = list(items)
        self.rng.shuffle(out)
        return out

    def weighted(self, weights: Mapping[str, float]) -> str:
        return self.rng.choices(list(weights), list(weights.values()))[0]


class HypothesisChoices:
    """``Choices`` drawn with Hypothesis' ``data.draw`` inside a test or a rule: every decision
    is a draw that Hypothesis records, explores and shrinks. A ``chance`` is one draw of
    ``CHANCE_STEPS`` equally likely outcomes, ``probability`` of them True, shrinking to False
    (so that a shrunk trace preempts and admits as little as it can)."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies

        self.data = data
        self.st = strategies

    def integer(self, low: int, high: int) -> int:
        value: int = self.data.draw(self.st.integers(low, high))
        return value

    def pick(self, options: Sequence[T]) -> T:
        value: T = self.data.draw(self.st.sampled_from(options))
        return value

    def chance(self, probability: float) -> bool:
        step: int = self.data.draw(self.st.integers(0, CHANCE_STEPS - 1))
        return step >= CHANCE_STEPS - round(probability * CHANCE_STEPS)

    def subset(self, items: Sequence[T], probability: float) -> list[T]:
        return [x for x in items if self.chance(probability)]

    def shuffled(self, items: Sequence[T]) -> list[T]:
        value: list[T] = self.data.draw(self.st.permutations(list(items)))
        return value

    def weighted(self, weights: Mapping[str, float]) -> str:
        return self.pick(sorted(weights))


# -- configurations --------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigPins:
    """Features that every configuration ``random_config`` draws must have; None leaves the feature
    to the draw. A campaign aimed at a rare class of configurations pins it (``kvspec fuzz
    --configs``): the draws give a sliding-window group three times in ten, synchronous scheduling
    one time in four and speculative decoding one time in four."""

    sliding: bool | None = None  # a sliding-window group beside the full-attention one
    async_scheduling: bool | None = None
    spec: bool | None = None  # n-gram speculative decoding (one to three draft tokens)

    def words(self) -> list[str]:
        """The ``--configs`` words that give these pins, in ``CONFIG_WORDS`` order."""
        return [w for w, (name, value) in CONFIG_WORDS.items() if getattr(self, name) is value]


CONFIG_WORDS: dict[str, tuple[str, bool]] = {
    "sliding": ("sliding", True), "full": ("sliding", False),
    "async": ("async_scheduling", True), "sync": ("async_scheduling", False),
    "spec": ("spec", True), "no-spec": ("spec", False),
}
"""``--configs`` words: each pins one ``ConfigPins`` feature to a value."""

NO_PINS = ConfigPins()  # every feature drawn


def parse_pins(text: str) -> ConfigPins:
    """``ConfigPins`` from comma-separated ``CONFIG_WORDS`` (e.g. ``sliding,sync``); an unknown
    word, or two words that pin one feature both ways, is a ``ConfigError`` naming it. O(words)."""
    pins: dict[str, bool] = {}
    for word in text.split(","):
        if word not in CONFIG_WORDS:
            raise ConfigError(f"--configs: unknown word {echo(word)}; known: {', '.join(CONFIG_WORDS)}")
        name, value = CONFIG_WORDS[word]
        if pins.get(name, value) is not value:
            other = next(w for w, nv in CONFIG_WORDS.items() if nv == (name, not value))
            raise ConfigError(f"--configs: {word!r} and {other!r} contradict each other")
        pins[name] = value
    return ConfigPins(**pins)


def random_config(choices: Choices, policy: str, lazy: bool = False, block_size: int = 16,
                  pins: ConfigPins = NO_PINS, swarm: bool = False) -> OffloadConfig:
    """A small configuration for ``policy``: 12-24 GPU and 4-8 CPU blocks (so that the rare paths
    are common), one or two ranks, now and then a sliding-window group beside the full one,
    async scheduling (vLLM's default) three times in four, synchronous scheduling otherwise, and
    n-gram speculative decoding with one to three draft tokens one time in four. With ``swarm``
    (swarm testing, the fuzzer's default) each of the three features is drawn half the time, so
    that their combinations are as common as the features. A feature that ``pins`` fixes is not
    drawn (the other draws are the same as without pins)."""
    sliding_p, async_p, spec_p = (0.5, 0.5, 0.5) if swarm else (0.3, 0.75, 0.25)
    gpu = choices.pick((12, 16, 24))
    cpu = choices.pick((4, 5, 6, 8))
    world = choices.pick((1, 1, 2))
    groups: tuple[KVGroup, ...] = (KVGroup(),)
    if choices.chance(sliding_p) if pins.sliding is None else pins.sliding:
        window = choices.pick((block_size, 2 * block_size, 3 * block_size))
        groups = (KVGroup(), KVGroup("sliding", sliding_window=window))
    async_scheduling = choices.chance(async_p) if pins.async_scheduling is None else pins.async_scheduling
    spec = choices.pick((1, 2, 3)) if (choices.chance(spec_p) if pins.spec is None else pins.spec) else 0
    return OffloadConfig(block_size=block_size, num_gpu_blocks=gpu, num_cpu_blocks=cpu, world_size=world,
                         groups=groups, policy=policy, lazy_offload=lazy, async_scheduling=async_scheduling,
                         num_speculative_tokens=spec)


# -- the generator ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OpMix:
    """What a stream of generated operations may contain: ``num_families`` prompt families, a
    fraction ``invalid_rate`` of deliberately invalid operations, and, with ``readmit_preempted``,
    steps that re-admit requests they preempt (one ``SchedulerOutput`` naming a request both as
    preempted and as scheduled, which the connector accepts). The conformance traces use that
    shape (two targets must agree on it); the fuzzer and the state machine leave it out, since on
    it C6 judges the ``repair`` policy's re-store for the re-admitted request as thrash."""

    num_families: int = FAMILIES
    invalid_rate: float = 0.0
    readmit_preempted: bool = False
    kind_factors: tuple[tuple[str, float], ...] = ()  # ``kind_weights`` multiplied by these (swarm)
    preempt_chance: float = PREEMPT_CHANCE
    admit_chance: float = ADMIT_CHANCE
    budget_chance: float = BUDGET_CHANCE
    whole_report_chance: float = WHOLE_REPORT_CHANCE


FUZZ_MIX = OpMix()  # the fuzzer's and the state machine's: valid operations, three families

SWARM_KIND_FACTORS: dict[str, tuple[float, ...]] = {
    "add": (1.0, 3.0), "report": (0.25, 1.0, 4.0), "load_done": (0.25, 1.0, 4.0),
    "finish": (0.0, 1.0, 3.0), "reset": (0.0, 1.0, 10.0),
}
"""Swarm testing: the factors one trace's mix may multiply each kind's weight by (steps stay as
they are; reports and load completions never drop to zero, so transfers still end)."""


def swarm_mix(choices: Choices) -> OpMix:
    """One trace's mix under swarm testing: each feature of the generator drawn on, off or
    emphasised (the prompt families, each kind's weight, the chances of preempting, admitting, a
    token budget and a whole report), so that some traces leave out what would undo the state a
    bug needs (resets, finishes, preemptions) and others pile it on. Every operation it gives is
    one the plain mix could give; only the proportions differ. O(1)."""
    factors = tuple((kind, choices.pick(options)) for kind, options in SWARM_KIND_FACTORS.items())
    return OpMix(num_families=choices.pick((1, 2, 3)), kind_factors=factors,
                 preempt_chance=choices.pick((0.0, PREEMPT_CHANCE, 0.3)),
                 admit_chance=choices.pick((0.3, ADMIT_CHANCE, 1.0)),
                 budget_chance=choices.pick((0.0, BUDGET_CHANCE, 0.8)),
                 whole_report_chance=choices.pick((0.1, WHOLE_REPORT_CHANCE, 1.0)))


def _active(engine: Engine) -> list[str]:
    """Requests an operation may still finish (live and not finished), in creation order."""
    return [rid for rid, r in engine.live.items() if r.status != FINISHED]


def kind_weights(engine: Engine) -> dict[str, float]:
    """The kinds of valid operation possible in ``engine``'s state, weighted: steps and reports
    dominate, adds thin out once ``CROWDED`` requests are active, resets are rare. A kind that is
    missing has nothing to act on (no report due, no load shipped, no active request)."""
    active = len(_active(engine))
    weights = {"add": 3.0 if active < CROWDED else 0.5, "step": 6.0}
    if engine.reports_left:
        weights["report"] = 4.0
    if engine.loads_shipped:
        weights["load_done"] = 3.0
    if active:
        weights["finish"] = 1.5
    weights["reset"] = 0.15
    return weights


class OpGenerator:
    """Operations for engines on ``config`` in the proportions of ``mix``, every decision drawn
    from ``choices``. It keeps no state of its own: request ids come from the engine
    (``Engine.unused_request_id``), so the same engine state and the same choices give the same
    operation, and it can continue any trace."""

    def __init__(self, config: OffloadConfig, choices: Choices, mix: OpMix = FUZZ_MIX) -> None:
        self.config = config
        self.choices = choices
        self.mix = mix
        self.num_families = max(1, mix.num_families)
        b, k = config.block_size, config.num_speculative_tokens
        chunks = {b, 2 * b, 3 * b, b + 1, max(1, b - 1), config.max_num_batched_tokens, 5 * b}
        chunks |= {1 + k} if k else set()
        self.chunks = sorted(c for c in chunks if c > k)  # a padded decode's 1 + k rows fit any chunk
        self.budgets = sorted({1, b, 2 * b + 1, 4 * b, config.max_num_batched_tokens})
        self.builders: dict[str, Callable[[Engine], Op]] = {
            "add": self.add, "step": self.step, "report": self.report, "load_done": self.load_done,
            "finish": self.finish, "reset": self.reset,
        }

    def next_op(self, engine: Engine) -> Op:
        """The next operation of the mix: with probability ``invalid_rate`` an invalid one (marked
        ``"expect": "error"``), else a valid one of a kind drawn by ``kind_weights`` (times the
        mix's ``kind_factors``; steps are always possible)."""
        if self.mix.invalid_rate > 0 and self.choices.chance(self.mix.invalid_rate):
            return {**self.invalid_op(engine), "expect": "error"}
        weights = kind_weights(engine)
        if self.mix.kind_factors:
            factors = dict(self.mix.kind_factors)
            weights = {k: w * factors.get(k, 1.0) for k, w in weights.items() if w * factors.get(k, 1.0) > 0}
        return self.builders[self.choices.weighted(weights)](engine)

    # -- valid operations, one builder per kind (each needs what ``kind_weights`` requires) ---

    def add(self, engine: Engine) -> Op:
        """A new request of a random family: 0-6 full blocks plus 0, 1 or any number of tokens, and
        from one output token (vLLM's least ``max_tokens``) to two blocks of them."""
        c, b = self.choices, self.config.block_size
        blocks = c.integer(0, MAX_PROMPT_BLOCKS)
        extra = c.pick((0, 0, 1, 1, c.integer(1, b)))
        return {"op": "add", "rid": engine.unused_request_id(), "family": c.integer(0, self.num_families - 1),
                "prompt_len": max(1, blocks * b + extra), "max_tokens": c.pick((1, 1, 1, 2, 3, b, b + 2, 2 * b))}

    def step(self, engine: Engine) -> Op:
        """Preempt some running requests, admit some waiting or preempted ones (with
        ``readmit_preempted``, also some of those this step preempts) in a random order, with a
        chunk from ``chunks``; a resume style when it matters; sometimes a token budget; with
        speculative decoding, how many drafts the processed batch gets accepted."""
        c = self.choices
        waiting = [rid for rid, r in engine.live.items() if r.status in (WAITING, PREEMPTED)]
        running = [rid for rid, r in engine.live.items() if r.status == RUNNING]
        preempt = c.subset(running, self.mix.preempt_chance)
        admissible = waiting + preempt if self.mix.readmit_preempted else waiting
        admit = c.shuffled(c.subset(admissible, self.mix.admit_chance))
        op: Op = {"op": "step", "admit": admit, "chunk": c.pick(self.chunks)}
        if c.chance(self.mix.budget_chance):
            op["budget"] = c.pick(self.budgets)
        if preempt:
            op["preempt"] = preempt
        if preempt or any(engine.requests[r].was_preempted for r in admit):
            op["resume"] = c.pick(("mrv1", "mrv2"))
        if self.config.num_speculative_tokens:
            op["accept"] = c.integer(0, self.config.num_speculative_tokens)
        return op

    def report(self, engine: Engine) -> Op:
        """Ranks of one in-flight store event report: all still due, or some."""
        c = self.choices
        event = c.pick(sorted(engine.reports_left))
        left = engine.reports_left[event]
        count = left if c.chance(self.mix.whole_report_chance) else c.integer(1, left)
        return {"op": "report", "event": event, "count": count}

    def load_done(self, engine: Engine) -> Op:
        return {"op": "load_done", "rid": self.choices.pick(sorted(engine.loads_shipped))}

    def finish(self, engine: Engine) -> Op:
        """An active request finishes, preferably one that is done (prompt and outputs computed)."""
        active = _active(engine)
        done = [rid for rid in active if _is_done(engine, rid)]
        pool = done if done and self.choices.chance(FINISH_DONE_CHANCE) else active
        return {"op": "finish", "rid": self.choices.pick(pool)}

    def reset(self, engine: Engine) -> Op:
        return {"op": "reset"}

    # -- invalid operations -------------------------------------------------------------------

    def invalid_op(self, engine: Engine) -> Op:
        """An operation the engine must refuse in this state, leaving everything unchanged."""
        c, b = self.choices, self.config.block_size
        options: list[Op] = [
            {"op": "finish", "rid": UNKNOWN_REQUEST},
            {"op": "load_done", "rid": UNKNOWN_REQUEST},
            {"op": "report", "event": UNKNOWN_EVENT + c.integer(0, UNKNOWN_EVENT_SPREAD - 1), "count": 1},
            {"op": "step", "admit": [], "chunk": 0},
            {"op": "step", "admit": [], "budget": 0},
            {"op": "step", "admit": [UNKNOWN_REQUEST]},
            {"op": "add", "rid": "", "family": 0, "prompt_len": 1},
            {"op": "add", "rid": UNKNOWN_REQUEST, "family": -1, "prompt_len": b},
        ]
        reqs = engine.requests
        finished = [rid for rid, r in reqs.items() if r.status == FINISHED]
        running = [rid for rid, r in reqs.items() if r.status == RUNNING]
        loaded = [rid for rid, r in reqs.items() if r.status == LOADED]
        if loaded:  # vLLM preempts running requests only
            options.append({"op": "step", "admit": [], "preempt": [c.pick(loaded)]})
        if finished:
            options.append({"op": "finish", "rid": c.pick(finished)})
        if running:
            options.append({"op": "step", "admit": [c.pick(running)]})
        if reqs:
            options.append({"op": "add", "rid": c.pick(sorted(reqs)), "family": 0, "prompt_len": 4})
        if engine.reports_left:
            event = c.pick(sorted(engine.reports_left))
            options.append({"op": "report", "event": event, "count": engine.reports_left[event] + 1})
        if self.config.num_speculative_tokens:
            options.append({"op": "step", "admit": [], "accept": self.config.num_speculative_tokens + 1})
        return c.pick(options)


def _is_done(engine: Engine, rid: str) -> bool:
    """Running with every output token sampled and everything but the last token computed."""
    r = engine.requests[rid]
    return r.status == RUNNING and len(r.output) >= r.max_tokens and r.num_computed_tokens >= r.num_tokens - 1
