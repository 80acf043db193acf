"""Draw docs/vllm-history.svg: which finding (row) the fuzzer found in which vLLM release (column),
read from the shrunk traces kept under tests/traces/vllm_history/<version>/.

    .venv/bin/python scripts/vllm-history-picture.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ("0.19.1", "0.23.0", "0.29.0", "0.31.0", "0.33.0")


def findings() -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for v in RELEASES:
        for path in sorted((ROOT / "tests" / "traces" / "vllm_history" / v).glob("*.jsonl")):
            f = json.loads(path.read_text().splitlines()[0])["finding"]
            name = f["invariant"] or f["exception"]
            seen.setdefault(name, set()).add(v)
    return seen


def main() -> None:
    seen = findings()
    rows = sorted(seen, key=lambda n: (-len(seen[n]), n))
    w, h, left, top = 90, 26, 150, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w * len(RELEASES) + 20}" '
           f'height="{top + h * len(rows) + 20}" font-family="sans-serif" font-size="13">']
    for j, v in enumerate(RELEASES):
        out.append(f'<text x="{left + j * w + w / 2}" y="{top - 12}" text-anchor="middle">{v}</text>')
    for i, name in enumerate(rows):
        y = top + i * h
        out.append(f'<text x="{left - 10}" y="{y + h / 2 + 5}" text-anchor="end">{name}</text>')
        for j, v in enumerate(RELEASES):
            fill = "#c0392b" if v in seen[name] else "#ecf0f1"
            out.append(f'<rect x="{left + j * w + 4}" y="{y + 3}" width="{w - 8}" height="{h - 6}" fill="{fill}"/>')
    out.append("</svg>")
    (ROOT / "docs" / "vllm-history.svg").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
