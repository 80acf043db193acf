"""Bad input at the Python API and at the command line of ``kvspec bench`` and ``kvspec prove``.

The corpus of bad calls at every entry point of a target and of its GPU pool is the error
contract of ``contract_kit`` (run on the model and the implementation by tests/test_errors.py,
on real vLLM by the vLLM stage). Here: the checks refuse only what is wrong (the same shapes, well
formed, go through alike on the model and the implementation), and ``kvspec bench`` and
``kvspec prove`` arguments that must exit 2 before any work.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from contract_kit import HUGE, MAX_MESSAGE, FakeRequest, Scene

from kvspec.cli import main
from kvspec.contract.errors import InvalidBlockError, InvalidCountError
from kvspec.contract.types import KVConnectorOutput, SchedulerOutput
from kvspec.impl import make_scheduler as make_impl
from kvspec.model import make_scheduler as make_model
from kvspec.model.block_pool import BlockPool


@pytest.mark.parametrize("factory", [make_model, make_impl], ids=["model", "impl"])
def test_good_calls_still_accepted(factory: Any) -> None:
    """The checks refuse only what is wrong: the same shapes, well formed, go through."""
    b = Scene(factory, "baseline")
    blk = b.unkeyed_block()
    b.pool.insert_block_hash(("feed", 1), blk)  # group 1 of 2
    assert b.pool.get_cached_block("feed", [1]) == [blk]
    assert b.pool.get_cached_block("feed", (0, 1)) is None
    assert b.pool.get_one_block(("feed", 1)) == blk
    assert b.pool.get_one_block(("", 0)) is None and b.pool.get_one_block(("two\nlines", 0)) is None  # no such key
    b.pool.touch(x for x in [blk])  # any iterable
    b.pool.free_blocks((blk,))
    b.pool.evict_blocks([0])  # the null block carries no entry: evicting it is a no-op, as in vLLM
    b.target.build_connector_meta(SchedulerOutput(preempted_req_ids=frozenset(), finished_req_ids=["gone"]))
    b.target.update_connector_output(KVConnectorOutput(finished_recving=[], completed_store_events={}))
    assert b.target.get_num_new_matched_tokens(FakeRequest(block_hashes=("x", "y")), 0) == (0, False)


def test_pool_without_num_groups_bounds_no_group() -> None:
    """A pool built without ``num_groups`` (the tests' own pools) accepts any group id >= 0."""
    p = BlockPool(8, "gpu")
    (blk,) = p.get_new_blocks(1)
    p.insert_block_hash(("h", 5), blk)
    with pytest.raises(InvalidBlockError, match="group id -1"):
        p.insert_block_hash(("h", -1), blk)
    with pytest.raises(InvalidCountError, match="num_groups must be None or an int >= 1"):
        BlockPool(8, "gpu", 0)


# -- the command line: exit 2 before any work ------------------------------------------------------


def _exit_code(argv: list[str]) -> int:
    """``kvspec.cli.main``'s exit code: returned (a ``KVSpecError`` from the command) or raised
    by argparse as ``SystemExit``."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


BENCH_CASES = [
    (["--scale", "bad"], r"--scale 'bad': expected R,BPR,CPU"),
    (["--scale", "1,2"], r"--scale '1,2': expected R,BPR,CPU \(three integers\), got 2 field"),
    (["--scale", "0,0,0"], r"requests must be >= 1, got 0"),
    (["--scale", "4,0,100"], r"blocks per request must be >= 1, got 0"),
    (["--scale", "4,4,1"], r"CPU blocks must be >= 2, got 1"),
    (["--scale", "4,x,100"], r"three integers"),
    (["--scale", "100000,100,10"], r"--scale 100000,100,10 \(chat\): num_gpu_blocks"),
    (["--scale", "4,4,100", "--scale", HUGE], r"\(5000000 chars\)"),
    (["--device", "banana"], r"--device 'banana': not a device"),
    (["--device", "cuda:x"], r"not a device"),
    (["--device", "meta"], r"unsupported device type 'meta'"),
    (["--runs", "0"], r"--runs must be >= 1, got 0"),
    (["--steps", "-1"], r"--steps must be >= 1, got -1"),
    (["--threads", "0"], r"--threads must be 1\.\.1024, got 0"),
    (["--threads", str(1 << 40)], r"--threads must be"),
    (["--target", "nonsense"], r"unknown bench target 'nonsense'"),
    (["--target", "vllm", "--policy", "repair"], r"vLLM implements only the baseline policy"),
]


@pytest.mark.parametrize(("argv", "match"), BENCH_CASES, ids=[" ".join(a)[:40] for a, _ in BENCH_CASES])
def test_bench_bad_arguments_exit_2(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", *argv]) == 2
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvspec bench: "), cap.err[:300]
    assert len(lines[0]) < MAX_MESSAGE
    assert re.search(match, lines[0]), lines[0]
    assert cap.out == ""  # nothing measured


def test_bench_cuda_without_a_gpu_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    if _cuda_available():
        pytest.skip("this machine has a CUDA device")
    assert _exit_code(["bench", "--device", "cuda", "--quick"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvspec bench: --device 'cuda': no CUDA device here (torch.cuda.is_available() is False)")


@pytest.mark.parametrize("argv", [["--runs", "x"], ["--steps", "1.5"], ["--workload", "nope"], ["--policy", "yolo"]])
def test_bench_argparse_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", *argv]) == 2
    assert "kvspec bench: error: argument" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "match"), [
    (["-k", "no-such-obligation"], r"kvspec prove: -k 'no-such-obligation' matches no obligation"),
    (["--list", "-k", "no-such-obligation"], r"matches no obligation"),
    (["--quick", "-k", "G=2"], r"matches no obligation \(of the --quick catalogue\)"),
    (["-k", ""], r"-k needs a non-empty TEXT"),
    (["-k", HUGE], r"\(5000000 chars\) matches no obligation"),
])
def test_prove_bad_selection_exits_2(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["prove", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    (line,) = cap.err.splitlines()
    assert len(line) < MAX_MESSAGE
    assert re.search(match, line), line


def test_prove_list_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["prove", "--list", "--json", "-k", "no-lookback"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all("no-lookback" in r["name"] for r in rows)
    assert {"name", "policy", "kind", "statement"} <= set(rows[0])
