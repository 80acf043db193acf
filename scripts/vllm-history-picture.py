"""Draw docs/vllm-history.svg: each kept finding of ``kvspec history`` (a row: the release it was
found in, its invariant or exception, its attribution) replayed on every vLLM release (a column),
read from docs/vllm-history-matrix.json (written by scripts/vllm-history-matrix.py). Red: the trace
ends in its finding on that release; light: it runs clean; grey: it does not apply there (the
release cannot build the configuration, or its state left what the trace needs); a black frame:
the release whose search found it. Rows are grouped by attribution.

    .venv/bin/python scripts/vllm-history-picture.py
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ("0.19.1", "0.23.0", "0.29.0", "0.31.0", "0.33.0")
FILL = {"-": "#ecf0f1", "n/a": "#bdc3c7"}


def main() -> None:
    rows = [json.loads(line) for line in (ROOT / "docs" / "vllm-history-matrix.json").read_text().splitlines()]
    rows.sort(key=lambda r: (r["issue"].split(" (")[0], RELEASES.index(r["release"]), r["finding"]))
    w, h, left, top = 80, 22, 430, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w * len(RELEASES) + 20}" '
           f'height="{top + h * len(rows) + 20}" font-family="sans-serif" font-size="12">']
    for j, v in enumerate(RELEASES):
        out.append(f'<text x="{left + j * w + w / 2}" y="{top - 12}" text-anchor="middle">{v}</text>')
    for i, r in enumerate(rows):
        y = top + i * h
        label = f'{r["issue"].split(" (")[0]}: {r["finding"]} found in {r["release"]}'
        out.append(f'<text x="{left - 10}" y="{y + h / 2 + 4}" text-anchor="end">{escape(label)}</text>')
        for j, v in enumerate(RELEASES):
            cell = r["cells"].get(v, "n/a")
            fill = FILL.get(cell, "#c0392b")
            frame = ' stroke="#000" stroke-width="2"' if v == r["release"] else ""
            out.append(f'<rect x="{left + j * w + 4}" y="{y + 2}" width="{w - 8}" height="{h - 4}" '
                       f'fill="{fill}"{frame}><title>{escape(cell)}</title></rect>')
    out.append("</svg>")
    (ROOT / "docs" / "vllm-history.svg").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
