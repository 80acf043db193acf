#!/usr/bin/env python3
"""Draw the pictures of specs/SPEC.md from real runs of the executable model.

Nothing is drawn by hand: each picture runs the engine model (``kvspec.drivers.engine``)
on a fixed operation sequence, takes snapshots, and renders what they contain as SVG
text with the renderer finding pages use (``kvspec.report.svg``: cells, cursor bars and
legends; ``kvspec.report.positions``: what each position is). The output is deterministic, so
the committed files can be compared with a fresh run (tests/test_pictures.py).

Pictures:

* ``cpu_lru_t2.svg``: the CPU free queue (head = least recently used = evicted first)
  and the blocks in use, after each operation of the worked trace T2 under
  ``baseline``: store planned, store completed (blocks join the tail, hashed), a later
  allocation pops the head and evicts its entries.
* ``cursor_t2_policies.svg``: the request of T2 position by position (cached on CPU,
  being stored, lost below the cursor, lost and recorded for repair, not yet
  scanned) with its cursor, after every step and store completion, under the three
  re-store policies: ``baseline`` keeps the hole, ``signal-rescan`` thrashes (H6),
  ``repair`` restores the longest prefix that fits and stops.

Usage: ``scripts/make_pictures.py [--out DIR]`` (default: specs/pictures beside this
repository's specs/SPEC.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.contract.config import OffloadConfig
from kvspec.drivers.engine import Engine
from kvspec.model import make_scheduler
from kvspec.report.positions import CPU, EMPTY, GPU, LOST, RECORDED, STORING, SnapshotView
from kvspec.report.svg import CELL_FILL, CellBox, Svg, draw_lane, draw_legend

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "specs" / "pictures"

# T2 (docs/vllm-semantics.md §8): B=16, GPU 16 blocks, CPU 5 blocks (4 usable); R has 6 full
# blocks + 1 token, prefilled 64 tokens per step, then decodes.
T2_CONFIG = {"block_size": 16, "num_gpu_blocks": 16, "num_cpu_blocks": 5, "async_scheduling": False}
T2_PREFIX: list[dict[str, Any]] = [
    {"op": "add", "rid": "R", "family": 1, "prompt_len": 97, "max_tokens": 40},
    {"op": "step", "admit": ["R"], "chunk": 64},
    {"op": "step", "chunk": 64},
    {"op": "report", "event": 0},
]
DECODE_STEPS = 6

CURSOR_BOX = CellBox(36, 24, 4)  # the cursor picture's cells: 36 x 24, 4 apart
LRU_MEANINGS = {CPU: "hashed, in the prefix map", EMPTY: "unhashed", STORING: "store destination"}


# -- running the model -----------------------------------------------------------------------


def t2_engine(policy: str) -> Engine:
    return Engine(make_scheduler(OffloadConfig(policy=policy, **T2_CONFIG)))


def key_labels(snap: dict[str, Any], rid: str = "R") -> dict[str, str]:
    """Cache key -> "H<p+1>" for the request's positions (the doc's names)."""
    hashes = snap["engine"]["requests"][rid]["block_hashes"]
    return {f"{h}:0": f"H{p + 1}" for p, h in enumerate(hashes)}


def describe_op(op: dict[str, Any], before: dict[str, Any], after: dict[str, Any],
                labels: dict[str, str]) -> list[str]:
    """What an operation did to the CPU pool, read off the snapshots."""
    lines: list[str] = []
    name = op["op"]
    if name == "step":
        events = set(after["scheduler"]["store_events"]) - set(before["scheduler"]["store_events"])
        lines.append(f"step {after['engine']['step']} (build_connector_meta)")
        for e in sorted(events, key=int):
            t = after["scheduler"]["store_events"][e]
            lines.append(f"store event {e} planned: GPU {t['gpu']} -> CPU {t['cpu']}")
    elif name == "report":
        lines.append(f"store event {op['event']} completed (update_connector_output)")
    else:
        lines.append(name)
    lost = [k for k in before["cpu_pool"]["cached"] if k not in after["cpu_pool"]["cached"]]
    if lost:
        evicted = ", ".join(f"{labels.get(k, k[:6])} (c{before['cpu_pool']['cached'][k][0]})" for k in lost)
        lines.append(f"evicted: {evicted}")
    return lines


# -- picture (a): the CPU free queue ---------------------------------------------------------


@dataclass
class LruFrame:
    caption: list[str]
    queue: list[tuple[int, str]]  # (block, key label or "")
    in_use: list[tuple[int, int, str]]  # (block, ref, key label or "")
    evicted: set[int]  # CPU blocks whose cached entry this operation evicted


def lru_frames() -> list[LruFrame]:
    eng = t2_engine("baseline")
    ops = [*T2_PREFIX, {"op": "step"}, {"op": "report", "event": 1}]
    frames: list[LruFrame] = []
    before = None
    prev_cached: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        eng.apply(op)
        snap = eng.snapshot()
        labels = key_labels(snap) if "R" in snap["engine"]["requests"] else {}
        if i == 0:
            caption = ["initial: the 4 usable CPU blocks, unhashed, in id order"]
        else:
            assert before is not None
            caption = describe_op(op, before, snap, labels)
        before = snap
        if i == 1:  # the prefill step stores nothing (tokens are confirmed one step late)
            continue
        cpu = snap["cpu_pool"]
        lab = [labels.get(k, "") if k else "" for k in cpu["block_hash"]]
        evicted = {ids[0] for k, ids in prev_cached.items() if k not in cpu["cached"]}
        prev_cached = cpu["cached"]
        frames.append(LruFrame(
            caption,
            [(b, lab[b]) for b in cpu["free_queue"]],
            [(b, cpu["ref_cnt"][b], lab[b]) for b in range(1, cpu["num_blocks"]) if cpu["ref_cnt"][b] > 0],
            evicted,
        ))
    return frames


def draw_lru(frames: list[LruFrame]) -> str:
    svg = Svg()
    svg.text(10, 22, "CPU free queue (LRU order) in trace T2 under baseline: store, completion, eviction",
             14, weight="bold")
    svg.text(10, 42, "free queue: head = least recently used = next popped by get_new_blocks, "
             "its cached entry evicted; completions append at the tail", 11)
    y = 62
    bw, bh = 56, 34
    qx, ux = 20, 420
    for f in frames:
        for k, line in enumerate(f.caption):
            svg.text(10, y + 12 + 15 * k, line, 12, weight="bold" if k == 0 else "normal")
        y += 15 * len(f.caption) + 8
        svg.text(qx, y + 10, "free queue: head ->", 10)
        svg.text(ux, y + 10, "in use (ref >= 1, not in the queue)", 10)
        by = y + 16
        for j, (b, lab) in enumerate(f.queue):
            x = qx + j * (bw + 6)
            svg.rect(x, by, bw, bh, CELL_FILL[CPU] if lab else CELL_FILL[EMPTY])
            svg.text(x + bw / 2, by + 14, f"c{b}", 12, "middle", "bold")
            svg.text(x + bw / 2, by + 28, lab or "-", 11, "middle")
        if not f.queue:
            svg.text(qx, by + 22, "(empty)", 11)
        else:
            svg.text(qx + len(f.queue) * (bw + 6), by + 22, "<- tail (MRU)", 10)
        for j, (b, ref, lab) in enumerate(f.in_use):
            x = ux + j * (bw + 6)
            svg.rect(x, by, bw, bh, CELL_FILL[STORING], *((CELL_FILL[LOST], 3) if b in f.evicted else ()))
            svg.text(x + bw / 2, by + 14, f"c{b}", 12, "middle", "bold")
            svg.text(x + bw / 2, by + 28, f"ref {ref}" + (f" {lab}" if lab else ""), 10, "middle")
        y = by + bh + 22
        svg.line(10, y - 10, 700, y - 10, "#bbbbbb")
    draw_legend(svg, 10, y, [CPU, EMPTY, STORING], 230, LRU_MEANINGS)
    svg.rect(700, y, 14, 14, CELL_FILL[STORING], CELL_FILL[LOST], 3)
    svg.text(720, y + 12, "red outline: its entry was just evicted", 11)
    return svg.render("CPU free queue in trace T2 (baseline)")


# -- picture (b): the cursor and its hole ----------------------------------------------------


@dataclass
class CursorRow:
    caption: str
    cells: tuple[str, ...]  # per position, a kvspec.report.positions state
    cursor: int
    reachable: int


def cursor_row(snap: dict[str, Any], caption: str, rid: str = "R") -> CursorRow:
    """The request's group-0 lane (``kvspec.report.positions``) and the CPU prefix it could hit."""
    lane = SnapshotView(snap).lane(rid, 0)
    assert lane.cursor is not None  # R keeps live store state throughout T2
    reachable = 0
    while reachable < len(lane.cells) and lane.cells[reachable] == CPU:
        reachable += 1
    return CursorRow(caption, lane.cells, lane.cursor, reachable)


