"""The finding page: one self-contained HTML file with the narration and the timeline picture.

The page has no scripts, no fonts, no style sheets or images from anywhere (everything is inline:
CSS in a ``<style>`` element, the picture as inline SVG), so it opens offline and the same in any
browser. It shows, top to bottom: the verdict (the replay's one line, whether it reproduces the
finding the trace recorded, the target, oracle and configuration); the finding (the invariant's
rule in words, and every block, key, event and request involved); the timeline
(``kvspec.report.timeline``); and the operations, one article each.

Large traces stay readable and quick to open: a trace of at most ``OPEN_LIMIT`` operations is shown
whole; a longer one shows the ``OPEN_BEFORE`` operations before the finding (or before the end of
a clean run) and the finding's own, open and drawn in the timeline, while every earlier operation
is folded into ``<details>`` sections of ``FOLD_CHUNK`` operations, each in a compact form (headline
and events, no request tables). Rendering is O(operations + drawn cells).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from kvspec.adapters.targets import TargetFactory
from kvspec.drivers.harness import default_oracle
from kvspec.drivers.trace import Trace
from kvspec.report.narrate import Narration, Story, narrate
from kvspec.report.timeline import draw_timeline

OPEN_LIMIT = 80
OPEN_BEFORE = 30
FOLD_CHUNK = 500

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #111; max-width: 100em; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; } h3 { font-size: 1em; margin: 0; }
code, .mono, pre { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 0.9em; }
.verdict { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; background: #f6f6f6; padding: .6em; }
.finding { border: 3px solid #c51b7d; background: #fdf2f8; padding: .6em 1em; }
.finding li, .op li { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: .85em; }
.scroll { overflow: auto; max-height: 80vh; border: 1px solid #ddd; }
.op { border-top: 1px solid #ddd; padding: .4em 0; }
.op.finding-op { border-left: 6px solid #c51b7d; padding-left: .6em; background: #fdf2f8; }
.op.rejected h3 { color: #777; }
.op ul { margin: .3em 0; } details { margin: .4em 0; } summary { cursor: pointer; }
table { border-collapse: collapse; font-size: .85em; }
td, th { border: 1px solid #ddd; padding: .1em .5em; text-align: left; vertical-align: top; }
td.mono { white-space: nowrap; }
"""


def _config_text(config: dict[str, Any]) -> str:
    groups = ", ".join(g["kind"] + (f" (window {g['sliding_window']})" if g["kind"] == "sliding" else "")
                       for g in config["groups"])
    return (f"policy {config['policy']}{' (lazy)' if config['lazy_offload'] else ''}; block size "
            f"{config['block_size']}; {config['num_gpu_blocks']} GPU blocks, {config['num_cpu_blocks']} CPU "
            f"blocks (block 0 is the null block); groups: {groups}; world size {config['world_size']}")


def _verdict(n: Narration) -> str:
    reproduced = {None: "no finding recorded in the trace header", True: "reproduces the recorded finding",
                  False: f"does NOT reproduce the recorded finding {escape(str(n.recorded))}"}[n.reproduces]
    return (f"<p class=\"verdict\">{escape(n.outcome.describe())}</p>\n"
            f"<p>{reproduced}. Trace <code>{escape(n.trace)}</code>, target <code>{escape(n.target)}</code>, "
            f"oracle <code>{escape(n.oracle)}</code>.<br>{escape(_config_text(n.config))}</p>")


def _finding(n: Narration) -> str:
    last = n.stories[-1] if n.stories else None
    if last is None or last.finding is None:
        return "<p>No finding: every operation was judged clean.</p>" if n.outcome.kind is None else ""
    f = last.finding
    rule = f"<b>{escape(f.invariant)} ({escape(f.title)})</b>: " if f.invariant else f"<b>{escape(f.kind)}</b>: "
    items = "\n".join(f"<li>{escape(d)}</li>" for d in f.details)
    return (f"<section class=\"finding\" id=\"finding\"><h2>The finding, at <a href=\"#op-{last.index}\">"
            f"operation {last.index}</a></h2>\n<p>{rule}{escape(f.rule)}</p>\n<ul>\n{items}\n</ul></section>")


def _requests_table(story: Story) -> str:
    rows = []
    for r in story.requests:
        rows.append(f"<tr><td class=\"mono\">{escape(r.rid)}</td><td>{escape(r.status)}</td>"
                    f"<td>{r.computed}/{r.tokens}</td><td class=\"mono\">{escape(r.groups_text())}"
                    "</td></tr>")
    if not rows:
        return ""
    return ("<table><tr><th>request</th><th>status</th><th>computed/tokens</th><th>per group after the "
            "operation</th></tr>\n" + "\n".join(rows) + "</table>")


