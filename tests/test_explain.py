"""The narrated replay (``kvspec replay --explain``), the finding page (``--html``) and the pages
``fuzz`` and ``bugs`` write: what they say is what the replay observed, and the page is
self-contained."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from kvspec.adapters.targets import get_factory
from kvspec.cli import main
from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import ConnectorMetadata, SchedulerOutput
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import run_ops
from kvspec.model import make_scheduler
from kvspec.oracle.catalogue import CATALOGUE, Violation
from kvspec.report import html as page
from kvspec.report.narrate import Narration, block_pools, narrate
from kvspec.report.positions import CPU, LOST, NULL, STORING, Position

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "tests" / "traces"
SHIPPED = sorted(p.stem for p in TRACES.glob("*.jsonl"))
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


def narrated(name: str) -> Narration:
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    assert tr.oracle is not None
    return narrate(f"{name}.jsonl", tr.target, ",".join(tr.oracle), tr.config, tr.ops, get_factory(tr.target),
                   tr.oracle, tr.finding)


@pytest.mark.parametrize("name", SHIPPED)
def test_narration_reaches_the_same_finding_as_replay(name: str) -> None:
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    plain = run_ops(tr.config, tr.ops, get_factory(tr.target), tr.oracle)
    n = narrated(name)
    assert n.outcome.to_json() == plain.to_json() and n.reproduces is True
    assert [s.index for s in n.stories] == list(range(len(tr.ops)))
    last = n.stories[-1]
    assert last.finding is not None and last.finding.invariant == tr.finding["invariant"]  # type: ignore[index]
    assert last.finding.rule == " ".join(CATALOGUE[last.finding.invariant].statement.split())
    assert all(s.finding is None for s in n.stories[:-1])


def test_vllm_fixme_is_told_in_the_engine_terms() -> None:
    """The C1 finding: finishing r2 queues a flush whose allocation evicts r3's p1 below its cursor."""
    n = narrated("vllm-fixme")
    finish = n.stories[6]
    events = "\n".join(finish.events)
    assert "finish flush queued: GPU 4 -> CPU 3" in events
    assert "CPU block 3 evicted 06133564f2ca6955:0; it hit r2 g0 p1 (no longer held), r3 g0 p1 (now a hole " \
           "below the cursor)" in events
    r3 = next(r for r in finish.requests if r.rid == "r3")
    assert r3.lanes[0].cursor == 2 and r3.lanes[0].positions_in(LOST) == [1]
    assert r3.describe() == "r3 running, 64/96 tokens computed; g0 cursor 2, holes p1; g1 cursor 0"
    assert Position("r3", 0, 1) in finish.evicted
    f = finish.finding
    assert f is not None and f.positions == {Position("r3", 0, 1)}
    details = "\n".join(f.details)
    assert "GPU block 3: held by r3 g0 p1" in details
    assert "last evicted from CPU block 3 at operation 6" in details
    stored = n.stories[2]
    assert any(e.startswith("store event 0 planned: GPU 1 -> CPU 1 (c8b180692549256b:0 of r2 g0 p0)")
               for e in stored.events)
    assert "r2 cursor: g0 0 -> 1, g1 0 -> 1" in stored.events
    r2 = stored.requests[0].lanes
    assert r2[0].cells[0] == STORING and r2[1].cells[:2] == (NULL, NULL)  # g1: p0, p1 left the 16-token window
    completed = n.stories[5]
    assert "store event 1 completed: CPU 3 = 06133564f2ca6955:0" in completed.events
    assert next(r for r in completed.requests if r.rid == "r3").lanes[0].cells[1] == CPU


def test_a_prefix_hit_on_blocks_hashed_in_the_same_step_is_told() -> None:
    """recover-referenced, operation 4: r1 (running, 15 of 32 tokens computed before the step, so no
    block of it was hashed yet) is scheduled first and fills both its blocks; r3, admitted after it
    in the same step, gets a GPU prefix hit on them (r3's cursor moves to 2: the store was planned
    with its 32 hit tokens computed). In the 16-token sliding-window group the hit's p0 is null."""
    step = narrated("recover-referenced").stories[4]
    assert "r3 admitted (GPU prefix hit of 32 tokens: g0 p0-p1, g1 p1; g1 p0 null, out of the window)" \
        in step.events
    assert "r2 admitted (no GPU prefix hit)" in step.events  # another family: a fresh table
    r1, r3 = (next(r for r in step.requests if r.rid == rid) for rid in ("r1", "r3"))
    assert r3.lanes[0].blocks[:2] == r1.lanes[0].blocks and r3.lanes[1].blocks[1] == r1.lanes[1].blocks[1]
    assert "r3 cursor: g0 0 -> 2, g1 0 -> 2" in step.events


def test_a_cpu_block_finding_names_the_pins_and_transfers() -> None:
    """I4 (pin-leak): the block's listings are what its ref count should equal."""
    f = narrated("pin-leak").stories[-1].finding
    assert f is not None
    assert any(d.startswith("CPU block 1: listed by load of r1, CPU pin of r4") and "ref 3" in d for d in f.details)


def test_a_dropped_store_event_is_not_called_completed() -> None:
    """reset-releases-inflight: the scheduler drops event 0 with its report still outstanding."""
    reset = narrated("reset-releases-inflight").stories[-1]
    assert any("store event 0 dropped by the scheduler with 2 rank reports still outstanding" in e
               for e in reset.events)
    assert reset.finding is not None and any(d.startswith("store event 0: no longer held by the scheduler")
                                             for d in reset.finding.details)


