"""Hypothesis profiles: ``ci`` (the default run) and ``nightly`` (KVSPEC_PROFILE=nightly)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("nightly", max_examples=2000, stateful_step_count=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.load_profile(os.environ.get("KVSPEC_PROFILE", "ci"))
