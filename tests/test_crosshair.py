"""CrossHair on the model's pure functions: no counterexample to any contract.

Checked (PEP 316 ``pre:``/``post:`` docstrings):

* ``kvspec.model.rules`` — cursor arithmetic (``ready_blocks``), block classification
  (``classify_store_candidate``) and one group's positional scan (``scan_group``), the
  functions the baseline scheduler calls;
* ``kvspec.specs.contracts`` — the free queue (pop from the head, fresh-to-head and
  cached-to-tail on free, remove, walk after a cursor) and hit search (full attention,
  sliding window), through thin wrappers that build the model's own objects.

What lies outside CrossHair's reach here: CrossHair explores execution paths with an SMT
solver within a time budget per condition, so for the loops (scan, queue operations,
hit search) "no counterexample" means none on the paths it reached, not a proof;
``ready_blocks`` and ``classify_store_candidate`` are loop-free and CrossHair reports
them confirmed over all paths. Stateful code (the schedulers, pools, prefix map, the
multi-group hit-search fixpoint) is not checked by CrossHair at all: that is what the Z3
obligations (``kvspec prove``) and the stateful tests are for.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvspec.model.scheduler as scheduler_module
from kvspec.contract.config import OffloadConfig
from kvspec.contract.types import CachedRequestData, SchedulerOutput
from kvspec.model import make_scheduler
from kvspec.model.scheduler import StoreState

CROSSHAIR = [sys.executable, "-m", "crosshair", "check", "--analysis_kind=PEP316"]
PER_CONDITION = "1.5"  # seconds per postcondition; 25 conditions


def _run(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CROSSHAIR, f"--per_condition_timeout={PER_CONDITION}", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_no_counterexample_to_any_contract() -> None:
    proc = _run(["--report_all", "kvspec.model.rules", "kvspec.specs.contracts"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert not [ln for ln in lines if "error" in ln], proc.stdout
    # every postcondition was analysed (25 of them), and the loop-free rules were confirmed on all paths
    assert len(lines) == 25, proc.stdout
    confirmed = {ln.split(":")[1] for ln in lines if "rules.py" in ln and "Confirmed over all paths" in ln}
    assert len(confirmed) >= 11, proc.stdout


BROKEN = '''
from kvspec.model.free_queue import FreeBlockQueue
from kvspec.model.rules import classify_store_candidate, scan_group


def scan_passes_everything(ready_flags: list[bool], n_selected: int, free: int) -> int:
    """pre: n_selected >= 0
    post: __return__ == len(ready_flags)
    """
    return scan_group(ready_flags, n_selected, free)[1]


def in_flight_wins(is_null: bool, hashed: bool, in_flight: bool, cached: bool) -> str:
    """post: __return__ == "in_flight" or not in_flight
    """
    return classify_store_candidate(is_null, hashed, in_flight, cached)


def pop_takes_newest(ids: list[int], n: int) -> list[int]:
    """pre: len(set(ids)) == len(ids)
    pre: 0 <= n <= len(ids)
    post: __return__ == ids[len(ids) - n:]
    """
    return FreeBlockQueue(ids).popleft_n(n)
'''


def test_crosshair_refutes_false_contracts(tmp_path: Path) -> None:
    """The check can fail: three false claims about the same functions are refuted."""
    (tmp_path / "broken_contracts.py").write_text(textwrap.dedent(BROKEN))
    proc = _run(["broken_contracts.py"], cwd=tmp_path)
    assert proc.returncode != 0
    for name in ("scan_passes_everything", "in_flight_wins", "pop_takes_newest"):
        assert f"when calling {name}(" in proc.stdout, proc.stdout


def test_the_baseline_scan_uses_the_checked_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """No dead code: the contracts are about what the baseline scheduler actually runs."""
    calls: list[tuple[list[bool], int, int]] = []
    real = scheduler_module.scan_group

    def spy(flags: list[bool], n: int, free: int) -> tuple[list[int], int]:
        calls.append((list(flags), n, free))
        return real(flags, n, free)

    monkeypatch.setattr(scheduler_module, "scan_group", spy)
    sched = make_scheduler(OffloadConfig(block_size=1, num_gpu_blocks=4, num_cpu_blocks=3, policy="baseline"))

    class Req:
        request_id, block_hashes, num_computed_tokens = "R", ["a", "b"], 2
        num_output_placeholders, skip_reading_prefix_cache, num_tokens = 0, False, 3

    ids = sched.gpu_pool.get_new_blocks(2)
    for i, b in enumerate(ids):
        sched.gpu_pool.insert_block_hash((Req.block_hashes[i], 0), b)
    sched.reqs_to_store["R"] = StoreState(Req(), [list(ids)], [0])
    out = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(req_ids=["R"], new_block_ids=[None]),
                          num_scheduled_tokens={"R": 1})
    meta = sched.build_connector_meta(out)
    assert calls == [([True, True], 0, 2)]
    assert meta.store_gpu_blocks == ids and sched.reqs_to_store["R"].num_stored_blocks == [2]
