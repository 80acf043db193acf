"""Test helper for tests/test_interrupts.py, loaded at start-up by every process of a test's run
(a ``sitecustomize`` the test writes) when ``KVSPEC_TEST_MARKS`` names a directory: each fuzz
search writes ``started-<pid>-fuzz`` there once its first trace has run, and each of ``verify``'s
proofs and campaign stages ``started-<pid>-proofs`` or ``-campaign`` as it starts, so that the
test knows the workers are busy before it interrupts their parent."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kvspec.commands.fuzz as fuzz_cmd
import kvspec.commands.verify as verify_cmd
import kvspec.drivers.harness as harness

MARKS_ENV = "KVSPEC_TEST_MARKS"


def _mark(what: str) -> None:
    marks = os.environ.get(MARKS_ENV)
    if marks:
        (Path(marks) / f"started-{os.getpid()}-{what}").touch()


def _marking_progress(progress: Any) -> Any:
    def marked(traces: int, ops: int, secs: float) -> None:
        if traces >= 1:
            _mark("fuzz")
        if progress is not None:
            progress(traces, ops, secs)
    return marked


def _fuzz(*args: Any, **kwargs: Any) -> Any:
    kwargs["progress"] = _marking_progress(kwargs.get("progress"))
    return _real_fuzz(*args, **kwargs)


_real_fuzz = harness.fuzz


_real_proofs = verify_cmd._proofs
_real_campaign = verify_cmd._campaign


def marked_proofs() -> Any:
    """``verify``'s proofs stage, marked as started."""
    _mark("proofs")
    return _real_proofs()


def marked_campaign(*args: Any) -> Any:
    """``verify``'s campaign stages, marked as started."""
    _mark("campaign")
    return _real_campaign(*args)


if os.environ.get(MARKS_ENV):  # every process of the test's run loads this module at start-up
    fuzz_cmd.fuzz = _fuzz  # type: ignore[assignment]
    verify_cmd._proofs = marked_proofs
    verify_cmd._campaign = marked_campaign
