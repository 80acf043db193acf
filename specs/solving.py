"""The machinery that discharges proof obligations, shared by ``obligations.py`` (the first
manager's catalogue, which re-exports every name here) and ``offloading_obligations.py`` (the
second manager's): the obligation and result records, the expected result per kind, and the
solver calls with a fixed ``random_seed`` and an ``rlimit`` (a check that exhausts it reports
``unknown``, a failure, never a silent pass). Kinds: ``obligations.py``'s module docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import z3

from kvspec.specs.encoding import check_sat, reset_names

SEED = 7
RLIMIT = 20_000_000
TIMEOUT_MS = 60_000

PASS = {"proof": "holds", "bounded": "holds", "counterexample": "found", "vacuity": "ok", "existence": "holds",
        "witness": "reached", "mutation": "caught"}


def solver(seed: int = SEED) -> z3.Solver:
    s = z3.Solver()
    s.set("random_seed", seed)
    s.set("rlimit", RLIMIT)
    s.set("timeout", TIMEOUT_MS)  # safety net only: the rlimit is what normally stops a check
    return s


def _check(constraints: list[z3.BoolRef]) -> tuple[z3.CheckSatResult, z3.Solver]:
    """Check with the fixed seed; on 'unknown' (quantifier instantiation gave up) retry with the
    next two fixed seeds. Deterministic: the same formulas give the same answer every run."""
    for seed in (SEED, SEED + 1, SEED + 2):
        s = solver(seed)
        s.add(*constraints)
        r = check_sat(s)
        if r != z3.unknown:
            break
    return r, s


@dataclass
class Result:
    name: str
    policy: str
    kind: str
    result: str
    seconds: float
    detail: str = ""
    model: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result == PASS[self.kind]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "policy": self.policy, "kind": self.kind, "result": self.result,
                "seconds": round(self.seconds, 3), "ok": self.ok, "detail": self.detail}


class CheckFn(Protocol):
    """An obligation's check, called with no arguments (the catalogue's lambdas bind their loop
    variables as defaults) -> (result, detail, model values)."""

    def __call__(self) -> tuple[str, str, dict[str, Any]]: ...


@dataclass(frozen=True)
class Obligation:
    name: str
    policy: str
    kind: str
    check: CheckFn  # -> (result, detail, model values)
    statement: str = ""

    def run(self) -> Result:
        t0 = time.perf_counter()
        reset_names()
        result, detail, model = self.check()
        return Result(self.name, self.policy, self.kind, result, time.perf_counter() - t0, detail, model)


# -- check helpers -----------------------------------------------------------------------------


def _valid(assumptions: list[z3.BoolRef], goal: z3.BoolRef,
           witness: list[z3.BoolRef] | None = None) -> tuple[str, str]:
    """'holds' iff assumptions are satisfiable and entail goal; else 'vacuous'/'fails'/'unknown'.

    ``witness``: extra constraints for the satisfiability check only (a concrete instance
    where model-based quantifier instantiation alone gives up); satisfiable with them
    implies satisfiable without."""
    r, s = _check([*assumptions, *(witness or [])])
    if r == z3.unsat:
        return "vacuous", "assumptions unsatisfiable"
    if r == z3.unknown:
        return "unknown", f"assumptions: {s.reason_unknown()}"
    r, s = _check([*assumptions, z3.Not(goal)])
    if r == z3.unsat:
        return "holds", ""
    if r == z3.sat:
        return "fails", "counterexample to the goal"
    return "unknown", s.reason_unknown()


def _sat(assumptions: list[z3.BoolRef], read: Callable[[z3.ModelRef], dict[str, Any]] | None = None
         ) -> tuple[str, dict[str, Any]]:
    r, s = _check(assumptions)
    if r == z3.sat:
        return "sat", (read(s.model()) if read else {})
    if r == z3.unsat:
        return "unsat", {}
    return "unknown", {"reason": s.reason_unknown()}


def _all_steps(results: list[tuple[str, str, str]]) -> tuple[str, str, dict[str, Any]]:
    """Combine per-transition results: the first non-'holds' decides; details name the step."""
    for step, r, d in results:
        if r != "holds":
            return r, f"{step}: {d}".strip(": "), {}
    return "holds", f"{len(results)} checks", {}
