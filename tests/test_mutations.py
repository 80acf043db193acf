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
