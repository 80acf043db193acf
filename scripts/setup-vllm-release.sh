#!/usr/bin/env bash
# Set up a venv holding one real vLLM release (its scheduler-side offload bookkeeping only)
# next to a CPU torch and an editable kvspec, for `kvspec history` and the `vllm@VERSION` targets.
#
#   scripts/setup-vllm-release.sh VERSION [VENV_DIR]
#       (default VENV_DIR: .vllm-venvs/VERSION in the checkout)
#
# The recipe is the one of scripts/setup-vllm-venv.sh (vLLM 0.33.0): torch 2.13.0 (CPU build,
# from the local wheel directory pip is configured with, else PyTorch's CPU index), vLLM itself
# with --no-deps, then the pinned extras of scripts/vllm-requirements.txt with the per-release
# changes below (each one read off the release's wheel METADATA or found by importing it):
#
#   0.19.x  + gguf, diskcache (imported by vLLM's config modules);
#           llguidance 1.3.0 (declares >=1.3.0,<1.4.0)
#   0.20.x  wheels are tagged manylinux_2_35: refused on a machine whose glibc is older
#   0.22.x-0.23.x + gguf
#   0.31.x  transformers 5.17.0 (declares <5.18.0; the pinned 5.20.2 is too new), xgrammar 0.2.7,
#           httpx 0.28.1 + httpcore 1.0.9 (transformers 5.17 imports httpx, not httpx2),
#           huggingface_hub 1.33.0 (transformers 5.17 requires <2.0; 0.31.0 declares >=1.31.0)
#
# vLLM's own torch pin differs across releases (2.10.0 for 0.19.x ... 2.14.0 for 0.33.0); the
# offload bookkeeping uses no torch operator that changed, so every venv gets the same CPU torch.
#
# A venv that already imports the release with a CPU torch is reused (kvspec re-pointed at this
# checkout if needed). Exit codes: 0 ready (created or reused), 3 the package registry could not
# be reached, 1 any other failure (an unknown release, a release without the offload manager,
# a wheel this machine cannot run).
set -Eeuo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
version=${1:?usage: scripts/setup-vllm-release.sh VERSION [VENV_DIR]}
venv=${2:-"$here/.vllm-venvs/$version"}
py=${PYTHON:-python3}
trap 'echo "vllm $version venv: setup failed (line $LINENO)" >&2; exit 1' ERR

if ! [[ "$version" =~ ^0\.([0-9]+)\.([0-9]+)$ ]]; then
  echo "vllm venv: $version is not a release number like 0.23.0" >&2
  exit 1
fi
minor=${BASH_REMATCH[1]}
if [ "$minor" -lt 19 ]; then
  echo "vllm venv: vLLM $version has no vllm/v1/simple_kv_offload (the offload manager ships from 0.19.0)" >&2
  exit 1
fi
if [ "$minor" = 20 ]; then
  glibc=$(ldd --version 2>/dev/null | head -1 | grep -oE '[0-9]+\.[0-9]+$' || echo 0.0)
  if [ "$(printf '%s\n2.35\n' "$glibc" | sort -V | head -1)" != 2.35 ]; then
    echo "vllm venv: the vLLM $version wheels need glibc >= 2.35 (manylinux_2_35); this machine has $glibc" >&2
    exit 1
  fi
fi

pip_install() { "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

venv_state() {
  "$venv/bin/python" -I - "$here" "$version" <<'PY' 2>/dev/null
import importlib.metadata as m, os, sys
if m.version("vllm") != sys.argv[2]:
    sys.exit(1)
import torch
if torch.version.cuda is not None:
    sys.exit(1)
try:  # a half-built venv (an extra missing) is rebuilt
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler  # noqa: F401
except ImportError:
    sys.exit(1)
try:
    import z3  # noqa: F401  (kvspec replay loads it; absent from venvs built before it was needed)
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
    echo "vllm venv: reusing $venv (vllm $version present)"
    exit 0
  fi
  if [ "$rc" = 2 ]; then
    echo "vllm venv: reusing $venv; installing kvspec from $here (and z3-solver)"
    pip_install z3-solver
    pip_install --no-deps --no-build-isolation -e "$here"
    venv_state
    exit 0
  fi
  echo "vllm venv: $venv exists but does not hold vllm $version with a CPU torch; rebuilding it"
  rm -rf "$venv"
fi

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

# The extras: the 0.33.0 list, with this release's changes.
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
pin() {  # pin NAME==VERSION: replace NAME's line, or add it
  local name=${1%%==*}
  grep -viE "^${name}==" "$reqs" >"$reqs.new" || true
  echo "$1" >>"$reqs.new"
  mv "$reqs.new" "$reqs"
}
sed -e 's/[[:space:]]*#.*$//' -e '/^[[:space:]]*$/d' "$here/scripts/vllm-requirements.txt" >"$reqs"
case "$minor" in
  19) pin gguf==0.19.0; pin diskcache==5.6.3; pin llguidance==1.3.0 ;;
  22|23) pin gguf==0.19.0 ;;
  31) pin transformers==5.17.0; pin xgrammar==0.2.7; pin httpx==0.28.1; pin httpcore==1.0.9
      pin huggingface_hub==1.33.0 ;;
esac

echo "vllm venv: creating $venv for vllm $version"
mkdir -p "$(dirname "$venv")"
"$py" -m venv "$venv"
pip_install "torch==2.13.0+cpu" || pip_install --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
pip_install --no-deps "vllm==$version"
pip_install --no-deps -r "$reqs"
pip_install hypothesis z3-solver pytest "setuptools>=68"  # z3: kvspec replay checks refinement (R1)
pip_install --no-deps -e "$here"
"$venv/bin/python" -c "
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request
print('vllm venv: vllm $version imports')"
venv_state
