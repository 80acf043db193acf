"""The finding page in a real browser: headless Chromium (Debian's ``chromium``) loads each page,
and the checks look at what it drew: the timeline is laid out, the violating cells and only they
are outlined in the highlight colour (read back from screenshot pixels), the page logs no console
error or exception and fetches nothing but itself.

Without Chromium every test here is skipped with a loud reason (also raised as a warning, so the
skip shows in pytest's summary even without ``-rs``); ``.ci/run`` installs it when it can. Every
test here is marked ``deep`` (a browser start per page): ``.ci/run`` runs them in its deep step.
"""

from __future__ import annotations

import json
import random
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvspec.adapters.targets import get_factory
from kvspec.cli import main
from kvspec.contract.config import KVGroup, OffloadConfig
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import default_oracle
from kvspec.drivers.tracegen import random_ops
from kvspec.report import html as page
from kvspec.report.browser import Browser, Image, PageLoad, decode_png, find_chromium
from kvspec.report.narrate import Narration, narrate
from kvspec.report.positions import LOST
from kvspec.report.svg import CELL_FILL, HIGHLIGHT

pytestmark = pytest.mark.deep

TRACES = Path(__file__).resolve().parent / "traces"
SHIPPED = sorted(p.stem for p in TRACES.glob("*.jsonl"))
MISSING = ("CHROMIUM IS NOT INSTALLED: the browser checks of the finding pages did NOT run "
           "(Debian: apt-get install -y chromium; .ci/run installs it when apt can reach its mirror)")
COLOUR_TOLERANCE = 40  # per channel: anti-aliasing blends edge pixels with their neighbours
LARGE_TRACE_OPS = 10_000
OPEN_SECONDS = 3.0

CELLS_JS = """JSON.stringify([...document.querySelectorAll('#timeline .violating')].map(e => {
  const r = e.getBoundingClientRect();
  return {x: r.x + scrollX, y: r.y + scrollY, w: r.width, h: r.height, stroke: getComputedStyle(e).stroke,
          tip: e.textContent};
}))"""
TIMELINE_JS = """(() => { const r = document.getElementById('timeline').getBoundingClientRect();
  return [r.width, r.height, document.querySelectorAll('#timeline rect.cell').length]; })()"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = find_chromium()
    if chromium is None:
        warnings.warn(MISSING, stacklevel=1)
        pytest.skip(MISSING)
    with Browser(chromium) as b:
        yield b


def hex_rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def count_near(image: Image, colour: str) -> int:
    """Pixels within ``COLOUR_TOLERANCE`` of ``colour`` on every channel."""
    want = hex_rgb(colour)
    return sum(1 for row in image.rows for px in row
               if all(abs(a - b) <= COLOUR_TOLERANCE for a, b in zip(px, want, strict=True)))


def shot(browser: Browser, loaded: PageLoad, cell: dict[str, float], dx: float = 0, margin: float = 0) -> Image:
    """The pixels of a cell's box (shifted ``dx`` to the right), ``margin`` pixels wider all round."""
    clip = {"x": cell["x"] + dx - margin, "y": cell["y"] - margin, "width": cell["w"] + 2 * margin,
            "height": cell["h"] + 2 * margin}
    return decode_png(browser.screenshot(loaded, clip=clip))


def narrated(name: str) -> Narration:
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    assert tr.oracle is not None
    return narrate(f"{name}.jsonl", tr.target, ",".join(tr.oracle), tr.config, tr.ops, get_factory(tr.target),
                   tr.oracle, tr.finding)


def check_clean_load(loaded: PageLoad, path: Path) -> None:
    assert loaded.log.errors() == []
    assert loaded.log.requests == [path.resolve().as_uri()]  # nothing fetched but the page itself


