"""Hypothesis profiles: ``ci`` (the default run) and ``nightly`` (KVSPEC_PROFILE=nightly).

Markers (pyproject.toml): ``deep`` tests are left out of the default run and run by ``.ci/run``
as a step of their own (``python -m pytest -q -m "deep and not slow"``); ``slow`` ones only on
request (``-m slow``)."""

import os
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("nightly", max_examples=2000, stateful_step_count=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.load_profile(os.environ.get("KVSPEC_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _drop_cached_refinement_solvers() -> Iterator[None]:
    """After each test module, drop the Z3 solvers that refinement caches (``refinement.chain``):
    live solvers slow every later Z3 check in the process (one of the spec-agreement tests took
    12 s instead of 2 s after the refinement tests), and the tests share one process."""
    yield
    refinement = sys.modules.get("kvspec.specs.refinement")
    if refinement is not None:
        refinement.chain.cache_clear()
