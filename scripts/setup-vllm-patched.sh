#!/usr/bin/env bash
# Build a venv running vLLM 0.33.0 with one of kvspec's patches applied to its sources.
#
#   scripts/setup-vllm-patched.sh PATCH [VENV_DIR]
#
# PATCH is a name under patches/vllm-0.33.0/ (pr47235, repair) or a path to a .diff.
# VENV_DIR defaults to .vllm-PATCH-venv in the checkout (gitignored).
#
# Nothing is installed twice: the base venv .vllm-venv (scripts/setup-vllm-venv.sh, which
# this script runs first) provides torch, vLLM's dependencies and the editable kvspec; the
# new venv reaches them through a site directory entry, and holds only a hard-linked copy
# of the vllm package with the two patched files replaced by real, patched copies. It takes
# a few seconds and almost no disk. A venv whose recorded patch checksum matches is reused.
# Exit codes: 0 ready (built or reused), 3 the package registry could not be reached (from
# the base venv's setup), 1 any other failure (the patch does not apply, the patched
# modules do not import or do not name the patch).
set -Eeuo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
trap 'echo "vllm patched venv: setup failed (line $LINENO)" >&2; exit 1' ERR

if [ $# -lt 1 ]; then
  echo "usage: scripts/setup-vllm-patched.sh PATCH [VENV_DIR]" >&2
  exit 1
fi
patch_arg=$1
if [ -f "$patch_arg" ]; then
  patch_file=$(cd "$(dirname "$patch_arg")" && pwd)/$(basename "$patch_arg")
else
  patch_file="$here/patches/vllm-0.33.0/$patch_arg.diff"
fi
if [ ! -f "$patch_file" ]; then
  echo "vllm patched venv: no patch $patch_arg (looked for $patch_file)" >&2
  exit 1
fi
name=$(basename "$patch_file" .diff)
venv=${2:-"$here/.vllm-$name-venv"}
base="$here/.vllm-venv"

rc=0
"$here/scripts/setup-vllm-venv.sh" "$base" || rc=$?
if [ "$rc" != 0 ]; then
  exit "$rc"
fi

base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
sum=$(sha256sum "$patch_file" | cut -d' ' -f1)

check() {
  "$venv/bin/python" - "$name" <<'PY'
import sys
from vllm.v1.core import block_pool
from vllm.v1.simple_kv_offload import manager
want = sys.argv[1]
got = (getattr(manager, "CPU_EVICTION_RESTORE", None), getattr(block_pool, "CPU_EVICTION_RESTORE", None))
if got != (want, want):
    sys.exit(f"vllm patched venv: the patched modules name {got}, not {want!r}")
print(f"vllm patched venv: vllm 0.33.0 + {want} imports ({manager.__file__})")
PY
}

if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/kvspec-patch.sha256" 2>/dev/null)" = "$sum" ]; then
  echo "vllm patched venv: reusing $venv ($name)"
  check
  exit 0
fi

echo "vllm patched venv: building $venv ($name)"
rm -rf "$venv"
"$base/bin/python" -m venv --without-pip "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The patched package shadows the base venv's: a venv's own site-packages comes first on
# sys.path, the base venv's directory (added below, .pth files included) after it.
cp -al "$base_site/vllm" "$site/vllm"
for f in vllm/v1/core/block_pool.py vllm/v1/simple_kv_offload/manager.py; do
  rm -f "$site/$f"
  cp "$base_site/$f" "$site/$f"
done
find "$site/vllm/v1/core/__pycache__" "$site/vllm/v1/simple_kv_offload/__pycache__" \
  -name 'block_pool.*' -o -name 'manager.*' 2>/dev/null | xargs -r rm -f
patch --quiet --forward --no-backup-if-mismatch -p1 -d "$site" < "$patch_file"
echo "import site; site.addsitedir('$base_site')" > "$site/zz-vllm-base-venv.pth"
# The console scripts the stage uses (kvspec, pytest) run with this venv's python.
for tool in kvspec pytest; do
  printf '#!/bin/sh\nexec "%s" -m %s "$@"\n' "$venv/bin/python" "$( [ "$tool" = kvspec ] && echo kvspec.cli || echo pytest)" \
    > "$venv/bin/$tool"
  chmod +x "$venv/bin/$tool"
done
check
echo "$sum" > "$venv/kvspec-patch.sha256"
