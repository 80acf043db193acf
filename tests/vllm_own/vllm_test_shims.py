"""A pytest plugin replacing the few parts of vLLM's ``tests/conftest.py`` that the tests of
``tests/v1/simple_kv_offload/`` use, so those tests run with ``--noconftest`` in a venv that
lacks the dependencies of vLLM's whole test suite (PIL, tblib, vLLM's model test helpers).

* The markers vLLM's suite registers (``skip_global_cleanup``, ``optional``, ``slow_test``)
  are registered here too, so pytest does not warn about them.
* ``caplog_vllm``: pytest's ``caplog`` at INFO with the ``vllm`` logger propagating to the
  root logger for the duration of the test (vLLM's logger does not propagate by default, and
  ``caplog`` only sees records that reach the root).

Loaded with ``-p vllm_test_shims`` and this folder on ``sys.path`` (scripts/vllm-own-tests.sh).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

MARKERS = {
    "skip_global_cleanup": "no GPU/distributed clean-up after the test (vLLM's suite)",
    "optional": "run only on request in vLLM's CI",
    "slow_test": "slow in vLLM's CI",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.fixture
def caplog_vllm(caplog: pytest.LogCaptureFixture,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` capturing INFO and above, vLLM's records included. O(1)."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog
