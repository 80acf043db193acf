#!/usr/bin/env python3
"""Regenerate the generated regions of specs/SPEC.md from the code.

A region is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; the
script replaces it and leaves every other line alone. Regions:

* ``catalogue``: the invariant catalogue (``kvspec.oracle.catalogue.CATALOGUE``): id,
  title, statement (the check's docstring), whether it needs the engine section,
  and what enforces it.
* ``claims``: which invariant ids each re-store policy guarantees
  (``claims(config)`` of each class in ``kvspec.model.POLICY_CLASSES``), for a
  full-attention configuration and for one with a sliding-window group.
* ``scenarios``: the counterexample scenarios of the policy comparison, each an
  engine-operation sequence run under all three policies; the outcome columns
  (invariants violated, holes left, reachable CPU prefix, store copies) are what
  the runs produced.

``scripts/gen_spec.py`` rewrites the file; ``--check`` only reports whether it is
current (exit 1 if not). tests/test_spec_doc.py runs the same comparison.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.drivers.engine import Engine
from kvspec.model import POLICY_CLASSES, make_scheduler
from kvspec.oracle.catalogue import CATALOGUE, check

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "SPEC.md"
POLICIES = ("baseline", "signal-rescan", "repair")


def _cell(text: str) -> str:
    """One Markdown table cell: whitespace collapsed, pipes escaped."""
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


# -- catalogue -------------------------------------------------------------------------------


def render_catalogue() -> str:
    rows = ["| Id | Title | Statement | Needs `engine` | Enforced by |", "|---|---|---|---|---|"]
    for inv in CATALOGUE.values():
        rows.append(f"| {inv.id} | {_cell(inv.title)} | {_cell(inv.statement)} | "
                    f"{'yes' if inv.needs_engine else 'no'} | {_cell(', '.join(inv.enforced_by))} |")
    return "\n".join(rows)


# -- claims ----------------------------------------------------------------------------------

CLAIM_CONFIGS = {
    "full attention only": OffloadConfig(),
    "full attention + sliding window (64 tokens)": OffloadConfig(groups=(KVGroup(), KVGroup("sliding", 64))),
}


def render_claims() -> str:
    ids = list(CATALOGUE)
    rows = []
    for label, cfg in CLAIM_CONFIGS.items():
        rows.append(f"*{label}*:")
        rows.append("")
        rows.append("| Policy | " + " | ".join(ids) + " |")
        rows.append("|---|" + "---|" * len(ids))
        for name in POLICIES:
            cls = POLICY_CLASSES[name]
            claims_fn = getattr(cls, "claims", None)
            if claims_fn is None:
                rows.append(f"| {name} | " + " | ".join("?" for _ in ids) + " |")
                continue
            claimed = set(claims_fn(cfg))
            rows.append(f"| {name} | " + " | ".join("yes" if i in claimed else "-" for i in ids) + " |")
        rows.append("")
    return "\n".join(rows).rstrip()


# -- scenarios -------------------------------------------------------------------------------


STORY = {"async_scheduling": False}  # the scenarios are told step by step: one batch at a time


@dataclass
class Scenario:
    name: str
    hazard: str
    focus: str  # the request whose prefix the scenario is about
    ops: list[dict[str, Any]]
    what: str
    config: dict[str, Any] = field(default_factory=dict)


def _step(**kw: Any) -> dict[str, Any]:
    return {"op": "step", **kw}


def _report_all() -> dict[str, Any]:
    """Macro: one ``report`` (all ranks) per store event in flight, lowest event first."""
    return {"op": "report_all"}


def apply(eng: Engine, op: dict[str, Any]) -> list[Any]:
    """Run one scenario operation (an engine operation or the ``report_all`` macro)."""
    if op["op"] != "report_all":
        return [eng.apply(op)]
    return [eng.apply({"op": "report", "event": e, "count": n}) for e, n in sorted(eng.reports_left.items())]


T2_OPS: list[dict[str, Any]] = [
    {"op": "add", "rid": "R", "family": 1, "prompt_len": 97, "max_tokens": 40},
    _step(admit=["R"]), _step(), _report_all(), _step(), _report_all(), _step(), _report_all(),
]

SCENARIOS = [
    Scenario(
        "T2", "the FIXME", "R", T2_OPS,
        "R (6 full blocks + 1 token) stores H1-H4, then its own H5, H6 evict H1, H2 from the 4-block "
        "CPU pool; R's cursor (6) has passed them.",
    ),
    Scenario(
        "T3", "same-step self-eviction", "A",
        [
            {"op": "add", "rid": "X", "family": 1, "prompt_len": 33, "max_tokens": 1},
            {"op": "add", "rid": "Y", "family": 2, "prompt_len": 33, "max_tokens": 1},
            _step(admit=["X", "Y"]), _step(), _report_all(),
            {"op": "finish", "rid": "X"}, {"op": "finish", "rid": "Y"},
            {"op": "add", "rid": "A", "family": 1, "prompt_len": 65, "max_tokens": 4},
            _step(admit=["A"]), _step(), _report_all(), _step(), _report_all(),
        ],
        "X and Y leave CPU [Ha0, Ha1, Hb0, Hb1]; A shares X's prefix: its scan judges Ha0, Ha1 "
        "already cached, then allocates for its blocks 2, 3 and pops exactly Ha0, Ha1.",
    ),
    Scenario(
        "H1", "flag consumed by another request", "R1",
        [
            {"op": "add", "rid": "R1", "family": 1, "prompt_len": 33, "max_tokens": 1},
            _step(admit=["R1"]), _step(), _report_all(),
            {"op": "add", "rid": "R2", "family": 2, "prompt_len": 65, "max_tokens": 8},
            _step(admit=["R2"]), _step(), _report_all(),
            {"op": "finish", "rid": "R2"}, _step(), _report_all(), _step(), _report_all(),
        ],
        "R1 stores H1, H2 and has nothing left to schedule; R2's store evicts them; the eviction "
        "flag is consumed by a step in which R1 is not scanned. R2 then finishes, so there is room.",
    ),
    Scenario(
        "H6", "thrash", "R",
        [*T2_OPS, *[op for _ in range(5) for op in (_step(), _report_all())]],
        "T2 continued for six decode steps, each store completing before the next step: the "
        "request's 6 blocks do not fit in 4 CPU blocks.",
    ),
]


@dataclass
class Outcome:
    violated: dict[str, int]  # id -> index of the first operation after which it was violated
    holes: list[int]  # positions of the focus request violating C1 at the end
    reachable: int  # leading positions of the focus request cached on CPU at the end
    copies: int  # GPU->CPU block copies planned over the whole scenario
    copies_last_3: int  # ... in its last three steps


def run_scenario(sc: Scenario, policy: str) -> Outcome:
    eng = Engine(make_scheduler(OffloadConfig(policy=policy, **{**STORY, **sc.config})))
    violated: dict[str, int] = {}
    per_step: list[int] = []
    for i, op in enumerate(sc.ops):
        results = apply(eng, op)
        if op["op"] == "step":
            per_step.append(len(results[0].store_gpu_blocks))
        for v in check(eng.snapshot()):
            violated.setdefault(v.id, i)
    snap = eng.snapshot()
    holes = sorted({int(v.message.split()[3].rstrip(":")) for v in check(snap, ["C1"])
                    if sc.focus in v.requests})
    cached = set(snap["cpu_pool"]["cached"])
    reachable = 0
    for h in snap["engine"]["requests"][sc.focus]["block_hashes"]:
        if f"{h}:0" not in cached:
            break
        reachable += 1
    return Outcome(violated, holes, reachable, sum(per_step), sum(per_step[-3:]))


def render_scenarios() -> str:
    out = []
    for sc in SCENARIOS:
        out.append(f"**{sc.name} ({sc.hazard}).** {sc.what} Configuration: "
                   f"`{json.dumps({**OffloadConfig().to_json(), **STORY, **sc.config, 'policy': '<policy>'})}`.")
        out.append("")
        out.append("```json")
        out.extend(json.dumps(op) for op in sc.ops)
        out.append("```")
        out.append("")
        out.append(f"| Policy | Violated (first after op #) | C1 holes of {sc.focus} at the end | "
                   f"Reachable CPU prefix of {sc.focus} (blocks) | Store copies (last 3 steps) |")
        out.append("|---|---|---|---|---|")
        for policy in POLICIES:
            o = run_scenario(sc, policy)
            viol = ", ".join(f"{k} (#{i})" for k, i in o.violated.items()) or "none"
            holes = ", ".join(f"H{p + 1}" for p in o.holes) or "none"
            out.append(f"| {policy} | {viol} | {holes} | {o.reachable} | {o.copies} ({o.copies_last_3}) |")
        out.append("")
    return "\n".join(out).rstrip()


# -- reference traces ------------------------------------------------------------------------

TRACES = ROOT / "tests" / "traces"


def render_traces() -> str:
    """One row per shrunk reference trace under tests/traces/ (replayed by the regression tests)."""
    from kvspec.model.bugs import BUGS

    rows = ["| Trace | Target | Reintroduces (source) | Configuration | Ops | First violation found |",
            "|---|---|---|---|---|---|"]
    for path in sorted(TRACES.glob("*.jsonl")):
        lines = path.read_text(encoding="utf-8").splitlines()
        header = json.loads(lines[0])
        target = str(header.get("target", ""))
        bug = BUGS.get(target[4:]) if target.startswith("bug:") else None
        what = f"{bug.summary} ({bug.source})" if bug is not None else "-"
        cfg = header.get("config", {})
        groups = "+".join(g["kind"] for g in cfg.get("groups", []))
        conf = (f"{cfg.get('policy')}, {groups}, CPU {cfg.get('num_cpu_blocks')}, GPU {cfg.get('num_gpu_blocks')}, "
                f"world {cfg.get('world_size')}, {'async' if cfg.get('async_scheduling') else 'sync'}")
        if cfg.get("num_speculative_tokens"):
            conf += f", {cfg['num_speculative_tokens']} draft tokens"
        note = str(header.get("note", "")).removeprefix("finding: ")
        rows.append(f"| [`{path.name}`](../tests/traces/{path.name}) | `{target}` | {_cell(what)} | {_cell(conf)} | "
                    f"{len(lines) - 1} | {_cell(note)} |")
    return "\n".join(rows)


# -- the file --------------------------------------------------------------------------------

REGIONS = {"catalogue": render_catalogue, "claims": render_claims, "scenarios": render_scenarios,
           "traces": render_traces}
NOTE = "<!-- generated by scripts/gen_spec.py from the code; edit the code, then rerun the script -->"


def update(text: str, regions: dict[str, str] | None = None) -> str:
    """``text`` with every region replaced by its generated content."""
    regions = regions if regions is not None else {name: fn() for name, fn in REGIONS.items()}
    for name, body in regions.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
        if len(pattern.findall(text)) != 1:
            raise SystemExit(f"SPEC.md must contain exactly one {begin} ... {end} region")
        text = pattern.sub(lambda _m, b=begin, e=end, c=body: f"{b}\n{NOTE}\n\n{c}\n\n{e}", text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if SPEC.md is not current; write nothing")
    parser.add_argument("--path", type=Path, default=SPEC, help="the file (default specs/SPEC.md)")
    args = parser.parse_args(argv)
    text = args.path.read_text(encoding="utf-8")
    new = update(text)
    if args.check:
        if new != text:
            print(f"{args.path} is stale: run scripts/gen_spec.py", file=sys.stderr)
            return 1
        print(f"{args.path} is current")
        return 0
    if new != text:
        args.path.write_text(new, encoding="utf-8")
        print(f"rewrote the generated regions of {args.path}")
    else:
        print(f"{args.path} already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
