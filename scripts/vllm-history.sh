#!/usr/bin/env bash
# Replay the shrunk findings of `kvspec history` (tests/traces/vllm_history/<version>/) in each
# release's own venv: tests/test_vllm_history.py run by that venv's pytest.
#
#   scripts/vllm-history.sh [VERSION...]      (default: every directory under tests/traces/vllm_history)
#
# Each venv is built or reused with scripts/setup-vllm-release.sh (0.33.0 may be .vllm-venv).
# Exit 0 when every release replays its findings, 3 when a venv cannot be built because the
# registry is unreachable, 1 otherwise.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
versions=("$@")
if [ ${#versions[@]} = 0 ]; then
  mapfile -t versions < <(ls tests/traces/vllm_history)
fi
status=0
for v in "${versions[@]}"; do
  venv=.vllm-venvs/$v
  if [ "$v" = 0.33.0 ] && [ ! -d "$venv" ] && [ -d .vllm-venv ]; then
    venv=.vllm-venv
  else
    rc=0; scripts/setup-vllm-release.sh "$v" || rc=$?
    if [ "$rc" = 3 ]; then exit 3; fi
    if [ "$rc" != 0 ]; then echo "vllm history: $v: setup failed ($rc)"; status=1; continue; fi
  fi
  echo "=== vLLM $v"
  KVSPEC_REQUIRE_VLLM=1 timeout 600 "$venv/bin/python" -m pytest -q -m vllm -p no:cacheprovider \
    tests/test_vllm_history.py || status=1
done
exit $status