@pytest.mark.parametrize("message, blocks, want", [
    ("load CPU 1 (k) -> GPU 5 does not match the position's key", (5, 1), [("gpu", 5), ("cpu", 1)]),
    ("cpu: block 2 is hashed k but not in the map", (2,), [("cpu", 2)]),
    ("key k is being stored from GPU blocks 5 and 7", (5, 7), [("gpu", 5), ("gpu", 7)]),
    ("group 0 position 1: key k is below the cursor", (3,), [("gpu", 3)]),
])
def test_block_pools_follow_the_message(message: str, blocks: tuple[int, ...], want: list[tuple[str, int]]) -> None:
    assert block_pools(Violation("I0", message, blocks)) == want


class CrashingScheduler:
    """A model target whose second planning step raises (a crash, not a rejection)."""

    def __init__(self, config: OffloadConfig) -> None:
        self.inner = make_scheduler(config)
        self.plans = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def build_connector_meta(self, out: SchedulerOutput) -> ConnectorMetadata:
        self.plans += 1
        if self.plans == 2:
            raise RuntimeError("planner exploded")
        meta: ConnectorMetadata = self.inner.build_connector_meta(out)
        return meta


def test_a_crash_is_narrated_as_a_crash() -> None:
    ops = [{"op": "add", "rid": "a", "family": 0, "prompt_len": 40}, {"op": "step", "admit": ["a"]},
           {"op": "step"}]
    config = OffloadConfig(policy="repair")
    n = narrate("crash", "crashing", "claims", config, ops, CrashingScheduler, ("C1",))  # type: ignore[arg-type]
    assert n.outcome.kind == "crash" and len(n.stories) == 3
    f = n.stories[-1].finding
    assert f is not None and f.kind == "crash" and "planner exploded" in f.summary and f.invariant is None
    assert "RuntimeError" in page.render_page(n)


def test_cli_explain_prints_every_operation_and_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(TRACES / "vllm-fixme.jsonl"), "--explain"]) == 1
    out = capsys.readouterr().out
    assert [int(m) for m in re.findall(r"^#(\d+) ", out, re.M)] == list(range(7))
    assert "    rule C1 (completeness): For an active request" in out
    assert "recorded finding: violation C1 at operation 6: reproduced" in out


def test_cli_explain_json_carries_the_narration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(TRACES / "thrash.jsonl"), "--explain", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    ops = doc["narration"]["operations"]
    assert doc["reproduces_recorded"] is True and len(ops) == 11 and ops[-1]["finding"]["invariant"] == "C6"
    r2 = next(r for r in ops[-1]["requests"] if r["rid"] == "r2")
    assert r2["groups"][0]["recorded"] == [0] and ops[-1]["evicted"]


class PageParts(HTMLParser):
    """Tags, attributes that could fetch something, and the classes drawn in the timeline."""

    FETCHING = ("src", "href", "data", "action", "poster", "srcset")

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.references: list[str] = []
        self.classes: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for key, value in attrs:
            if key in self.FETCHING and value is not None:
                self.references.append(value)
            if key == "class" and value is not None:
                self.classes += value.split()


def parse(text: str) -> PageParts:
    parts = PageParts()
    parts.feed(text)
    return parts


def test_cli_html_writes_a_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fixme.html"
    assert main(["replay", str(TRACES / "vllm-fixme.jsonl"), "--html", str(out)]) == 1
    assert "#0" not in capsys.readouterr().out  # --html alone prints no narration
    text = out.read_text(encoding="utf-8")
    parts = parse(text)
    assert "script" not in parts.tags and "link" not in parts.tags and "img" not in parts.tags
    assert all(ref.startswith("#") for ref in parts.references), parts.references  # in-page links only
    assert re.findall(r"(?:https?:)?//[^\s\"'<>]+", text) == [SVG_NAMESPACE] * text.count(SVG_NAMESPACE)
    assert "@import" not in text and "url(" not in text
    assert parts.classes.count("violating") == 1 and "finding-row" in parts.classes
    assert text.count('id="timeline"') == 1 and "details" not in parts.tags


def test_long_traces_fold_before_the_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past OPEN_LIMIT operations, the last OPEN_BEFORE + 1 are open and drawn, the rest folded."""
    monkeypatch.setattr(page, "OPEN_LIMIT", 10)
    monkeypatch.setattr(page, "OPEN_BEFORE", 3)
    monkeypatch.setattr(page, "FOLD_CHUNK", 4)
    n = narrated("mrv2-resume")
    parts = parse(page.render_page(n))
    assert parts.tags.count("details") == 5  # 17 folded operations in chunks of 4
    assert parts.classes.count("op") == 21 and parts.classes.count("finding-op") == 1
    text = page.render_page(n)
    timeline = text[text.index('<svg xmlns="http://www.w3.org/2000/svg" id="timeline"'):]
    assert "#16 " not in timeline[:timeline.index("</svg>")] and "#17 " in timeline


def test_fuzz_and_bugs_write_a_page_next_to_every_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fuzz_out, bugs_out = tmp_path / "fuzz", tmp_path / "bugs"
    assert main(["fuzz", "--target", "bug:vllm-fixme", "--budget", "5", "--out", str(fuzz_out), "--json"]) == 1
    assert main(["bugs", "--only", "vllm-fixme", "--budget", "5", "--out", str(bugs_out), "--json"]) == 0
    capsys.readouterr()
    for folder in (fuzz_out, bugs_out):
        traces = sorted(folder.glob("*.jsonl"))
        assert traces and sorted(folder.glob("*.html")) == [t.with_suffix(".html") for t in traces]
        for t in traces:
            text = t.with_suffix(".html").read_text(encoding="utf-8")
            assert "reproduces the recorded finding" in text and "violating" in text


def test_readme_links_the_screenshot() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\((docs/[^)]+\.png)\)", readme)
    assert links and all((ROOT / link).read_bytes().startswith(b"\x89PNG") for link in links)
