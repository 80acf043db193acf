"""Fuzzing, shrinking, traces and replay for the second manager (``CPUOffloadingManager``).

The same three outcomes as the first manager's fuzzer (``kvspec.drivers.harness``): after
every operation the oracle (catalogue ids O1-O10) judges the driver's snapshot; a *violation*
names its invariant, a *crash* is anything the target raises but a ``KVSpecError``, and a
*rejection* (a ``KVSpecError`` on a call the generator made as the connector would) ends the
trace, is counted and is never a finding. A finding is shrunk (operations removed while a
fresh replay still gives the same invariant or the same exception type) and written as a
trace: JSON Lines, a header (``manager: offloading``, the configuration, target, oracle,
finding) then one operation per line (``kvspec.drivers.offloading``'s format).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvspec.contract.errors import KVSpecError, TraceError
from kvspec.contract.offloading import OffloadingConfig, OffloadingFactory
from kvspec.drivers.offloading import Driver, Generator, random_offloading_config
from kvspec.oracle.catalogue import check

TRACE_VERSION = 1
MAX_LINE = 1 << 20  # bytes of one trace line
TRACE_LENGTH = 120  # operations per generated trace


@dataclass
class Finding:
    kind: str  # "violation" or "crash"
    op_index: int
    invariant: str | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "op_index": self.op_index, "invariant": self.invariant, "message": self.message}


@dataclass
class Outcome:
    finding: Finding | None
    ops: int
    rejected: bool = False


def run(factory: OffloadingFactory, config: OffloadingConfig, ops: list[dict[str, Any]],
        oracle: tuple[str, ...]) -> Outcome:
    """Replay ``ops`` on a fresh target, judging after every operation: the first finding."""
    driver = Driver(factory(config))
    for i, op in enumerate(ops):
        try:
            driver.apply(op)
        except KVSpecError:
            return Outcome(None, i, rejected=True)
        except Exception as exc:  # anything else the target raises is a crash: a finding
            return Outcome(Finding("crash", i, None, f"{type(exc).__name__}: {exc}"), i + 1)
        violations = check(driver.snapshot(), oracle)
        if violations:
            v = violations[0]
            return Outcome(Finding("violation", i, v.id, str(v)), i + 1)
    return Outcome(None, len(ops))


def _same(a: Finding | None, b: Finding | None) -> bool:
    return a is not None and b is not None and a.kind == b.kind and (
        a.invariant == b.invariant if a.kind == "violation" else a.message.split(":")[0] == b.message.split(":")[0])


def shrink(factory: OffloadingFactory, config: OffloadingConfig, ops: list[dict[str, Any]],
           oracle: tuple[str, ...], finding: Finding) -> tuple[list[dict[str, Any]], Finding]:
    """Delta debugging: drop chunks of operations (halving the chunk size) while a replay
    still makes the same finding; then cut everything after it."""
    ops = ops[:finding.op_index + 1]
    chunk = max(1, len(ops) // 2)
    while chunk >= 1:
        i = 0
        while i < len(ops):
            candidate = ops[:i] + ops[i + chunk:]
            out = run(factory, config, candidate, oracle)
            if _same(out.finding, finding):
                assert out.finding is not None
                ops, finding = candidate[:out.finding.op_index + 1], out.finding
            else:
                i += chunk
        chunk //= 2
    return ops, finding


@dataclass
class FuzzResult:
    traces: int = 0
    ops: int = 0
    rejected: int = 0
    seconds: float = 0.0
    finding: Finding | None = None
    config: OffloadingConfig | None = None
    trace: list[dict[str, Any]] = field(default_factory=list)
    shrunk_from: int = 0


def fuzz(factory: OffloadingFactory, budget: float, seed: int, oracle: tuple[str, ...], policy: str | None = None,
         progress: Callable[[FuzzResult], None] | None = None, stop_at_first: bool = True) -> FuzzResult:
    """Random traces for ``budget`` seconds (trace ``t`` of seed ``s`` draws from
    ``Random(s * 1_000_003 + t)``), stopping at the first finding, which is shrunk."""
    res = FuzzResult()
    start = last_report = time.monotonic()
    while time.monotonic() - start < budget:
        rng = random.Random(seed * 1_000_003 + res.traces)
        cfg = random_offloading_config(rng)
        if policy is not None and cfg.policy != policy:
            cfg = OffloadingConfig(**{**cfg.to_json(), "policy": policy})
        gen = Generator(rng)
        driver = Driver(factory(cfg))
        ops: list[dict[str, Any]] = []
        res.traces += 1
        finding = None
        while len(ops) < TRACE_LENGTH and finding is None:
            for op in gen.next_ops():
                ops.append(op)
                try:
                    result = driver.apply(op)
                except KVSpecError:
                    res.rejected += 1
                    break
                except Exception as exc:  # a crash of the target
                    finding = Finding("crash", len(ops) - 1, None, f"{type(exc).__name__}: {exc}")
                    break
                gen.feed(op, result)
                violations = check(driver.snapshot(), oracle)
                if violations:
                    finding = Finding("violation", len(ops) - 1, violations[0].id, str(violations[0]))
                    break
            else:
                continue
            break
        res.ops += len(ops)
        if progress is not None and time.monotonic() - last_report >= 2.0:
            res.seconds = time.monotonic() - start
            progress(res)
            last_report = time.monotonic()
        if finding is not None:
            res.seconds = time.monotonic() - start
            res.shrunk_from = finding.op_index + 1
            res.trace, res.finding = shrink(factory, cfg, ops, oracle, finding)
            res.config = cfg
            if stop_at_first:
                return res
    res.seconds = time.monotonic() - start
    return res


# -- traces ----------------------------------------------------------------------------------


def write_trace(fh: TextIO, config: OffloadingConfig, target: str, oracle: tuple[str, ...],
                finding: Finding | None, ops: list[dict[str, Any]]) -> None:
    header = {"kvspec_trace": TRACE_VERSION, "manager": "offloading", "config": config.to_json(), "target": target,
              "oracle": list(oracle), "finding": None if finding is None else finding.to_json()}
    fh.write(json.dumps(header) + "\n")
    for op in ops:
        fh.write(json.dumps(op) + "\n")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise ValueError(f"duplicate key {dup!r:.40}")
    return dict(pairs)


def _lines(fh: TextIO) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, line in enumerate(iter(lambda: fh.readline(MAX_LINE + 1), ""), start=1):
        if len(line) > MAX_LINE:
            raise TraceError(n, f"line longer than {MAX_LINE} bytes")
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_no_duplicates)
        except ValueError as exc:
            raise TraceError(n, f"not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise TraceError(n, "expected a JSON object")
        yield n, obj


@dataclass
class OffloadingTrace:
    config: OffloadingConfig
    target: str
    oracle: tuple[str, ...]
    finding: dict[str, Any] | None
    ops: list[dict[str, Any]]


def is_offloading_header(header: object) -> bool:
    return isinstance(header, dict) and header.get("manager") == "offloading"


def read_trace(fh: TextIO) -> OffloadingTrace:
    """A trace of the second manager; ``TraceError`` naming the line and field when malformed."""
    lines = _lines(fh)
    first = next(lines, None)
    if first is None:
        raise TraceError(1, "empty trace")
    n, header = first
    if header.get("kvspec_trace") != TRACE_VERSION or not is_offloading_header(header):
        raise TraceError(n, f"not a version-{TRACE_VERSION} trace of the offloading manager")
    try:
        config = OffloadingConfig.from_json(header.get("config"))
    except KVSpecError as exc:
        raise TraceError(n, f"config: {exc}") from None
    oracle = header.get("oracle")
    if not isinstance(oracle, list) or not all(isinstance(i, str) for i in oracle):
        raise TraceError(n, "oracle: expected a list of invariant ids")
    target = header.get("target")
    if not isinstance(target, str):
        raise TraceError(n, "target: expected a string")
    finding = header.get("finding")
    if finding is not None and not isinstance(finding, dict):
        raise TraceError(n, "finding: expected an object or null")
    ops = [op for _, op in lines]
    if finding is not None and not (isinstance(finding.get("op_index"), int) and 0 <= finding["op_index"] < len(ops)):
        raise TraceError(n, f"finding.op_index: not an operation of this {len(ops)}-operation trace")
    return OffloadingTrace(config, target, tuple(oracle), finding, ops)


@dataclass
class LockstepResult:
    traces: int = 0
    ops: int = 0
    divergence: str | None = None  # "seed S operation I kind: field" of the first divergence


def lockstep(reference: OffloadingFactory, target: OffloadingFactory, budget: float, seed: int,
             max_traces: int | None = None, length: int = 100) -> LockstepResult:
    """The same generated calls on both targets (the generator fed by ``reference``'s answers):
    results and whole snapshots compared after every operation, for ``budget`` seconds or
    ``max_traces`` traces; stops at the first divergence."""
    res = LockstepResult()
    end = time.monotonic() + budget
    while time.monotonic() < end and (max_traces is None or res.traces < max_traces):
        trace_seed = seed * 1_000_003 + res.traces
        rng = random.Random(trace_seed)
        cfg = random_offloading_config(rng)
        gen = Generator(rng)
        a, b = Driver(reference(cfg)), Driver(target(cfg))
        res.traces += 1
        for i in range(length):
            for op in gen.next_ops():
                ra, rb = a.apply(op), b.apply(op)
                res.ops += 1
                gen.feed(op, ra)
                sa, sb = a.snapshot(), b.snapshot()
                if ra != rb or sa != sb:
                    where = "result" if ra != rb else next(k for k in sa if sa[k] != sb.get(k))
                    res.divergence = f"trace seed {trace_seed} operation {i} {op['op']}: {where}"
                    return res
    return res
