"""The mutation catalogue (``kvspec.specs.mutations``) stays applicable and documented.

The table itself is measured by ``scripts/mutants.py`` (minutes per mutation: not in the default
run); here: every mutation still finds its text exactly once (so the catalogue follows the code),
applying one to a scratch copy changes that copy only, and specs/PROOFS.md's table lists each
with the layer recorded in the catalogue.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.specs.mutations import LAYERS, MUTATIONS, PLANTED, Mutation, apply, scratch_copy

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_mutation_applies_once(m: Mutation) -> None:
    assert (REPO / m.path).read_text().count(m.old) == 1, f"{m.name}: its text is no longer in {m.path} once"
    assert m.old != m.new and m.caught_by in LAYERS


def test_catalogue_shape() -> None:
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names)) and len(names) >= 20
    assert len(PLANTED) >= 8
    assert all(m.path.startswith(("model/", "specs/")) for m in MUTATIONS)


def test_scratch_copy_is_mutated_alone(tmp_path: Path) -> None:
    m = MUTATIONS[0]
    root = scratch_copy(REPO, tmp_path)
    apply(root, m)
    assert m.new in (root / m.path).read_text()
    assert (REPO / m.path).read_text().count(m.old) == 1
    assert (root / "kvspec" / "model" / "rules.py").read_text() == (root / "model" / "rules.py").read_text()


def test_proofs_md_lists_every_mutation_with_its_layer() -> None:
    text = (REPO / "specs" / "PROOFS.md").read_text()
    for m in MUTATIONS:
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{m.name}` | {m.path} |")), None)
        assert row is not None, f"{m.name} missing from PROOFS.md's mutation table"
        assert row.rstrip(" |").endswith(m.caught_by), row


def test_a_scratch_copy_of_a_scratch_copy_has_the_same_files(tmp_path: Path) -> None:
    """A copy that is not a git checkout (inside a mutation pass) is copied whole, caches aside."""
    first = scratch_copy(Path(__file__).resolve().parent.parent, tmp_path / "a")
    (first / "tests" / "__pycache__").mkdir(exist_ok=True)
    (first / "tests" / "__pycache__" / "x.pyc").write_bytes(b"")
    second = scratch_copy(first, tmp_path / "b")

    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}

    assert files(first) == files(second) and (second / "kvspec" / "model").is_symlink()
    assert not (second / "tests" / "__pycache__").exists()