def _article(story: Story, compact: bool) -> str:
    classes = "op" + (" finding-op" if story.finding is not None else "") + (" rejected" if story.rejected else "")
    events = "".join(f"<li>{escape(e)}</li>" for e in story.events)
    body = f"<ul>{events}</ul>" if events else ""
    if not compact:
        body += _requests_table(story)
    if story.finding is not None:
        body += (f"<p><b>finding ({escape(story.finding.kind)})</b>: {escape(story.finding.summary)} "
                 "(<a href=\"#finding\">rule and details</a>)</p>")
    return (f"<article class=\"{classes}\" id=\"op-{story.index}\"><h3>#{story.index} "
            f"<code>{escape(story.headline)}</code></h3>{body}</article>")


def split(stories: Sequence[Story]) -> tuple[Sequence[Story], Sequence[Story]]:
    """(folded, shown): all shown up to ``OPEN_LIMIT`` stories, else the last ``OPEN_BEFORE + 1``
    (the finding, or the end, and the operations before it) shown and the rest folded."""
    if len(stories) <= OPEN_LIMIT:
        return (), stories
    cut = len(stories) - OPEN_BEFORE - 1
    return stories[:cut], stories[cut:]


def _folded(stories: Sequence[Story]) -> Iterable[str]:
    for start in range(0, len(stories), FOLD_CHUNK):
        chunk = stories[start:start + FOLD_CHUNK]
        yield (f"<details><summary>operations {chunk[0].index}-{chunk[-1].index} ({len(chunk)} operations, "
               "folded; open to read)</summary>")
        yield from (_article(s, compact=True) for s in chunk)
        yield "</details>"


def _timeline(n: Narration, shown: Sequence[Story]) -> str:
    if not shown:
        return "<p>No operation ran, so there is nothing to draw.</p>"
    scope = (f"operations {shown[0].index}-{shown[-1].index} of {len(n.stories)}" if len(shown) < len(n.stories)
             else f"all {len(n.stories)} operations")
    title = f"Timeline: {scope}, each request's positions after each operation"
    return (f"<p>One row per operation, one lane per request and KV group (<code>r3 g0</code>); each cell is "
            f"a block position, left to right. Hover over a cell for its block, key and state.</p>\n"
            f"<div class=\"scroll\">\n{draw_timeline(shown, title)}</div>")


def _title(n: Narration) -> str:
    """``kvspec finding C1 (completeness) at operation 6: vllm-fixme.jsonl``, or the clean run's."""
    last = n.stories[-1] if n.stories else None
    if last is None or last.finding is None:
        return f"kvspec replay of {n.trace}: {n.outcome.describe()}"
    f = last.finding
    what = f"{f.invariant} ({f.title})" if f.invariant else f.kind
    return f"kvspec finding {what} at operation {last.index}: {n.trace}"


def render_page(n: Narration) -> str:
    """The whole page as text (module docstring: its parts)."""
    folded, shown = split(n.stories)
    title = _title(n)
    parts = [
        "<!DOCTYPE html>", "<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>", _verdict(n), _finding(n),
        "<h2 id=\"timeline-heading\">Timeline</h2>", _timeline(n, shown),
        "<h2>Operations, as the engine saw them</h2>",
        "<p>Positions are written <code>r3 g0 p1</code>: request r3, KV group 0, position 1 (its second full "
        "block). A <i>hole</i> is a position below the store cursor whose key is neither cached on CPU nor "
        "being stored.</p>",
    ]
    if folded:
        parts.append(f"<p>{len(folded)} earlier operations are folded; the {len(shown)} last are shown.</p>")
    parts += list(_folded(folded))
    parts += [_article(s, compact=False) for s in shown]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_page(n: Narration, path: str | Path) -> Path:
    """Write the page of ``n`` to ``path``; ``OSError`` when it cannot be written."""
    out = Path(path)
    out.write_text(render_page(n), encoding="utf-8")
    return out


def page_for_trace(trace: Trace, trace_path: str | Path, factory: TargetFactory) -> Path:
    """Narrate a saved finding trace on ``factory`` under the oracle its header recorded (the claims
    of its policy when none is recorded) and write its page next to it: the same name, ``.html``."""
    oracle = trace.oracle if trace.oracle is not None else default_oracle(trace.config)
    path = Path(trace_path)
    n = narrate(path.name, trace.target, ",".join(oracle), trace.config, trace.ops, factory, tuple(oracle),
                trace.finding)
    return write_page(n, path.with_suffix(".html"))
