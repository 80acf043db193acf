"""The architecture, checked: layers import only downwards, no import cycles, small functions.

The layers (README.md, "Layout"): 1 the contract (``kvspec.contract``) and the pure rules
(``kvspec.model.rules``), 2 the oracle (``kvspec.oracle``), 3 the targets (``kvspec.model``,
``kvspec.impl``, ``kvspec.adapters``) and the proofs about them (``kvspec.specs``), 4 the
drivers (``kvspec.drivers``), 5 the user interface (``kvspec.cli``, ``kvspec.commands``,
``kvspec.report``). Imports are read from the source with ``ast`` (module level and inside
functions alike; a ``TYPE_CHECKING`` block counts too, except for the cycle check, where it is
the one way a back-reference may be written).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = {"kvspec": "kvspec", "model": "kvspec.model", "impl": "kvspec.impl", "specs": "kvspec.specs"}
MAX_FUNCTION_LINES = 60
LONG_MARKER = "# long function:"  # the comment above a def that states why it may be longer

RANKS = {
    "kvspec": 1, "kvspec.contract": 1, "kvspec.model.rules": 1,
    "kvspec.oracle": 2,
    "kvspec.model": 3, "kvspec.impl": 3, "kvspec.adapters": 3, "kvspec.specs": 3,
    "kvspec.drivers": 4,
    "kvspec.cli": 5, "kvspec.commands": 5, "kvspec.report": 5,
}
# The implementation shares the model's pure functions and nothing else of it.
IMPL_MAY_IMPORT_FROM_MODEL = {"kvspec.model.rules", "kvspec.model.hit_search", "kvspec.model.hashing"}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    type_only: bool


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [SOURCE_DIRS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path) -> Iterator[Import]:
    """Every ``kvspec`` import in one file, with whether it is only for type checking."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def visit(node: ast.AST, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - child.level + 1], base]).rstrip(".")
                if base.startswith("kvspec"):
                    for alias in child.names:  # `from kvspec.x import y` may name a submodule y
                        yield Import(name, f"{base}.{alias.name}", child.lineno, type_only)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("kvspec"):
                        yield Import(name, alias.name, child.lineno, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                yield from visit(child, True)
            else:
                yield from visit(child, type_only)

    yield from visit(ast.parse(path.read_text(encoding="utf-8")), False)


def known_modules() -> set[str]:
    return {module_name(p) for p in source_files()}


def resolve(imported: str, modules: set[str]) -> str:
    """The module an import names: ``kvspec.x.y`` is module ``kvspec.x.y`` if it exists, else
    the attribute ``y`` of module ``kvspec.x``."""
    return imported if imported in modules else imported.rsplit(".", 1)[0]


def rank(module: str) -> tuple[str, int]:
    best = max((k for k in RANKS if module == k or module.startswith(k + ".")), key=len)
    return best, RANKS[best]


def all_imports() -> list[Import]:
    modules = known_modules()
    return [Import(i.importer, resolve(i.imported, modules), i.line, i.type_only)
            for p in source_files() for i in imports_of(p)]


def test_layers_import_only_downwards() -> None:
    wrong = []
    for i in all_imports():
        (src_layer, src_rank), (dst_layer, dst_rank) = rank(i.importer), rank(i.imported)
        if dst_rank > src_rank:
            wrong.append(f"{i.importer}:{i.line} (layer {src_rank}, {src_layer}) imports {i.imported} "
                         f"(layer {dst_rank}, {dst_layer})")
    assert not wrong, "imports that go up a layer:\n" + "\n".join(wrong)


def test_the_contract_imports_nothing_above_it() -> None:
    wrong = [f"{i.importer}:{i.line} imports {i.imported}" for i in all_imports()
             if i.importer.startswith("kvspec.contract") and not i.imported.startswith("kvspec.contract")]
    assert not wrong, "\n".join(wrong)


def test_impl_shares_only_the_models_pure_functions() -> None:
    wrong = [f"{i.importer}:{i.line} imports {i.imported}" for i in all_imports()
             if i.importer.startswith("kvspec.impl") and i.imported.startswith("kvspec.model")
             and i.imported not in IMPL_MAY_IMPORT_FROM_MODEL]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    """Run-time imports (module level or inside a function: a lazy import is still a dependency)
    form a DAG between modules; only an import for type checking may point back."""
    graph: dict[str, set[str]] = {}
    for i in all_imports():
        if not i.type_only and i.imported != i.importer:
            graph.setdefault(i.importer, set()).add(i.imported)
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own submodules
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def long_functions() -> list[str]:
    found = []
    for path in source_files():
        if module_name(path).startswith("kvspec.specs"):
            continue  # the proofs' obligation tables are data, one entry per line
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            above = lines[first - 2].strip() if first >= 2 else ""
            if length > MAX_FUNCTION_LINES and not above.startswith(LONG_MARKER):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    return found


def test_functions_are_short_or_say_why() -> None:
    found = long_functions()
    assert not found, (f"functions over {MAX_FUNCTION_LINES} lines without a '{LONG_MARKER} <reason>' "
                       "comment on the line above:\n" + "\n".join(found))


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The import reader and the length rule see what they must: a planted upward import, a
    planted cycle edge and a planted long function are each reported."""
    planted = ROOT / "kvspec" / "contract" / "_planted_for_test.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    planted.write_text(f"from kvspec.drivers import harness\n\n\ndef f() -> None:\n{body}\n", encoding="utf-8")
    try:
        imports = [i for i in all_imports() if i.importer == "kvspec.contract._planted_for_test"]
        assert [i.imported for i in imports] == ["kvspec.drivers.harness"]
        assert rank(imports[0].imported)[1] > rank(imports[0].importer)[1]
        assert any("_planted_for_test.py" in f for f in long_functions())
    finally:
        planted.unlink()
