"""SVG text and the position-cell renderer shared by finding pages and the SPEC's pictures.

``Svg`` writes SVG elements as text (no plotting dependency; the output is deterministic, so a
committed picture can be compared with a fresh run). ``draw_lane`` draws one lane of position
cells (``kvspec.report.positions``) with the store cursor as a thick bar, CPU evictions as a
cross and violating positions with a thick outline; ``draw_legend`` explains the cells. The
colours and their meanings live here once, for every picture.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from kvspec.report.positions import CPU, EMPTY, GPU, LOST, NULL, RECORDED, STORING

FONT = "font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\""
CHAR_WIDTH = 0.62  # average glyph width of the monospace font, in units of the font size
MARGIN = 10  # blank space kept right of and below the last element

CELL_FILL = {
    CPU: "#7fc97f",
    STORING: "#80b1d3",
    LOST: "#e41a1c",
    RECORDED: "#fdb462",
    GPU: "#eeeeee",
    NULL: "#9e9e9e",
    EMPTY: "#ffffff",
}
CELL_MEANING = {
    GPU: "on GPU only (at/after the cursor)",
    CPU: "stored on CPU",
    STORING: "in flight (being stored)",
    LOST: "lost below the cursor",
    RECORDED: "lost, recorded for repair",
    NULL: "null block / left the window",
    EMPTY: "no block held",
}
OUTLINE = "#333333"
CURSOR = "#000000"
EVICTED_MARK = "#000000"
HIGHLIGHT = "#c51b7d"  # violating cells: a colour no cell state uses
HIGHLIGHT_WIDTH = 3
CURSOR_WIDTH = 3
CURSOR_OVERHANG = 3  # the cursor bar reaches this far above and below its cells


class Svg:
    """An SVG document built element by element; it grows to fit what is drawn."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.width = 0
        self.height = 0

    def _grow(self, x: float, y: float) -> None:
        self.width = max(self.width, int(x) + MARGIN)
        self.height = max(self.height, int(y) + MARGIN)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str = OUTLINE,
             stroke_width: float = 1, css_class: str = "", tip: str = "") -> None:
        """A rectangle; ``css_class`` names it for a page's style and tests, ``tip`` is its tooltip."""
        cls = f" class={quoteattr(css_class)}" if css_class else ""
        head = (f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" stroke="{stroke}" '
                f'stroke-width="{stroke_width}"{cls}')
        self.parts.append(f"{head}><title>{escape(tip)}</title></rect>" if tip else f"{head}/>")
        self._grow(x + w, y + h)

    def text(self, x: float, y: float, s: str, size: int = 12, anchor: str = "start", weight: str = "normal",
             fill: str = "#000000") -> None:
        self.parts.append(f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
                          f'font-weight="{weight}" fill="{fill}" {FONT}>{escape(s)}</text>')
        self._grow(x + (len(s) * size * CHAR_WIDTH if anchor == "start" else 0), y + 4)

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#000000", width: float = 1,
             css_class: str = "") -> None:
        cls = f" class={quoteattr(css_class)}" if css_class else ""
        self.parts.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{stroke}" '
                          f'stroke-width="{width}"{cls}/>')
        self._grow(max(x1, x2), max(y1, y2))

    def render(self, title: str, element_id: str = "") -> str:
        """The document; ``element_id`` gives the root element an id (for a page that inlines it)."""
        ident = f" id={quoteattr(element_id)}" if element_id else ""
        head = (f'<svg xmlns="http://www.w3.org/2000/svg"{ident} width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}">')
        return "\n".join([head, f"<title>{escape(title)}</title>",
                          f'<rect x="0" y="0" width="{self.width}" height="{self.height}" fill="#ffffff"/>',
                          *self.parts, "</svg>"]) + "\n"


@dataclass(frozen=True)
class CellBox:
    """The geometry of position cells: a cell is ``width`` x ``height``, cells are ``gap`` apart."""

    width: float
    height: float
    gap: float

    @property
    def pitch(self) -> float:
        """Distance from one cell's left edge to the next one's."""
        return self.width + self.gap


@dataclass(frozen=True)
class LaneMarks:
    """What a lane shows beyond its cells: positions whose CPU entry the operation evicted
    (crossed), violating positions (outlined), and one tooltip per position (empty: none)."""

    evicted: Collection[int] = ()
    violating: Collection[int] = ()
    tips: Sequence[str] = ()


NO_MARKS = LaneMarks()


def draw_lane(svg: Svg, x: float, y: float, cells: Sequence[str], cursor: int | None, box: CellBox,
              marks: LaneMarks = NO_MARKS) -> None:
    """Cells left to right from (x, y), then the cursor bar left of position ``cursor`` (none for
    None). Violating cells carry the CSS class ``violating``; evicted ones ``evicted``. O(cells)."""
    for p, state in enumerate(cells):
        cx = x + p * box.pitch
        tip = marks.tips[p] if p < len(marks.tips) else ""
        if p in marks.violating:
            svg.rect(cx, y, box.width, box.height, CELL_FILL[state], HIGHLIGHT, HIGHLIGHT_WIDTH,
                     f"cell {state} violating", tip)
        else:
            svg.rect(cx, y, box.width, box.height, CELL_FILL[state], css_class=f"cell {state}", tip=tip)
        if p in marks.evicted:
            svg.line(cx + 2, y + 2, cx + box.width - 2, y + box.height - 2, EVICTED_MARK, 2, "evicted")
            svg.line(cx + box.width - 2, y + 2, cx + 2, y + box.height - 2, EVICTED_MARK, 2, "evicted")
    if cursor is not None:
        bar = x + cursor * box.pitch - box.gap / 2
        svg.line(bar, y - CURSOR_OVERHANG, bar, y + box.height + CURSOR_OVERHANG, CURSOR, CURSOR_WIDTH, "cursor")


def draw_legend(svg: Svg, x: float, y: float, states: Sequence[str], spacing: float,
                meanings: dict[str, str] = CELL_MEANING) -> None:
    """One swatch and its meaning per state, ``spacing`` apart, from (x, y). O(states)."""
    for j, state in enumerate(states):
        svg.rect(x + j * spacing, y, 14, 14, CELL_FILL[state])
        svg.text(x + 18 + j * spacing, y + 12, meanings[state], 11)
