"""The key-level, multi-request invariant (specs/keylevel.py): it holds, and it catches R1 giving a
lost record only to the first owner of an evicted key."""

from __future__ import annotations

import pytest

import kvspec.specs.keylevel as kl
from kvspec.specs.obligations import keylevel_obligations


def _results() -> dict[str, str]:
    return {ob.name: ob.run().result for ob in keylevel_obligations()}


def test_the_key_level_invariant_and_c3_hold() -> None:
    assert _results() == {"keylevel:inductive": "holds", "keylevel:no-amplification": "holds"}


@pytest.mark.deep  # one inductive check of the mutated encoding: about 35 s
def test_only_the_first_owner_getting_a_record_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kl, "FIRST_OWNER_ONLY", True)
    (ob,) = [ob for ob in keylevel_obligations() if ob.name == "keylevel:inductive"]
    res = ob.run()
    assert res.result == "fails" and res.detail.startswith("evict"), res.detail