def cursor_rows(policy: str) -> list[CursorRow]:
    eng = t2_engine(policy)
    for op in T2_PREFIX:
        eng.apply(op)
    rows = [cursor_row(eng.snapshot(), f"step {eng.snapshot()['engine']['step']}: event 0 stored H1-H4, done")]
    for _ in range(DECODE_STEPS):
        meta = eng.apply({"op": "step"})
        step = eng.snapshot()["engine"]["step"]
        if meta.store_event < 0:
            rows.append(cursor_row(eng.snapshot(), f"step {step}: nothing to store"))
            continue
        eng.apply({"op": "report", "event": meta.store_event})
        rows.append(cursor_row(eng.snapshot(), f"step {step}: event {meta.store_event} stored GPU "
                                               f"{meta.store_gpu_blocks}, done"))
    return rows


def draw_cursor(panels: list[tuple[str, list[CursorRow]]]) -> str:
    svg = Svg()
    svg.text(10, 22, "Trace T2: request R position by position (H1..H6), its cursor, and the CPU prefix "
             "a new identical request could hit", 14, weight="bold")
    svg.text(10, 40, "CPU pool: 4 usable blocks, R has 6 full blocks; each step is followed by its store "
             "completion", 11)
    draw_legend(svg, 10, 52, [CPU, STORING, LOST], 260)
    draw_legend(svg, 10, 72, [RECORDED, GPU], 260)
    cw, ch, lx = CURSOR_BOX.pitch, CURSOR_BOX.height, 400
    y = 110
    for title, rows in panels:
        svg.text(10, y + 14, title, 13, weight="bold")
        y += 22
        for p in range(len(rows[0].cells)):
            svg.text(lx + p * cw + cw / 2, y + 10, f"H{p + 1}", 10, "middle")
        y += 16
        for row in rows:
            svg.text(10, y + 16, row.caption, 11)
            draw_lane(svg, lx, y, row.cells, row.cursor, CURSOR_BOX)
            svg.text(lx + len(row.cells) * cw + 10, y + 16,
                     f"cursor {row.cursor}; reachable prefix {row.reachable}", 11)
            y += ch + 8
        y += 12
    svg.text(10, y + 4, "thick bar = the cursor (num_stored_blocks): positions left of it are never "
             "scanned again by baseline", 11)
    return svg.render("Trace T2 under baseline, signal-rescan and repair")


# -- main ------------------------------------------------------------------------------------

PANEL_TITLES = {
    "baseline": "baseline (vLLM 0.33.0): H1, H2 evicted below the cursor, never stored again (the FIXME)",
    "signal-rescan": "signal-rescan (PR #47235): every re-store evicts the next-oldest blocks (H6, period 3)",
    "repair": "repair (kvspec): lost records re-stored without evicting reachable entries (R1, R7, R8)",
}


def pictures() -> dict[str, str]:
    """File name -> SVG text."""
    return {
        "cpu_lru_t2.svg": draw_lru(lru_frames()),
        "cursor_t2_policies.svg": draw_cursor([(PANEL_TITLES[p], cursor_rows(p)) for p in PANEL_TITLES]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default specs/pictures)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in pictures().items():
        (args.out / name).write_text(text, encoding="utf-8")
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
