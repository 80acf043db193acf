#!/usr/bin/env bash
# Set up a venv holding real vLLM 0.33.0 (its scheduler-side offload bookkeeping only)
# next to a CPU torch and an editable kvspec, on a CPU-only machine.
#
#   scripts/setup-vllm-venv.sh [VENV_DIR]      (default: .vllm-venv in the checkout)
#
# Exit codes: 0 ready (created or reused), 3 the package registry could not be reached,
# 1 any other failure. Nothing is downloaded but registry packages.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$here/.vllm-venv"}
py=${PYTHON:-python3}

if [ -x "$venv/bin/python" ] && "$venv/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm") == "0.33.0" and m.version("kvspec") else 1)
PY
then
  echo "vllm venv: reusing $venv (vllm 0.33.0 present)"
  exit 0
fi

if ! "$py" - <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=15).close()
except Exception as exc:  # any network failure means: no registry
    print(f"vllm venv: package registry unreachable ({exc})", file=sys.stderr)
    sys.exit(3)
PY
then
  exit 3
fi

echo "vllm venv: creating $venv"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0                       # the CPU build; vLLM's own pin would pull CUDA
"${pip[@]}" --no-deps vllm==0.33.0
"${pip[@]}" --no-deps -r "$here/scripts/vllm-requirements.txt"
"${pip[@]}" hypothesis z3-solver crosshair-tool pytest
"${pip[@]}" --no-deps -e "$here"
"$venv/bin/python" -c "from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler; from vllm.v1.core.block_pool import BlockPool; print('vllm venv: vllm 0.33.0 imports')"
