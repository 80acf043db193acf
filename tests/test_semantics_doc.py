"""Every section citation of docs/vllm-semantics.md resolves there; every relative Markdown link resolves.

A citation is the section sign followed by a number, ``§N`` or ``§N.M`` (a range ``§N.M-N.K`` cites
both ends). Which document it cites is decided per citation, by where it stands:

* **Python files** (``kvspec/``, ``model/``, ``impl/``, ``specs/``, ``tests/``, ``scripts/``): the code's
  convention is that section numbers refer to docs/vllm-semantics.md ("the note"), whether the line
  names it ("docs/vllm-semantics.md §N", "vLLM §N", "docs §N") or not (bare §N in a docstring). The
  one exception is a citation written right after ``SPEC`` or ``SPEC.md`` ("SPEC.md §N"), which cites
  specs/SPEC.md.
* **specs/SPEC.md** has §-numbered sections of its own, and a bare §N there means SPEC's own section
  (e.g. "(§N)" after a policy name means SPEC's section on re-store policies, "the format of §N" its
  snapshot-format section). A citation in SPEC cites the note only when
  (a) it is the text of a Markdown link into docs/vllm-semantics.md (the form SPEC uses), or
  (b) it is followed by "of the note" or "of the semantics note", or
  (c) it stands inside a generated region (between ``<!-- name:begin -->`` and ``<!-- name:end -->``):
  those are written by scripts/gen_spec.py from the code (e.g. a bug variant's source), so the code's
  convention applies.
  Every other citation in SPEC is checked against SPEC's own headings.
* **Other Markdown files**: like Python files (a citation after ``SPEC``/``SPEC.md`` cites SPEC; any
  other cites the note; docs/vllm-semantics.md citing itself included).

A citation resolves when the cited document has a heading that starts with that number ("## 7. …",
"### 7.12 …"). A § link into the note must also point, by its anchor, at the heading of the number it
shows. Separately, every relative link in a Markdown file must name an existing file, and an anchor
into a Markdown file must be one of that file's heading anchors (GitHub's slug rule).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTE = ROOT / "docs" / "vllm-semantics.md"
SPEC = ROOT / "specs" / "SPEC.md"
SOURCE_DIRS = ("kvspec", "model", "impl", "specs", "docs", "tests", "scripts")
SKIP_PARTS = {"__pycache__", "out", "fuzz-out", "build"}

SECTION_SIGN = "\u00a7"  # written as an escape so that this file's own code cites nothing
NUM = r"\d+(?:\.\d+)*"
CITATION = re.compile(rf"{SECTION_SIGN}\s?({NUM})(?:\s?[-\u2013]\s?({NUM}))?")
HEADING = re.compile(rf"^#{{1,6}}\s+{SECTION_SIGN}?({NUM})\.?(?:\s|$)", re.MULTILINE)
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REGION = re.compile(r"<!-- (\S+):begin -->.*?<!-- \1:end -->", re.DOTALL)
OF_THE_NOTE = re.compile(r"\s+of\s+\[?(?:the\s+)?(?:semantics\s+)?note\b")
AFTER_SPEC = re.compile(r"\bSPEC(?:\.md)?\s*$")


@dataclass(frozen=True)
class Citation:
    path: str  # relative to the repository root
    line: int
    number: str
    target: str  # "note" or "spec"
    anchor: str | None = None  # the anchor of the note link the citation is the text of, if any

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: \u00a7{self.number} ({self.target})"


def repo_files(suffix: str) -> list[Path]:
    files = [p for p in ROOT.glob(f"*{suffix}") if p.is_file()]
    for d in SOURCE_DIRS:
        for p in (ROOT / d).rglob(f"*{suffix}"):
            rel = p.relative_to(ROOT).parts
            if not any(part.startswith(".") or part in SKIP_PARTS or part.endswith(".egg-info") for part in rel):
                files.append(p)
    return sorted(files)


def _blank(m: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def blank_code_fences(text: str) -> str:
    """The text with fenced code blocks replaced by spaces (offsets and line numbers kept)."""
    return re.sub(r"^```.*?^```", _blank, text, flags=re.MULTILINE | re.DOTALL)


def blank_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans replaced by spaces."""
    return re.sub(r"`[^`\n]*`", _blank, blank_code_fences(text))


def links(text: str) -> list[tuple[int, int, str]]:
    """(start, end of the link text, target) of each Markdown link outside code."""
    return [(m.start(1), m.end(1), m.group(2)) for m in LINK.finditer(blank_code(text))]


def is_note_target(target: str) -> bool:
    return target.split("#", 1)[0].endswith("vllm-semantics.md")


def classify(rel: str, text: str) -> list[Citation]:
    """Every citation in ``text`` (the content of file ``rel``), with the document it cites."""
    is_spec = rel == "specs/SPEC.md"
    regions = [(m.start(), m.end()) for m in REGION.finditer(text)] if is_spec else []
    note_links = [(a, b, t) for a, b, t in links(text) if is_note_target(t)]
    out = []
    for m in CITATION.finditer(text):
        pos = m.start()
        line = text.count("\n", 0, pos) + 1
        before = text[text.rfind("\n", 0, pos) + 1:pos]
        link = next(((a, b, t) for a, b, t in note_links if a <= pos < b), None)
        anchor = link[2].split("#", 1)[1] if link and "#" in link[2] else None
        if link is not None:
            target = "note"
        elif AFTER_SPEC.search(before):
            target = "spec"
        elif not is_spec:
            target = "note"
        elif any(a <= pos < b for a, b in regions):
            target = "note"
        else:
            after = text[m.end():m.end() + 40]
            target = "note" if OF_THE_NOTE.match(after) else "spec"
        for number in filter(None, m.groups()):
            out.append(Citation(rel, line, number, target, anchor))
    return out


