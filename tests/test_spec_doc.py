"""specs/SPEC.md cannot drift from the code: generated regions, names, pictures."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

import kvspec.contract.errors
from kvspec.contract.types import GpuPool, OffloadTarget
from kvspec.drivers.engine import Engine
from kvspec.oracle.catalogue import CATALOGUE

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "SPEC.md"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_spec", ROOT / "scripts" / "gen_spec.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_spec"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def text() -> str:
    return SPEC.read_text(encoding="utf-8")


def region(text: str, name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->(.*?)<!-- {name}:end -->", text, re.DOTALL)
    assert m is not None, f"SPEC.md has no {name} region"
    return m.group(1)


def test_generated_regions_are_current(gen: ModuleType, text: str) -> None:
    fresh = gen.update(text)
    for name in gen.REGIONS:
        assert region(text, name) == region(fresh, name), (
            f"the {name} region of specs/SPEC.md is stale: run scripts/gen_spec.py")


def test_catalogue_table_has_every_invariant_once(text: str) -> None:
    rows = [ln for ln in region(text, "catalogue").splitlines() if ln.startswith("| ") and not ln.startswith("| Id")]
    assert [ln.split("|")[1].strip() for ln in rows] == list(CATALOGUE)
    for ln, inv in zip(rows, CATALOGUE.values(), strict=True):
        assert inv.title in ln
        assert ("| yes |" in ln) == inv.needs_engine


def test_check_mode_reports_a_stale_file(gen: ModuleType, text: str, tmp_path: Path) -> None:
    stale = tmp_path / "SPEC.md"
    stale.write_text(text.replace("| I1 |", "| I1 (edited by hand) |", 1), encoding="utf-8")
    assert gen.main(["--check", "--path", str(stale)]) == 1
    assert gen.main(["--path", str(stale)]) == 0
    assert gen.main(["--check", "--path", str(stale)]) == 0
    assert stale.read_text(encoding="utf-8") == text


def test_missing_markers_are_refused(gen: ModuleType) -> None:
    with pytest.raises(SystemExit, match="catalogue:begin"):
        gen.update("no regions here", {"catalogue": "x"})


def test_scenario_outcomes_show_the_hazards(gen: ModuleType) -> None:
    """The facts the policy comparison rests on, straight from the runs."""
    by_name = {sc.name: sc for sc in gen.SCENARIOS}
    t2 = {p: gen.run_scenario(by_name["T2"], p) for p in gen.POLICIES}
    assert t2["baseline"].holes == [0, 1] and t2["baseline"].reachable == 0
    t3 = {p: gen.run_scenario(by_name["T3"], p) for p in gen.POLICIES}
    assert "C1" in t3["baseline"].violated and not t3["repair"].violated
    h1 = {p: gen.run_scenario(by_name["H1"], p) for p in gen.POLICIES}
    assert h1["signal-rescan"].holes == [0, 1] and h1["repair"].holes == []
    h6 = {p: gen.run_scenario(by_name["H6"], p) for p in gen.POLICIES}
    assert h6["signal-rescan"].copies_last_3 > 0 and h6["repair"].copies_last_3 == 0
    assert h6["repair"].reachable > h6["signal-rescan"].reachable


def test_pictures_referenced_exist(text: str) -> None:
    refs = re.findall(r"\]\((pictures/[^)]+\.svg)\)", text)
    assert sorted(refs) == ["pictures/cpu_lru_t2.svg", "pictures/cursor_t2_policies.svg"]
    for ref in refs:
        assert (SPEC.parent / ref).is_file()


def test_every_error_class_is_documented(text: str) -> None:
    classes = [c for _, c in inspect.getmembers(kvspec.contract.errors, inspect.isclass)
               if issubclass(c, kvspec.contract.errors.KVSpecError) and c is not kvspec.contract.errors.KVSpecError]
    assert classes
    missing = [c.__name__ for c in classes if f"`{c.__name__}`" not in text]
    assert not missing, f"SPEC.md does not mention {missing}"


def test_every_protocol_method_and_engine_op_is_documented(text: str) -> None:
    names = [n for n in dir(OffloadTarget) if not n.startswith("_")]
    names += [n for n in dir(GpuPool) if not n.startswith("_")]
    assert "build_connector_meta" in names and "get_new_blocks" in names
    missing = [n for n in names if f"`{n}" not in text]
    assert not missing, f"SPEC.md does not mention {missing}"
    ops = [n[3:] for n in dir(Engine) if n.startswith("op_")]
    assert set(ops) >= {"add", "step", "report", "load_done", "finish", "reset"}
    missing_ops = [op for op in ops if f"| `{op}(" not in text]
    assert not missing_ops, f"SPEC.md §4 does not describe {missing_ops}"


def test_every_scheduler_snapshot_field_is_documented(text: str) -> None:
    schema = json.loads((ROOT / "kvspec" / "contract" / "schema" / "snapshot.schema.json").read_text(encoding="utf-8"))
    fields = schema["$defs"]["scheduler"]["required"] + schema["$defs"]["pool"]["required"]
    missing = [f for f in fields if f"`{f}`" not in text]
    assert not missing, f"SPEC.md §1 does not mention {missing}"
