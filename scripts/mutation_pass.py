"""A mutation pass over source files: every small operator change, one at a time, against chosen tests.

    python scripts/mutation_pass.py FILE [FILE ...] --tests "tests/a.py tests/b.py" [--slow "tests/c.py"]
        [--lines A-B] [--timeout 300] [--json OUT] [--marker EXPR]

For each file (a path in this repository, e.g. ``model/baseline.py``) the source is read as
tokens, so docstrings, comments and strings are never touched, and every token below gets one
mutant of its own: a comparison flipped at its boundary (``<`` and ``<=``, ``>`` and ``>=``)
or negated (``==`` and ``!=``), ``and`` and ``or`` swapped, ``True`` and ``False`` swapped, a
binary ``+`` and ``-`` swapped, a literal ``0`` made ``1`` and ``1`` made ``0``, and a ``not``
dropped (``not in`` becomes ``in``; ``is not`` is left alone). A mutant that does not compile is skipped. Each one is
written into a scratch copy of the repository (``kvspec.specs.mutations.scratch_copy``, made
once, the file restored after each mutant) and judged by ``pytest -x -q`` on ``--tests``
(fast ones); a mutant they leave alive then meets ``--slow`` (if given). A mutant no test
fails is a *survivor*: either the tests miss a behaviour, or the mutant is equivalent (same
behaviour in every reachable state), which only reading it can tell. A run past ``--timeout``
counts as caught and is listed apart. Prints one line per survivor and a summary; ``--json``
writes every mutant's result. ``--marker EXPR`` selects the tests by marker (pytest's ``-m``; the
default is pyproject's, ``not slow and not deep``: the default run; ``"not slow"`` adds the deep
tests, as the whole suite before the deep marker was). Exit 1 when something survived. Cost: one pytest run (two for a
survivor of the fast tier) per mutant.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SWAPS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "and": "or", "or": "and",
         "True": "False", "False": "True", "+": "-", "-": "+", "0": "1", "1": "0", "not": ""}
UNARY_BEFORE = {"(", "[", "{", ",", "=", "return", ":", "==", "!=", "<", "<=", ">", ">=", "+", "-", "*", "/",
                "//", "%", "and", "or", "not", "in", "if", "else", "lambda", "yield", "+=", "-=", "assert"}


@dataclass
class Mutant:
    file: str
    line: int
    col: int
    old: str
    new: str
    text: str  # the mutated line
    verdict: str = ""  # caught | caught (slow) | timeout | survived
    seconds: float = 0.0


def mutants(path: Path, lines: tuple[int, int] | None) -> list[tuple[Mutant, str]]:
    """Every mutant of the file (with its whole mutated source) that compiles. O(tokens x source)."""
    source = path.read_text()
    rows = source.splitlines(keepends=True)
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    out: list[tuple[Mutant, str]] = []
    for i, tok in enumerate(tokens):
        if tok.type not in (tokenize.OP, tokenize.NAME, tokenize.NUMBER) or tok.string not in SWAPS:
            continue
        (row, col), (_, end) = tok.start, tok.end
        if lines is not None and not lines[0] <= row <= lines[1]:
            continue
        prev = tokens[i - 1].string if i else ""
        if tok.string in "+-" and (prev in UNARY_BEFORE or tokens[i - 1].type in (tokenize.NEWLINE, tokenize.NL,
                                                                                      tokenize.INDENT)):
            continue  # a unary sign
        if tok.string == "not" and prev == "is":
            continue  # "is not" -> "is" is the "==" / "!=" flip of identity, left to the reader
        new, line = SWAPS[tok.string], rows[row - 1]
        text = line[:col] + new + line[end:] if new else line[:col] + line[end:].lstrip(" ")
        mutated = "".join(rows[:row - 1]) + text + "".join(rows[row:])
        try:
            compile(mutated, str(path), "exec")
        except SyntaxError:
            continue
        out.append((Mutant(str(path.relative_to(ROOT)), row, col, tok.string, new or "(dropped)",
                           text.rstrip("\n")), mutated))
    return out


def run_tests(root: Path, tests: list[str], timeout: float, marker: str | None = None) -> tuple[str, float]:
    """('failed' | 'passed' | 'timeout', seconds) of ``pytest -x -q tests`` in the copy at ``root``
    (``-m marker`` when given)."""
    from kvspec.specs.mutations import scratch_env

    t0 = time.monotonic()
    select = ["-m", marker] if marker is not None else []
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *select, *tests],
                              cwd=root, env=scratch_env(root), capture_output=True, timeout=timeout)
        verdict = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        verdict = "timeout"
    return verdict, time.monotonic() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="source files of this repository to mutate")
    p.add_argument("--tests", required=True, help="space-separated test paths run on every mutant (the fast tier)")
    p.add_argument("--slow", default="", help="space-separated test paths for the mutants the fast tier leaves alive")
    p.add_argument("--lines", default=None, metavar="A-B", help="only tokens on these lines (one file)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (default 300)")
    p.add_argument("--json", default=None, metavar="OUT", help="write every mutant's result as JSON")
    p.add_argument("--marker", default=None, metavar="EXPR",
                   help="pytest -m expression for every run (default: pyproject's, the default run)")
    a = p.parse_args()
    from kvspec.specs.mutations import scratch_copy

    lines = None
    if a.lines:
        lo, _, hi = a.lines.partition("-")
        lines = (int(lo), int(hi))
    fast, slow = a.tests.split(), a.slow.split()
    results: list[Mutant] = []
    with tempfile.TemporaryDirectory(prefix="kvspec-mutation-pass-") as tmp:
        root = scratch_copy(ROOT, Path(tmp))
        clean, _ = run_tests(root, fast + slow, a.timeout * 2, a.marker)
        if clean != "passed":
            raise SystemExit(f"the unmutated copy does not pass {' '.join(fast + slow)}: {clean}")
        for name in a.files:
            src = (ROOT / name).resolve()
            original = src.read_text()
            todo = mutants(src, lines)
            print(f"{name}: {len(todo)} mutants", file=sys.stderr, flush=True)
            target = root / src.relative_to(ROOT)
            try:
                for n, (m, mutated) in enumerate(todo, 1):
                    target.write_text(mutated)
                    verdict, secs = run_tests(root, fast, a.timeout, a.marker)
                    m.verdict = {"failed": "caught", "timeout": "timeout"}.get(verdict, "")
                    if verdict == "passed":
                        verdict, more = run_tests(root, slow, a.timeout, a.marker) if slow else ("passed", 0.0)
                        secs += more
                        m.verdict = {"failed": "caught (slow)", "timeout": "timeout"}.get(verdict, "survived")
                    m.seconds = round(secs, 1)
                    results.append(m)
                    if m.verdict == "survived":
                        print(f"SURVIVED {m.file}:{m.line}:{m.col} {m.old} -> {m.new}: {m.text.strip()}", flush=True)
                    print(f"  {n}/{len(todo)} {m.verdict}", file=sys.stderr, flush=True)
            finally:
                target.write_text(original)
    counts = {v: sum(1 for m in results if m.verdict == v) for v in ("caught", "caught (slow)", "timeout", "survived")}
    print(", ".join(f"{v}: {n}" for v, n in counts.items()) + f" (of {len(results)})")
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(m) for m in results], indent=1))
    return 1 if counts["survived"] else 0


if __name__ == "__main__":
    sys.exit(main())
