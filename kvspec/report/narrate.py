"""The narrated replay: a trace run operation by operation and told in the engine's terms, as data.

``Narrator`` runs the operations through the harness's own run loop (``harness.start_run`` and
``Run.apply``, so the outcome is exactly the one ``replay`` reports) and, around each operation,
takes the engine's snapshots before and after it. From those two snapshots alone it builds a
``Story``: a headline, the sentences of ``kvspec.report.events``, every listed request's state
afterwards (status, tokens, and per group its position cells, cursor, holes and lost records:
``kvspec.report.positions``), the positions whose CPU entry the operation evicted, and, at the
operation that produced the finding, a ``FindingStory``: the invariant's rule in words (from the
catalogue) and the exact blocks, keys, events and positions the violation involves.

Each story costs O(size of the two snapshots); ``stories`` yields them one at a time, so text
output streams a trace of any length.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvspec.adapters.targets import TargetFactory
from kvspec.contract.config import OffloadConfig
from kvspec.drivers.harness import CRASH, Outcome, Run, start_run
from kvspec.oracle.catalogue import CATALOGUE, Violation
from kvspec.report.events import Observed, describe, evicted_keys
from kvspec.report.positions import LOST, RECORDED, Lane, Position

KEY_TEXT = re.compile(r"\b[0-9a-f]{16}:\d+\b")
POOL_MENTION = re.compile(r"\b(CPU|GPU)(?: blocks?)? (\d+)")
EVENT_MENTION = re.compile(r"\bstore event (\d+)")
KIND_RULES = {
    "crash": "a crash: the target raised an exception other than a KVSpecError (a clean rejection of bad "
             "input raises a KVSpecError and changes nothing)",
    "divergence": "a divergence: the target and the reference target disagree on this operation "
                  "(accepted vs rejected, or different snapshots)",
    "expectation": "an unmet expectation: the trace records this operation as accepted (or as "
                   "\"expect\": \"error\") and the target did otherwise",
}


@dataclass(frozen=True)
class RequestState:
    """One request after an operation: status, tokens, and one lane per KV group."""

    rid: str
    status: str
    computed: int
    tokens: int
    lanes: tuple[Lane, ...]

    def describe(self) -> str:
        """``r3 running, 48/96 tokens computed; g0 cursor 2, holes p1; g1 cursor 2``."""
        return f"{self.rid} {self.status}, {self.computed}/{self.tokens} tokens computed; {self.groups_text()}"

    def groups_text(self) -> str:
        """Per group: the cursor, then the holes and lost records (``g0 cursor 2, holes p1``)."""
        groups = []
        for lane in self.lanes:
            text = f"g{lane.group} " + (f"cursor {lane.cursor}" if lane.cursor is not None else "no store state")
            for state, word in ((LOST, "holes"), (RECORDED, "recorded")):
                where = lane.positions_in(state)
                if where:
                    text += f", {word} " + " ".join(f"p{p}" for p in where)
            groups.append(text)
        return "; ".join(groups)

    def to_json(self) -> dict[str, Any]:
        return {"rid": self.rid, "status": self.status, "num_computed_tokens": self.computed,
                "num_tokens": self.tokens,
                "groups": [{"group": lane.group, "cursor": lane.cursor, "cells": list(lane.cells),
                            "blocks": list(lane.blocks), "keys": list(lane.keys),
                            "holes": lane.positions_in(LOST), "recorded": lane.positions_in(RECORDED)}
                           for lane in self.lanes]}


@dataclass(frozen=True)
class FindingStory:
    """The finding at its operation: ``summary`` is the replay's one line, ``rule`` the invariant's
    statement in words (or what the finding's kind means), ``details`` one sentence per block, key,
    event and request involved, ``positions`` the request positions to highlight."""

    kind: str
    summary: str
    invariant: str | None
    title: str
    rule: str
    details: tuple[str, ...]
    positions: frozenset[Position]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "summary": self.summary, "invariant": self.invariant, "title": self.title,
                "rule": self.rule, "details": list(self.details),
                "positions": [[p.rid, p.group, p.index] for p in sorted(self.positions, key=_order)]}


@dataclass(frozen=True)
class Story:
    """One operation: what it did (``events``), every listed request afterwards, the positions whose
    CPU entry it evicted, whether it was rejected cleanly, and the finding it produced, if any."""

    index: int
    op: dict[str, Any]
    headline: str
    events: tuple[str, ...]
    requests: tuple[RequestState, ...]
    evicted: frozenset[Position] = frozenset()
    rejected: bool = False
    finding: FindingStory | None = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "op": self.op, "headline": self.headline, "events": list(self.events),
                "rejected": self.rejected, "requests": [r.to_json() for r in self.requests],
                "evicted": [[p.rid, p.group, p.index] for p in sorted(self.evicted, key=_order)],
                "finding": self.finding.to_json() if self.finding is not None else None}

    def text(self) -> str:
        """The story as indented text lines (the ``--explain`` output)."""
        lines = [f"#{self.index} {self.headline}"]
        lines += [f"    {e}" for e in self.events]
        lines += [f"    after: {r.describe()}" for r in self.requests]
        if self.finding is not None:
            f = self.finding
            lines.append(f"    FINDING ({f.kind}): {f.summary}")
            lines.append(f"    rule{f' {f.invariant} ({f.title})' if f.invariant else ''}: {f.rule}")
            lines += [f"      - {d}" for d in f.details]
        return "\n".join(lines)


def _order(pos: Position) -> tuple[str, int, int]:
    return pos.rid, pos.group, pos.index


def headline(op: dict[str, Any]) -> str:
    """The operation as a short title: its name, the request it names, its other arguments (lists
    as ``[r1,r2]``, empty ones left out), ``expect`` last."""
    rid = [str(op["rid"])] if "rid" in op else []
    args = [f"{k}=[{','.join(map(str, v))}]" if isinstance(v, list) else f"{k}={v}"
            for k, v in op.items() if k not in ("op", "rid", "expect") and v not in ([], None)]
    expect = " (expected to be rejected)" if op.get("expect") == "error" else ""
    return " ".join([str(op.get("op")), *rid, *args]) + expect


def request_states(obs: Observed) -> tuple[RequestState, ...]:
    """Every request the snapshot lists, in creation order. O(requests x positions)."""
    return tuple(RequestState(rid, r["status"], r["num_computed_tokens"], r["num_tokens"],
                              tuple(obs.view.lanes(rid)))
                 for rid, r in obs.requests.items())


# -- the finding -----------------------------------------------------------------------------


def block_pools(v: Violation) -> list[tuple[str, int]]:
    """(pool, block) for each block a violation names. The pool is the one the message names for
    that number (``CPU block 3``, ``GPU 5``); failing that, the pool a message starting ``cpu:``
    speaks of, else the GPU (messages about request positions name GPU blocks). O(message)."""
    mentioned = {(pool.lower(), int(n)) for pool, n in POOL_MENTION.findall(v.message)}
    default = "cpu" if v.message.startswith("cpu:") else "gpu"
    out = []
    for b in v.blocks:
        pools = [pool for pool in ("gpu", "cpu") if (pool, b) in mentioned] or [default]
        out += [(pool, b) for pool in pools]
    return out


def listings(obs: Observed, side: str, b: int) -> str:
    """Every transfer and pin that lists block ``b`` on ``side`` ("gpu" or "cpu"): what its ref count
    should account for. O(transfers + pins)."""
    sched = obs.snap["scheduler"]
    found = [f"store event {e}" for e, t in sched["store_events"].items() if b in t[side]]
    found += [f"queued finish flush {i}" for i, t in enumerate(sched["pending_finished_stores"]) if b in t[side]]
    found += [f"abandoned store event {e}" for e, t in sched["abandoned_store_events"].items() if b in t[side]]
    found += [f"load of {rid}" for rid, ls in sched["reqs_to_load"].items() if b in ls[side]]
    found += [f"abandoned load of {rid}" for rid, ls in sched["abandoned_reqs_to_load"].items() if b in ls[side]]
    if side == "cpu":
        found += [f"CPU pin of {rid}" for rid, pin in sched["pending_cpu_hits"].items()
                  if any(b in group for group in pin["blocks"])]
    return ", ".join(found) or "no transfer or pin"


def _gpu_block(obs: Observed, b: int) -> str:
    pool = obs.snap["gpu_pool"]
    flight = "in flight" if b in obs.snap["scheduler"]["in_flight"] else "not in flight"
    return (f"GPU block {b}: held by {obs.holders(b)}; listed by {listings(obs, 'gpu', b)}; "
            f"key {pool['block_hash'][b] or 'none (unhashed)'}, ref {pool['ref_cnt'][b]}, {flight}, "
            f"data {obs.snap['engine']['gpu_data'][b]}")


def _cpu_block(obs: Observed, c: int) -> str:
    pool = obs.snap["cpu_pool"]
    queue = pool["free_queue"]
    where = f"free queue position {queue.index(c)}" if c in queue else "not in the free queue"
    return (f"CPU block {c}: listed by {listings(obs, 'cpu', c)}; key {pool['block_hash'][c] or 'none (unhashed)'}, "
            f"ref {pool['ref_cnt'][c]}, {where}, data {obs.snap['engine']['cpu_data'][c]}")


def _key(obs: Observed, key: str, evictions: dict[str, tuple[int, int]]) -> str:
    cached = obs.snap["cpu_pool"]["cached"].get(key)
    on_cpu = f"cached on CPU block {', '.join(map(str, cached))}" if cached else "not cached on CPU"
    storing = "being stored" if key in obs.view.storing else "not being stored"
    gpu = obs.snap["gpu_pool"]["cached"].get(key, [])
    owners = ", ".join(f"{pos} ({obs.state(pos)})" for pos in obs.by_key.get(key, [])) or "no listed request"
    text = f"key {key}: position of {owners}; {on_cpu}, {storing}, on GPU block(s) {gpu or 'none'}"
    if key in evictions:
        op_index, c = evictions[key]
        text += f"; last evicted from CPU block {c} at operation {op_index}"
    return text


def _event(obs: Observed, e: str) -> str:
    sched, eng = obs.snap["scheduler"], obs.snap["engine"]
    where = ("live" if e in sched["store_events"] else "abandoned" if e in sched["abandoned_store_events"]
             else "no longer held by the scheduler")
    left = eng["reports_left"].get(e)
    reports = f"{left} rank reports still outstanding" if left is not None else "no reports outstanding"
    counted = sched["store_event_pending_counts"].get(e)
    return (f"store event {e}: {where}; the engine has {reports}; the scheduler counts "
            f"{counted if counted is not None else 'no'} partial reports")


def _violation_positions(v: Violation, obs: Observed, keys: Iterable[str]) -> frozenset[Position]:
    """Positions to highlight: those holding a GPU block the violation names, or whose key it names,
    limited to the requests it names when it names any."""
    out: set[Position] = set()
    for pool, b in block_pools(v):
        if pool == "gpu":
            out.update(obs.by_block.get(b, []))
    for key in keys:
        out.update(obs.by_key.get(key, []))
    return frozenset(p for p in out if not v.requests or p.rid in v.requests)


def violation_story(out: Outcome, v: Violation, obs: Observed, evictions: dict[str, tuple[int, int]]) -> FindingStory:
    """The violation in words: its rule, then each block, key, event and request it involves."""
    inv = CATALOGUE[v.id]
    details = [f"message: {v}"]
    keys = list(dict.fromkeys(KEY_TEXT.findall(v.message)))
    for pool, b in block_pools(v):
        details.append(_gpu_block(obs, b) if pool == "gpu" else _cpu_block(obs, b))
        cpu_key = obs.snap["cpu_pool"]["block_hash"][b] if pool == "cpu" else None
        if cpu_key is not None and cpu_key not in keys:
            keys.append(cpu_key)
    details += [_key(obs, key, evictions) for key in keys]
    details += [_event(obs, e) for e in dict.fromkeys(EVENT_MENTION.findall(v.message))]
    states = {r.rid: r for r in request_states(obs)}
    details += [f"request {states[rid].describe()}" for rid in v.requests if rid in states]
    return FindingStory("violation", out.describe(), v.id, inv.title, " ".join(inv.statement.split()),
                        tuple(details), _violation_positions(v, obs, keys))


def finding_story(out: Outcome, obs: Observed, evictions: dict[str, tuple[int, int]]) -> FindingStory:
    """The finding of ``out`` (a violation, crash, divergence or unmet expectation)."""
    if out.violation is not None:
        return violation_story(out, out.violation, obs, evictions)
    kind = out.kind or "finding"
    return FindingStory(kind, out.describe(), None, kind, KIND_RULES.get(kind, kind), (out.describe(),), frozenset())


# -- the narrator ----------------------------------------------------------------------------


@dataclass
class Narrator:
    """Runs operations on a fresh engine over ``factory(config)`` judged by ``oracle`` (optionally
    against ``reference``) and tells each one; ``outcome`` is set once ``stories`` is exhausted."""

    config: OffloadConfig
    factory: TargetFactory
    oracle: tuple[str, ...]
    reference: TargetFactory | None = None
    outcome: Outcome | None = None
    evictions: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (operation, CPU block)

    def stories(self, ops: Iterable[dict[str, Any]]) -> Iterator[Story]:
        """One ``Story`` per operation, up to and including the one that produced a finding."""
        run = start_run(self.config, self.factory, self.oracle, self.reference)
        if isinstance(run, Outcome):  # the target could not even be built
            self.outcome = run
            return
        before = Observed(run.engine.snapshot())
        for op in ops:
            story, after, found = self._apply(run, op, before)
            yield story
            if found is not None:
                self.outcome = found
                return
            before = after
        self.outcome = Outcome(run.index, rejected=run.rejected)

    def _apply(self, run: Run, op: dict[str, Any], before: Observed) -> tuple[Story, Observed, Outcome | None]:
        index, rejected_so_far = run.index, run.rejected
        found = run.apply(op)
        after = self._observe_after(run, before, found)
        rejected = run.rejected > rejected_so_far
        events = ["rejected cleanly (a KVSpecError; nothing changed)"] if rejected else describe(op, before, after)
        evicted = evicted_keys(before, after)
        for key, c in evicted.items():
            self.evictions[key] = (index, c)
        hit = frozenset(pos for key in evicted for pos in after.by_key.get(key, []))
        story = Story(index, dict(op), headline(op), tuple(events), request_states(after), hit, rejected,
                      finding_story(found, after, self.evictions) if found is not None else None)
        return story, after, found

    @staticmethod
    def _observe_after(run: Run, before: Observed, found: Outcome | None) -> Observed:
        """The engine's snapshot after the operation. After a crash the target may be unable to
        produce one at all (that is what crashed); the story then shows the state before it."""
        if found is not None and found.kind == CRASH:
            try:
                return Observed(run.engine.snapshot())
            except Exception:  # the crashed target's snapshot is itself broken: nothing more to observe
                return before
        return Observed(run.engine.snapshot())


@dataclass(frozen=True)
class Narration:
    """A whole narrated replay: where it came from, how it was judged, every story, the outcome."""

    trace: str
    target: str
    oracle: str
    config: dict[str, Any]
    recorded: dict[str, Any] | None
    stories: tuple[Story, ...]
    outcome: Outcome

    @property
    def reproduces(self) -> bool | None:
        """Whether the outcome is the finding the trace header recorded (None: none recorded)."""
        if self.recorded is None:
            return None
        found = self.outcome.finding()
        keys = ("kind", "op_index", "invariant", "exception")
        return found is not None and all(found[k] == self.recorded.get(k) for k in keys)

    @property
    def finding_index(self) -> int | None:
        """The index of the story that carries the finding, if any."""
        last = self.stories[-1] if self.stories else None
        return last.index if last is not None and last.finding is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"trace": self.trace, "target": self.target, "oracle": self.oracle, "config": self.config,
                "recorded_finding": self.recorded, "reproduces_recorded": self.reproduces,
                "outcome": self.outcome.to_json(), "operations": [s.to_json() for s in self.stories]}


def narrate(trace_name: str, target: str, oracle_name: str, config: OffloadConfig, ops: Iterable[dict[str, Any]],
            factory: TargetFactory, oracle: tuple[str, ...], recorded: dict[str, Any] | None = None,
            reference: TargetFactory | None = None) -> Narration:
    """Narrate every operation of ``ops`` (up to the finding) and collect the stories."""
    narrator = Narrator(config, factory, oracle, reference)
    stories = tuple(narrator.stories(ops))
    assert narrator.outcome is not None  # set when the stories are exhausted
    return Narration(trace_name, target, oracle_name, config.to_json(), recorded, stories, narrator.outcome)
