"""``kvspec verify`` end to end with a small budget: every stage runs or says why not. Marked
``deep`` (it runs every proof, every known-bug hunt and three campaigns, about 40 s on two cores;
each stage's own parts are tested in the default run)."""

import json

import pytest

from kvspec.cli import main
from kvspec.model.bugs import BUGS


@pytest.mark.deep
def test_verify_json(capsys):
    rc = main(["verify", "--budget", "6", "--bug-budget", "10", "--json"])
    res = json.loads(capsys.readouterr().out)
    stages = {s["stage"]: s for s in res["stages"]}
    assert rc == 0 and res["ok"]
    assert stages["proofs"]["result"] == "pass"
    assert stages["known-bug catalogue"]["result"] == "pass"
    assert stages["known-bug catalogue"]["detail"].startswith(f"{len(BUGS)}/{len(BUGS)}")
    for name in ("conformance model/baseline", "conformance model/repair", "impl vs model/repair"):
        assert stages[name]["result"] == "pass" and "no finding (oracle: claims of" in stages[name]["detail"]
    vllm = stages["vLLM 0.33.0 vs model/baseline"]
    assert vllm["result"] in ("pass", "skipped") and vllm["detail"]
    for name in ("offloading: model", "offloading: impl vs model"):
        assert stages[name]["result"] == "pass" and stages[name]["detail"]
    from kvspec.model.offloading.bugs import OFFLOADING_BUGS

    n = len(OFFLOADING_BUGS)
    assert stages["offloading: known bugs"]["result"] == "pass"
    assert stages["offloading: known bugs"]["detail"].startswith(f"{n}/{n}")
    assert stages["offloading: vLLM 0.33.0 vs model"]["result"] in ("pass", "skipped")
