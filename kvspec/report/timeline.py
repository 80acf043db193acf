"""The timeline picture of a narrated replay: one row per operation, one lane per (request, group).

Each row shows, after its operation, every listed request's positions per KV group as cells
(``kvspec.report.positions`` states, drawn by ``kvspec.report.svg.draw_lane``), the store cursor
as a thick bar, the positions whose CPU entry that operation evicted crossed out, and, on the row
of the finding, the positions the violation involves outlined (CSS class ``violating``; the row's
band has the class ``finding-row``). Every cell carries a tooltip naming its operation, position,
GPU block, key and state. Columns are the lanes that appear in any drawn row, in order of first
appearance; a lane is as wide as its longest row. Drawing is O(rows x lanes x positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvspec.report.narrate import Story
from kvspec.report.positions import STATES, Lane, Position
from kvspec.report.svg import (
    CELL_MEANING,
    CHAR_WIDTH,
    CURSOR,
    CURSOR_WIDTH,
    EVICTED_MARK,
    HIGHLIGHT,
    HIGHLIGHT_WIDTH,
    CellBox,
    LaneMarks,
    Svg,
    draw_lane,
    draw_legend,
)

BOX = CellBox(14, 16, 2)
ROW_HEIGHT = 24
LANE_GAP = 16
LABEL_SIZE = 10
LABEL_CHARS = 44  # row labels are cut to this many characters
LEGEND_SPACING = 250
LEGEND_PER_ROW = 4
FINDING_BAND = "#fde0ef"
LEFT = 10

LaneId = tuple[str, int]


@dataclass(frozen=True)
class Column:
    """One lane's place in the picture: its (request, group), left edge and number of positions."""

    lane: LaneId
    x: float
    positions: int


def _columns(stories: Sequence[Story], x0: float) -> list[Column]:
    """The lanes of every drawn row, in order of first appearance, laid out left to right."""
    widths: dict[LaneId, int] = {}
    for story in stories:
        for r in story.requests:
            for lane in r.lanes:
                key = (lane.rid, lane.group)
                widths[key] = max(widths.get(key, 0), len(lane.cells))
    columns, x = [], x0
    for key, n in widths.items():
        if n == 0:
            continue
        columns.append(Column(key, x, n))
        title = len(f"{key[0]} g{key[1]}") * LABEL_SIZE * CHAR_WIDTH
        x += max(n * BOX.pitch, title) + LANE_GAP
    return columns


def _tip(story: Story, lane: Lane, p: int, evicted: bool, violating: bool) -> str:
    block = lane.blocks[p]
    text = (f"#{story.index} {Position(lane.rid, lane.group, p)}: {CELL_MEANING[lane.cells[p]]}; "
            f"GPU block {block if block is not None else '-'}; key {lane.keys[p]}")
    if lane.cursor is not None:
        text += f"; cursor {lane.cursor}"
    if evicted:
        text += "; its CPU entry was evicted by this operation"
    if violating:
        text += "; involved in the finding"
    return text


def _draw_row(svg: Svg, story: Story, columns: list[Column], y: float) -> None:
    lanes = {(lane.rid, lane.group): lane for r in story.requests for lane in r.lanes}
    violating = story.finding.positions if story.finding is not None else frozenset()
    for col in columns:
        lane = lanes.get(col.lane)
        if lane is None:
            continue
        positions = range(len(lane.cells))
        evicted = {p for p in positions if Position(lane.rid, lane.group, p) in story.evicted}
        bad = {p for p in positions if Position(lane.rid, lane.group, p) in violating}
        tips = [_tip(story, lane, p, p in evicted, p in bad) for p in positions]
        draw_lane(svg, col.x, y, lane.cells, lane.cursor, BOX, LaneMarks(evicted, bad, tips))


def _legend(svg: Svg, y: float) -> float:
    """The cell states in rows of ``LEGEND_PER_ROW``, then the marks; returns the y below it."""
    for start in range(0, len(STATES), LEGEND_PER_ROW):
        draw_legend(svg, LEFT, y, STATES[start:start + LEGEND_PER_ROW], LEGEND_SPACING)
        y += 20
    svg.line(LEFT + 7, y - 2, LEFT + 7, y + 16, CURSOR, CURSOR_WIDTH)
    svg.text(LEFT + 18, y + 12, "store cursor (num_stored_blocks)", 11)
    x = LEFT + LEGEND_SPACING
    svg.rect(x, y, 14, 14, "#ffffff")
    svg.line(x + 2, y + 2, x + 12, y + 12, EVICTED_MARK, 2)
    svg.line(x + 12, y + 2, x + 2, y + 12, EVICTED_MARK, 2)
    svg.text(x + 18, y + 12, "CPU entry evicted by the operation", 11)
    x += LEGEND_SPACING
    svg.rect(x, y, 14, 14, "#ffffff", HIGHLIGHT, HIGHLIGHT_WIDTH)
    svg.text(x + 18, y + 12, "involved in the finding", 11)
    return y + 30


def draw_timeline(stories: Sequence[Story], title: str) -> str:
    """The timeline SVG of ``stories`` (already chosen: the page draws a window of them)."""
    svg = Svg()
    svg.text(LEFT, 20, title, 13, weight="bold")
    y = _legend(svg, 34)
    x0 = LEFT + LABEL_CHARS * LABEL_SIZE * CHAR_WIDTH + 12
    columns = _columns(stories, x0)
    for col in columns:
        svg.text(col.x, y + 10, f"{col.lane[0]} g{col.lane[1]}", LABEL_SIZE, weight="bold")
        for p in range(col.positions):
            svg.text(col.x + p * BOX.pitch + BOX.width / 2, y + 22, str(p), 8, "middle")
    y += 32
    right = max((c.x + c.positions * BOX.pitch for c in columns), default=x0)
    for story in stories:
        if story.finding is not None:
            svg.rect(LEFT - 4, y - 4, right - LEFT + 8, ROW_HEIGHT, FINDING_BAND, FINDING_BAND,
                     css_class="finding-row")
        label = f"#{story.index} {story.headline}"
        label = label if len(label) <= LABEL_CHARS else label[:LABEL_CHARS - 1] + "…"
        svg.text(LEFT, y + 11, label, LABEL_SIZE, fill="#777777" if story.rejected else "#000000")
        _draw_row(svg, story, columns, y)
        y += ROW_HEIGHT
    return svg.render(title, "timeline")