def test_the_violating_cell_is_drawn_highlighted(browser: Browser, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "vllm-fixme.html"
    assert main(["replay", str(TRACES / "vllm-fixme.jsonl"), "--html", str(path)]) == 1
    capsys.readouterr()
    loaded = browser.open(path)
    check_clean_load(loaded, path)
    width, height, cells = browser.evaluate(loaded, TIMELINE_JS)
    assert width > 300 and height > 150 and cells > 50
    violating = json.loads(browser.evaluate(loaded, CELLS_JS))
    assert len(violating) == 1 and "r3 g0 p1" in violating[0]["tip"]
    assert violating[0]["stroke"] == "rgb({}, {}, {})".format(*hex_rgb(HIGHLIGHT))
    cell = violating[0]
    drawn = shot(browser, loaded, cell, margin=2)  # the outline is centred on the box's edge
    assert count_near(drawn, HIGHLIGHT) >= 2 * (cell["w"] + cell["h"])  # the outline, all round
    assert count_near(drawn, CELL_FILL[LOST]) > 0  # the hole's own colour inside it
    left = shot(browser, loaded, cell, dx=-(cell["w"] + 2))  # r3 g0 p0, in flight: not involved
    assert count_near(left, HIGHLIGHT) == 0
    print(f"vllm-fixme page: load event after {loaded.seconds:.3f} s")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_bug_page_opens_cleanly(browser: Browser, tmp_path: Path, name: str) -> None:
    n = narrated(name)
    path = page.write_page(n, tmp_path / f"{name}.html")
    loaded = browser.open(path)
    check_clean_load(loaded, path)
    finding = n.stories[-1].finding
    assert finding is not None
    violating = json.loads(browser.evaluate(loaded, CELLS_JS))
    assert len(violating) == len(finding.positions)
    assert all(c["w"] > 0 and c["h"] > 0 for c in violating)


def padded_fixme() -> tuple[OffloadConfig, list[dict[str, object]], tuple[str, ...]]:
    """vllm-fixme after ~10,000 operations of requests that arrive and finish at once (they touch
    no block, so the finding is the same, at the last operation)."""
    tr = trace_io.read(TRACES / "vllm-fixme.jsonl")
    pad: list[dict[str, object]] = [{"op": "add", "rid": "pad", "family": 9, "prompt_len": 16}]
    for i in range((LARGE_TRACE_OPS - len(tr.ops) - 1) // 2):
        pad += [{"op": "add", "rid": f"pad{i}", "family": 9, "prompt_len": 16}, {"op": "finish", "rid": f"pad{i}"}]
    assert tr.oracle is not None
    return tr.config, pad + tr.ops, tr.oracle


def open_large(browser: Browser, n: Narration, path: Path) -> PageLoad:
    page.write_page(n, path)
    start = time.monotonic()
    loaded = browser.open(path)
    seconds = time.monotonic() - start
    check_clean_load(loaded, path)
    paint = browser.evaluate(loaded, "performance.getEntriesByName('first-contentful-paint')"
                                     ".map(e => e.startTime)[0] || null")
    print(f"{path.name}: {path.stat().st_size / 1e6:.1f} MB, opened (load event) in {seconds:.2f} s, "
          f"first contentful paint at {paint} ms")
    assert seconds < OPEN_SECONDS
    return loaded


@pytest.mark.slow
def test_a_ten_thousand_operation_page_opens_quickly_and_folds(browser: Browser, tmp_path: Path) -> None:
    config, ops, oracle = padded_fixme()
    n = narrate("padded", "bug:vllm-fixme", "C1", config, ops, get_factory("bug:vllm-fixme"), oracle)
    assert len(n.stories) == LARGE_TRACE_OPS and n.stories[-1].finding is not None
    loaded = open_large(browser, n, tmp_path / "padded.html")
    folded, shown = browser.evaluate(loaded, "[document.querySelectorAll('details article').length, "
                                             "document.querySelectorAll('body > article').length]")
    assert (folded, shown) == (LARGE_TRACE_OPS - page.OPEN_BEFORE - 1, page.OPEN_BEFORE + 1)
    assert len(json.loads(browser.evaluate(loaded, CELLS_JS))) == 1
    busy = OffloadConfig(policy="baseline", groups=(KVGroup(), KVGroup("sliding", sliding_window=32)))
    random_trace = random_ops(busy, random.Random(7), LARGE_TRACE_OPS)
    n = narrate("random", "model", "claims", busy, random_trace, get_factory("model"), default_oracle(busy))
    assert n.outcome.kind is None and len(n.stories) == LARGE_TRACE_OPS
    open_large(browser, n, tmp_path / "random.html")
