"""Every catalogued bug's shrunk trace, replayed as a plain regression test.

The traces under tests/traces/ were written by ``kvspec bugs --out tests/traces``. Each
must still show its bug on the variant (same invariant), and must be clean on the
correct policy the variant derives from, for the invariants that policy claims.
"""

from pathlib import Path

import pytest

from kvspec import trace as trace_io
from kvspec.harness import default_oracle, replay
from kvspec.model import make_scheduler
from kvspec.model.bugs import BUGS, make_bug_target

TRACES = Path(__file__).parent / "traces"


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_trace_still_finds_the_bug(name):
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    bug = BUGS[name]
    oracle = bug.oracle or default_oracle(tr.config)
    out = replay(tr, lambda cfg: make_bug_target(name, cfg), oracle)
    assert out.failed, f"{name}: the saved trace no longer shows the bug"
    assert out.op_index == len(tr.ops) - 1, "a shrunk trace fails at its last operation"
    note_id = tr.note.split(": ")[2] if tr.note.count(": ") >= 2 else None
    if out.violation is not None and note_id:
        assert out.violation.id == note_id


@pytest.mark.parametrize("name", sorted(n for n, b in BUGS.items() if b.policy != "signal-rescan"
                                        and n != "vllm-fixme"))
def test_bug_trace_is_clean_on_the_correct_policy(name):
    tr = trace_io.read(TRACES / f"{name}.jsonl")
    out = replay(tr, make_scheduler, default_oracle(tr.config))
    assert not out.failed, out.describe()
