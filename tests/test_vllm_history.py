"""The shrunk findings of ``kvspec history`` replay in the vLLM release they were found in.

``tests/traces/vllm_history/<version>/`` holds one shrunk trace per distinct finding of the
invariant fuzzer on real vLLM ``<version>`` (target ``vllm@<version>``, or ``raw:vllm@<version>`` for
what vLLM did with a call kvspec's adapter would refuse; ``docs/vllm-history.md``).
Each trace, replayed on the installed vLLM with the oracle recorded in it, must end in the
finding recorded in its header: the same kind and the same invariant (or exception type). Only the
directory of the installed release runs here: in the vLLM CI stage that is 0.33.0;
``scripts/vllm-history.sh`` runs this file in every release's venv. Marked ``vllm``; skipped, with
the reason, where vLLM cannot be imported.
"""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pytest

from kvspec.adapters.targets import get_factory
from kvspec.drivers import trace as trace_io
from kvspec.drivers.harness import run_ops

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parent / "traces" / "vllm_history"


def _installed() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


VERSION = _installed()
TRACES = sorted((ROOT / VERSION).glob("*.jsonl")) if VERSION else []


def test_every_release_directory_has_traces() -> None:
    dirs = sorted(p.name for p in ROOT.iterdir() if p.is_dir())
    assert "0.33.0" in dirs
    assert all(list((ROOT / d).glob("*.jsonl")) for d in dirs)


@pytest.mark.skipif(VERSION is None, reason="vLLM is not installed here")
@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_finding_replays(path: Path) -> None:
    trace = trace_io.read(path)
    assert trace.target in (f"vllm@{VERSION}", f"raw:vllm@{VERSION}") and trace.finding is not None
    out = run_ops(trace.config, trace.ops, get_factory(trace.target), trace.oracle)
    want = trace.finding
    assert out.kind == want["kind"], out.describe()
    assert out.op_index == len(trace.ops) - 1, out.describe()
    if want["kind"] == "violation":
        assert out.violation is not None and out.violation.id == want["invariant"], out.describe()
    else:
        assert out.exception == want["exception"], out.describe()


@pytest.mark.skipif(VERSION is None, reason="vLLM is not installed here")
@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_finding_needs_its_last_operation(path: Path) -> None:
    """Without its last operation a shrunk trace finds nothing: the finding is that operation's."""
    trace = trace_io.read(path)
    out = run_ops(trace.config, trace.ops[:-1], get_factory(trace.target), trace.oracle)
    assert not out.failed, out.describe()
