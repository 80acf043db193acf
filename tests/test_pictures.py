"""scripts/make_pictures.py: the SPEC pictures come from real model runs, drawn by kvspec.report's
renderer, and are up to date."""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

from kvspec.report.positions import LOST, RECORDED

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "make_pictures.py"
SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def pictures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_pictures", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_pictures"] = mod
    spec.loader.exec_module(mod)
    return mod


def _texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG_NS}svg"
    return [t.text or "" for t in root.iter(f"{SVG_NS}text")]


def test_script_writes_both_files(pictures: ModuleType, tmp_path: Path) -> None:
    assert pictures.main(["--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["cpu_lru_t2.svg", "cursor_t2_policies.svg"]
    for p in tmp_path.iterdir():
        assert _texts(p.read_text(encoding="utf-8"))  # well-formed SVG with text in it


def test_committed_pictures_are_current(pictures: ModuleType) -> None:
    for name, text in pictures.pictures().items():
        committed = ROOT / "specs" / "pictures" / name
        assert committed.read_text(encoding="utf-8") == text, (
            f"specs/pictures/{name} is stale: run scripts/make_pictures.py")


def test_lru_picture_shows_the_t2_eviction(pictures: ModuleType) -> None:
    frames = pictures.lru_frames()
    after_first = frames[2]  # store event 0 completed: hashed blocks at the tail in event order
    assert [lab for _, lab in after_first.queue] == ["H1", "H2", "H3", "H4"]
    evicting = frames[3]
    assert evicting.evicted == {1, 2} and [b for b, _ in evicting.queue] == [3, 4]
    assert [lab for _, lab in frames[4].queue] == ["H3", "H4", "H5", "H6"]
    assert "evicted: H1 (c1), H2 (c2)" in _texts(pictures.draw_lru(frames))


def test_cursor_picture_tells_the_three_policies_apart(pictures: ModuleType) -> None:
    base = pictures.cursor_rows("baseline")
    assert base[-1].cells[:2] == (LOST, LOST) and base[-1].reachable == 0 and base[-1].cursor == 6
    rescan = [row.reachable for row in pictures.cursor_rows("signal-rescan")[1:]]
    assert rescan == [0, 2, 4, 0, 2, 4]  # H6: the thrash cycle, period 3
    repair = pictures.cursor_rows("repair")
    reach = [row.reachable for row in repair]
    # the new blocks' own allocation evicts H1, H2 (R6: new work first); from then on re-stores never
    # lower the reachable prefix (R7) and it grows to the pool's capacity
    assert reach[:2] == [4, 1] and reach[1:] == sorted(reach[1:]) and reach[-1] == 4
    assert LOST not in repair[-1].cells and repair[-1].cells[4:] == (RECORDED, RECORDED)
