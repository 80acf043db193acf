#!/usr/bin/env bash
# Set up a venv holding real vLLM 0.33.0 (its scheduler-side offload bookkeeping only)
# next to a CPU torch and an editable kvspec, on a CPU-only machine.
#
#   scripts/setup-vllm-venv.sh [VENV_DIR]      (default: .vllm-venv in the checkout)
#
# A venv that already imports vLLM 0.33.0 with a CPU torch is reused; kvspec is then
# re-pointed at this checkout if it was installed from another one.
# Exit codes: 0 ready (created or reused), 3 the package registry could not be reached,
# 1 any other failure. Nothing is downloaded but registry packages.
set -Eeuo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$here/.vllm-venv"}
py=${PYTHON:-python3}
trap 'echo "vllm venv: setup failed (line $LINENO)" >&2; exit 1' ERR

pip_install() { "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

# What the conformance stage needs from the venv, checked by importing it.
venv_state() {
  "$venv/bin/python" -I - "$here" <<'PY' 2>/dev/null
import importlib.metadata as m, os, sys
if m.version("vllm") != "0.33.0":
    sys.exit(1)
import torch
if torch.version.cuda is not None:
    sys.exit(1)                                      # a CUDA torch: rebuild
for name in ("pytest", "hypothesis"):
    m.version(name)
try:
    import kvspec
except ImportError:
    sys.exit(2)
ok = os.path.realpath(kvspec.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
sys.exit(0 if ok else 2)
PY
}

if [ -x "$venv/bin/python" ]; then
  rc=0; venv_state || rc=$?
  if [ "$rc" = 0 ]; then
    echo "vllm venv: reusing $venv (vllm 0.33.0 present)"
    exit 0
  fi
  if [ "$rc" = 2 ]; then
    echo "vllm venv: reusing $venv; installing kvspec from $here"
    pip_install --no-deps --no-build-isolation -e "$here"
    venv_state
    exit 0
  fi
fi

# Reachability of the index pip will use (PIP_INDEX_URL when set, else PyPI).
if ! "$py" - "${PIP_INDEX_URL:-https://pypi.org/simple}" <<'PY'
import sys, urllib.request
url = sys.argv[1].rstrip("/") + "/vllm/"
try:
    urllib.request.urlopen(url, timeout=15).close()
except Exception as exc:  # any network failure means: no registry
    print(f"vllm venv: package registry unreachable ({url}: {exc})", file=sys.stderr)
    sys.exit(3)
PY
then
  exit 3
fi

echo "vllm venv: creating $venv"
"$py" -m venv "$venv"
# The CPU build of torch: vLLM's own pin would pull a CUDA one. A local wheel
# (find-links) is used when present, else PyTorch's CPU index.
pip_install "torch==2.13.0+cpu" || pip_install --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
pip_install --no-deps vllm==0.33.0
pip_install --no-deps -r "$here/scripts/vllm-requirements.txt"
pip_install hypothesis z3-solver crosshair-tool pytest "setuptools>=68"
pip_install --no-deps -e "$here"
"$venv/bin/python" -c "from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler; from vllm.v1.core.block_pool import BlockPool; print('vllm venv: vllm 0.33.0 imports')"
venv_state
