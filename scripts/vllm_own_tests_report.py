"""Per-test verdict table of vLLM's own offload tests in several venvs, and the patch check.

    python scripts/vllm_own_tests_report.py [--known FILE] LABEL=JUNIT.xml [LABEL=JUNIT.xml ...]

Reads the JUnit XML pytest wrote for each venv (scripts/vllm-own-tests.sh) and prints one row per
test with its verdict in each venv (pass, FAIL, ERROR, TIMEOUT, skip, or xfail: a strict expected
failure), the reason of every verdict other than pass, and a count per venv.

With more than one venv the first is the reference (unpatched vLLM) and the others are patched;
the exit status is 1 when
* a test that passes in the reference does not pass in a patched venv, unless ``--known`` lists
  it for that venv (a known difference, printed as such with its reason);
* a listed known difference passes after all (the list is stale);
* a test of ``test_pr47235_tests.py`` (PR #47235's four tests) does not pass in a patched venv;
* a venv ran no test at all.
Otherwise 0. The known-differences file has one ``LABEL<TAB>TEST<TAB>REASON`` per line; ``#``
starts a comment. O(tests x venvs).
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

PR_TESTS = "test_pr47235_tests.py::"


def test_id(case: ET.Element) -> str:
    """``file.py::name`` from a JUnit test case (the class name is the dotted module path); a
    module skipped or broken as a whole has no class name and its dotted path as name: ``file.py``."""
    classname, name = case.get("classname", ""), case.get("name", "")
    if not classname:
        return f"{name.rsplit('.', 1)[-1]}.py"
    return f"{classname.rsplit('.', 1)[-1]}.py::{name}"


def verdict(case: ET.Element) -> tuple[str, str]:
    """(verdict, first line of the reason) of one JUnit test case."""
    for tag, name in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "skip")):
        node = case.find(tag)
        if node is not None and node.get("type") == "pytest.xfail":
            return "xfail", node.get("message") or ""
        if node is not None:
            text = (node.get("message") or "") + "\n" + (node.text or "")
            skipped = re.search(r"Skipped: ([^'\"]*)", text)
            first = skipped.group(1) if skipped else text.strip().split("\n", 1)[0]
            if name != "skip" and "Timeout" in text:
                return "TIMEOUT", first
            return name, first
    return "pass", ""


def read(path: Path) -> dict[str, tuple[str, str]]:
    return {test_id(case): verdict(case) for case in ET.parse(path).iter("testcase")}


def read_known(path: Path | None) -> dict[tuple[str, str], str]:
    known: dict[tuple[str, str], str] = {}
    if path is None:
        return known
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            label, test, reason = line.split("\t", 2)
            known[(label, test)] = reason
    return known


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--known", type=Path, help="known differences: LABEL<TAB>TEST<TAB>REASON per line")
    parser.add_argument("runs", nargs="+", help="LABEL=JUNIT.xml, the unpatched reference first")
    args = parser.parse_args(argv)
    labels = [run.split("=", 1)[0] for run in args.runs]
    results = {label: read(Path(run.split("=", 1)[1])) for label, run in zip(labels, args.runs, strict=True)}
    tests = sorted({t for r in results.values() for t in r}, key=lambda t: (PR_TESTS in t, t))
    width = max(len(t) for t in tests) if tests else 10

    print(f"{'test':<{width}}  " + "  ".join(f"{label:>12}" for label in labels))
    for t in tests:
        print(f"{t:<{width}}  " + "  ".join(f"{results[label].get(t, ('-', ''))[0]:>12}" for label in labels))
    print()
    for label in labels:
        counts: dict[str, int] = {}
        for v, _ in results[label].values():
            counts[v] = counts.get(v, 0) + 1
        print(f"{label}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
        for t in tests:
            v, why = results[label].get(t, ("-", ""))
            if v not in ("pass", "-"):
                print(f"    {v} {t}: {why[:160]}")

    problems = [f"{label}: no test ran" for label in labels if not results[label]]
    known = read_known(args.known)
    reference, patched = labels[0], labels[1:]
    for label in patched:
        for t in tests:
            want, got = results[reference].get(t, ("-", ""))[0], results[label].get(t, ("-", ""))[0]
            listed = known.get((label, t))
            if PR_TESTS in t and got != "pass":
                problems.append(f"{label}: PR #47235 test {t} is {got}")
            elif want == "pass" and got != "pass":
                if listed is None:
                    problems.append(f"{label}: {t} passes unpatched but is {got}")
                else:
                    print(f"known difference, {label}: {t} ({got}): {listed}")
            elif listed is not None:
                problems.append(f"{label}: {t} is listed as a known difference but is {got} (stale list)")
    if patched:
        print()
        for p in problems:
            print(f"PROBLEM {p}")
        print("patch check: " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
