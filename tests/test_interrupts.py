"""Ctrl-C as documented (issue 32): ``kvspec prove`` and ``verify``'s proofs stage stop inside a Z3
check (whose own SIGINT handler used to turn the signal into an ``unknown`` answer: a failed
obligation, and the run went on), exit 130 with the obligations done so far, and run nothing
further; a multi-worker ``fuzz``/``verify``/``bugs`` whose parent alone gets SIGINT stops its
workers at once and prints the statistics so far.

Each run is a subprocess that sends SIGINT to itself (the parent only, never its workers) once
the run is in the state the test is about; nothing here measures time."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A catalogue of three obligations for `prove`/`verify`: one quick, one that keeps Z3 busy (the
# pigeonhole principle, 12 pigeons in 11 holes: Z3 answers only at its timeout) and sends SIGINT to
# this process once its check has started, one that must never run.
PROVE_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    import z3
    from kvspec.specs import obligations as O

    O.TIMEOUT_MS = 5_000  # the old behaviour (unknown, retried twice, FAILED) ends within seconds
    n = 12
    p = [[z3.Bool(f"p{i}_{j}") for j in range(n - 1)] for i in range(n)]
    hard = [z3.Or(row) for row in p] + [z3.Not(z3.And(p[i][j], p[k][j])) for j in range(n - 1)
                                        for i in range(n) for k in range(i + 1, n)]

    def busy():
        # SIGINT once Z3 is inside the check (the timer starts just before it)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        r, _ = O._check(hard)
        return ("holds" if r == z3.unsat else "unknown"), "", {}

    def never():
        print("NEVER-RUN", file=sys.stderr)
        return "holds", "", {}

    obs = [O.Obligation("quick", "repair", "proof", lambda: ("holds", "", {})),
           O.Obligation("busy", "repair", "proof", busy),
           O.Obligation("never", "repair", "proof", never)]
    O.catalogue = lambda *a, **k: obs
    import kvspec.commands.verify as verify
    def campaign(*args):
        print("LATER-STAGE-RAN", file=sys.stderr)
        return True, "ran"
    verify._campaign = campaign
    from kvspec.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _run(script: str, *argv: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_prove_under_ctrl_c_exits_130_with_the_obligations_done() -> None:
    proc = _run(PROVE_SCRIPT, "prove", "--json")
    assert proc.returncode == 130, proc.stderr
    done = json.loads(proc.stdout)
    assert [r["name"] for r in done] == ["quick"] and done[0]["ok"]
    assert "NEVER-RUN" not in proc.stderr and "interrupted after 1 of 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_verify_interrupted_in_its_proofs_runs_no_further_stage() -> None:
    proc = _run(PROVE_SCRIPT, "verify", "--json", "--budget", "1", "--bug-budget", "0.1")
    assert proc.returncode == 130, proc.stderr
    out = json.loads(proc.stdout)
    assert out["interrupted"] and not out["ok"]
    proofs, *rest = out["stages"]
    assert proofs["result"] == "interrupted" and "after 1 of 3 obligations" in proofs["detail"]
    assert rest and all(r["result"] == "not run" for r in rest)
    assert "NEVER-RUN" not in proc.stderr and "LATER-STAGE-RAN" not in proc.stderr


# `fuzz --workers 2` (and `verify --workers 2`) with SIGINT to the parent only, sent once both
# workers are known to be searching (each writes a file when its search starts): the parent stops
# the workers and reports what they did. The budget is far beyond the test's timeout, so a run
# that waited for its workers' budget would fail by timing out.
FUZZ_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    marks = Path(sys.argv[1])

    def watch():
        while len(list(marks.glob("started-*"))) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()
    from kvspec.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def _with_marks(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory for the workers' start marks, and the environment that makes every process of
    the run (the spawned workers too) load tests/interrupt_kit.py at start-up (a sitecustomize)."""
    import os

    marks = tmp_path / "marks"
    marks.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import interrupt_kit  # noqa: F401\n")
    path = os.pathsep.join([str(site), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return marks, {**os.environ, "PYTHONPATH": path, "KVSPEC_TEST_MARKS": str(marks)}


def _run_group(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run in a session of its own; on a timeout kill the whole group (workers included)."""
    import os
    import signal

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s: the workers were not stopped\n{err[-2000:]}") from None
    return proc.returncode, out, err


def test_fuzz_workers_stop_when_only_the_parent_gets_sigint(tmp_path: Path) -> None:
    marks, env = _with_marks(tmp_path)
    code, out, err = _run_group([sys.executable, "-c", FUZZ_SCRIPT, str(marks), "fuzz", "--budget", "100000",
                                 "--workers", "2", "--json", "--out", str(tmp_path / "out")], env, 240)
    assert code == 130, err
    res = json.loads(out)
    assert res["interrupted"] and res["workers"] == 2 and res["traces"] > 0
    assert all(w["traces"] > 0 for w in res["per_worker"])
    assert "Traceback" not in err


def test_verify_workers_stop_when_only_the_parent_gets_sigint(tmp_path: Path) -> None:
    """The two stages running (the proofs, inside Z3 or not, and the first campaign) stop and say
    so; the stages queued behind them never start."""
    marks, env = _with_marks(tmp_path)
    code, out, err = _run_group([sys.executable, "-c", FUZZ_SCRIPT, str(marks), "verify", "--budget", "100000",
                                 "--workers", "2", "--json"], env, 240)
    assert code == 130, err
    res = json.loads(out)
    rows = {r["stage"]: r for r in res["stages"]}
    assert res["interrupted"] and not res["ok"]
    assert rows["proofs"]["result"] == "interrupted"
    assert rows["conformance model/baseline"]["result"] == "interrupted"
    assert [r["result"] for r in res["stages"][2:]] == ["not run"] * (len(res["stages"]) - 2)
    assert "Traceback" not in err
