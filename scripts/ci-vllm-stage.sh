#!/usr/bin/env bash
# CI stage: conformance of the model's baseline policy with real vLLM 0.33.0.
#
#   scripts/ci-vllm-stage.sh
#
# Sets up (or reuses) .vllm-venv with scripts/setup-vllm-venv.sh, then runs
# tests/test_vllm_conformance.py with that venv's pytest, bounded by `timeout 900`.
# When the package registry is unreachable (setup exit 3) the stage is skipped with a
# loud banner and exit 0; every other failure (setup, a divergence, a timeout) fails the
# stage with a non-zero exit. Failing traces go to $KVSPEC_VLLM_TRACE_DIR
# (default: out/vllm-divergences/ in the checkout). KVSPEC_REQUIRE_VLLM=1 turns a
# vLLM that cannot be imported into a failure instead of skipped tests.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

banner() {
  echo "=============================================================================="
  echo "=== $1"
  echo "=============================================================================="
}

# run_tests NAME TIMEOUT PYTHON TESTFILE [ENV=VALUE...]: pytest on TESTFILE (marker vllm) with
# PYTHON under `timeout TIMEOUT`; a timeout, no test collected or any failure ends the stage
# with a non-zero exit and a banner naming NAME.
run_tests() {
  local name=$1 limit=$2 python=$3 file=$4 rc=0
  shift 4
  env "$@" timeout "$limit" "$python" -m pytest -q -s -rs -m vllm -p no:cacheprovider "$file" || rc=$?
  if [ "$rc" = 124 ]; then
    banner "$name FAILED: timed out after $limit s"
    exit 1
  fi
  if [ "$rc" = 5 ]; then
    banner "$name FAILED: no vLLM test was collected"
    exit 1
  fi
  if [ "$rc" != 0 ]; then
    banner "$name FAILED (pytest exit $rc)"
    exit "$rc"
  fi
  banner "$name passed"
}

rc=0
scripts/setup-vllm-venv.sh || rc=$?
if [ "$rc" = 3 ]; then
  banner "vLLM conformance stage SKIPPED: registry unreachable (vLLM 0.33.0 could not be installed)"
  exit 0
fi
if [ "$rc" != 0 ]; then
  banner "vLLM conformance stage FAILED: setting up the vLLM venv exited $rc"
  exit "$rc"
fi

export KVSPEC_VLLM_TRACE_DIR=${KVSPEC_VLLM_TRACE_DIR:-"$here/out/vllm-divergences"}
echo "vLLM conformance: failing traces go to $KVSPEC_VLLM_TRACE_DIR"
run_tests "vLLM conformance stage" 900 .vllm-venv/bin/python tests/test_vllm_conformance.py KVSPEC_REQUIRE_VLLM=1

# vLLM's real scheduler (Scheduler/AsyncScheduler with the SimpleCPUOffloadConnector) in lockstep
# with the engine model: tests/test_vllm_scheduler.py with 250 random traces of 120 operations
# per configuration family (1,000 in all), bounded by `timeout 480`. Any divergence of the engine
# from vLLM's synchronous scheduler fails the stage; saved traces of the engine against the async
# scheduler are strict expected failures (the engine models synchronous scheduling).
run_tests "vLLM scheduler lockstep" 480 .vllm-venv/bin/python tests/test_vllm_scheduler.py \
  KVSPEC_REQUIRE_VLLM=1 KVSPEC_VLLM_SCHEDULER_TRACES=250

# vLLM 0.33.0 with kvspec's patches (patches/vllm-0.33.0/): each built as its own venv by
# scripts/setup-vllm-patched.sh (hard links to .vllm-venv, a few seconds), then
# tests/test_vllm_patched.py in that venv: the policy's model in lockstep with the patched
# vLLM on random traces, the hazard scenarios on both, the fuzzer's saved findings.
# Bounded by `timeout 300` per patch; skipped loudly when the registry is unreachable.
for patch in pr47235 repair; do
  rc=0
  scripts/setup-vllm-patched.sh "$patch" || rc=$?
  if [ "$rc" = 3 ]; then
    banner "vLLM + $patch stage SKIPPED: registry unreachable (vLLM 0.33.0 could not be installed)"
    continue
  fi
  if [ "$rc" != 0 ]; then
    banner "vLLM + $patch stage FAILED: building the patched venv exited $rc"
    exit "$rc"
  fi
  run_tests "vLLM + $patch lockstep" 300 ".vllm-$patch-venv/bin/python" tests/test_vllm_patched.py \
    "KVSPEC_REQUIRE_VLLM_PATCH=$patch"
done

# Verdicts on vLLM (tests/test_vllm_verdicts.py): the error contract observed in vLLM's own
# objects, refusals that leave vLLM unchanged, raw targets; bounded by `timeout 300`.
run_tests "vLLM verdicts" 300 .vllm-venv/bin/python tests/test_vllm_verdicts.py KVSPEC_REQUIRE_VLLM=1

# The shrunk findings of `kvspec history` on vLLM 0.33.0 (tests/traces/vllm_history/0.33.0/)
# replay to the same finding: tests/test_vllm_history.py, bounded by `timeout 120`. The other
# releases need venvs of their own: scripts/vllm-history.sh, outside CI.
run_tests "vLLM history replay" 120 .vllm-venv/bin/python tests/test_vllm_history.py KVSPEC_REQUIRE_VLLM=1