def all_citations() -> list[Citation]:
    out: list[Citation] = []
    for p in repo_files(".py") + repo_files(".md"):
        out += classify(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8"))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", blank_code_fences(text), re.MULTILINE):
        s = slug(m.group(1))
        out.add(s if seen[s] == 0 else f"{s}-{seen[s]}")
        seen[s] += 1
    return out


def heading_numbers(text: str) -> set[str]:
    return set(HEADING.findall(blank_code_fences(text)))


def heading_anchor_of(text: str, number: str) -> str | None:
    m = re.search(rf"^#{{1,6}}\s+({re.escape(number)}\.?\s.*?)\s*$", blank_code_fences(text), re.MULTILINE)
    return slug(m.group(1)) if m else None


@pytest.fixture(scope="module")
def citations() -> list[Citation]:
    return all_citations()


@pytest.fixture(scope="module")
def note_text() -> str:
    assert NOTE.is_file(), "docs/vllm-semantics.md is missing"
    return NOTE.read_text(encoding="utf-8")


def test_the_collector_sees_the_repository(citations: list[Citation]) -> None:
    """Guards the rule itself: known citations of both kinds are found and told apart."""
    found = {(c.path, c.number, c.target) for c in citations}
    for expected in [("model/scheduler.py", "7.6", "note"), ("model/bugs.py", "10.15", "note"),
                     ("model/signal_rescan.py", "9.1", "note"), ("model/signal_rescan.py", "9.2", "note"),
                     ("specs/SPEC.md", "12.1", "note"), ("specs/SPEC.md", "7.12", "note"),
                     ("specs/SPEC.md", "10.16", "note"), ("specs/SPEC.md", "6.3", "spec"),
                     ("specs/SPEC.md", "5.1", "spec"), ("tests/test_spec_doc.py", "4", "spec")]:
        assert expected in found, f"the citation rule no longer sees {expected}"
    assert sum(c.target == "note" for c in citations) >= 36


def test_every_citation_of_the_note_resolves(citations: list[Citation], note_text: str) -> None:
    numbers = heading_numbers(note_text)
    missing = [str(c) for c in citations if c.target == "note" and c.number not in numbers]
    assert not missing, "cited but not a heading of docs/vllm-semantics.md:\n" + "\n".join(missing)


def test_note_links_point_at_the_cited_section(citations: list[Citation], note_text: str) -> None:
    wrong = [f"{c}: #{c.anchor}, expected #{heading_anchor_of(note_text, c.number)}"
             for c in citations if c.anchor is not None and c.anchor != heading_anchor_of(note_text, c.number)]
    assert not wrong, "\n".join(wrong)


def test_every_citation_of_spec_resolves(citations: list[Citation]) -> None:
    numbers = heading_numbers(SPEC.read_text(encoding="utf-8"))
    missing = [str(c) for c in citations if c.target == "spec" and c.number not in numbers]
    assert not missing, "cited as SPEC.md's own section but not a heading there (cite the note with a link?):\n" \
        + "\n".join(missing)


def test_every_relative_markdown_link_resolves() -> None:
    broken = []
    for p in repo_files(".md"):
        text = p.read_text(encoding="utf-8")
        for start, _, target in links(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (p.parent / path).resolve() if path else p
            where = f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, start) + 1}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{where} (no such heading anchor)")
    assert not broken, "\n".join(broken)


def test_the_rule_on_examples() -> None:
    """The classification and the resolution check on text that is not in the repository."""
    s = SECTION_SIGN
    spec_text = (f"see [{s}7.12](../docs/vllm-semantics.md#712-reset-abandon-semantics), {s}6, "
                 f"{s}6.3 of the note and SPEC {s}2\n<!-- t:begin -->\n{s}10.15\n<!-- t:end -->\n")
    got = [(c.number, c.target, c.anchor) for c in classify("specs/SPEC.md", spec_text)]
    assert got == [("7.12", "note", "712-reset-abandon-semantics"), ("6", "spec", None), ("6.3", "note", None),
                   ("2", "spec", None), ("10.15", "note", None)]
    py_text = f'"""Rules ({s}9.1-9.2); see SPEC.md {s}4."""'
    assert [(c.number, c.target) for c in classify("model/x.py", py_text)] == [
        ("9.1", "note"), ("9.2", "note"), ("4", "spec")]
    numbers = heading_numbers("## 7. Manager\n### 7.12 `reset()` (abandon semantics)\n```\n## 99. code\n```\n")
    assert numbers == {"7", "7.12"}
    assert "99" not in numbers and "7.13" not in numbers  # an unknown number does not resolve
    assert slug("7.12 `reset()` (abandon semantics)") == "712-reset-abandon-semantics"
    assert slug("9. PR #47235: \"Restore\" — [x](y)") == "9-pr-47235-restore--x"
