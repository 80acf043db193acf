#!/usr/bin/env bash
# vLLM's own tests of the CPU offload module, from the vLLM 0.33.0 source distribution, and
# PR #47235's four tests (tests/vllm_own/test_pr47235_tests.py), run in one or more vLLM venvs.
#
#   scripts/vllm-own-tests.sh [VENV ...]
#
# Default venvs: .vllm-venv .vllm-pr47235-venv .vllm-repair-venv (build them with
# scripts/setup-vllm-venv.sh and scripts/setup-vllm-patched.sh). The first is the reference,
# unpatched vLLM; every test that passes there must pass in the others, except the known
# differences listed in patches/vllm-0.33.0/vllm-own-tests-known.tsv, and PR #47235's four tests
# must pass in every patched venv (scripts/vllm_own_tests_report.py prints the per-test table
# and decides).
#
# What it does:
# * fetches vllm-0.33.0.tar.gz (47 MB) from the package registry's simple index page (pip
#   download would try to build it), checks its pinned sha256 and keeps it, with its tests/
#   tree extracted, under .vllm-sdist/ in the checkout (gitignored: vLLM's files are never
#   committed);
# * runs pytest with --noconftest: vLLM's tests/conftest.py needs the dependencies of vLLM's
#   whole suite (PIL, tblib, model helpers); tests/vllm_own/vllm_test_shims.py supplies the
#   one fixture (caplog_vllm) and the markers these tests use;
# * points Hugging Face at a local cache holding only a config.json for facebook/opt-125m,
#   offline (HF_HUB_OFFLINE=1): the tests build ModelConfig("facebook/opt-125m"), which
#   otherwise asks the Hub over the network and retries for ~70 s per test with no network;
#   only the model's configuration is read, never weights or a tokenizer;
# * bounds every test with pytest-timeout (60 s, installed from the registry when missing) and
#   every venv's run with `timeout 600`.
# JUnit files and logs go to out/vllm-own-tests/.
# Exit codes: 0 all checks passed, 1 a check failed (or a run timed out), 3 the package
# registry could not be reached (sdist or pytest-timeout unavailable).
set -Eeuo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
trap 'echo "vllm own tests: failed (line $LINENO)" >&2; exit 1' ERR

SDIST=vllm-0.33.0.tar.gz
SDIST_SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
TEST_TIMEOUT=60
cache="$here/.vllm-sdist"
src="$cache/src/vllm-0.33.0"
out="$here/out/vllm-own-tests"
if [ $# -eq 0 ]; then
  set -- "$here/.vllm-venv" "$here/.vllm-pr47235-venv" "$here/.vllm-repair-venv"
fi
mkdir -p "$cache" "$out"

# -- the sdist, fetched once -----------------------------------------------------------------------
if ! echo "$SDIST_SHA256  $cache/$SDIST" | sha256sum --check --status 2>/dev/null; then
  index="${PIP_INDEX_URL:-https://pypi.org/simple}"
  echo "vllm own tests: fetching $SDIST (47 MB) via $index/vllm/"
  url=$(curl -fsS -m 60 "${index%/}/vllm/" | grep -o "href=\"[^\"]*/$SDIST[#\"][^\"]*" | head -1 \
        | sed -e 's/^href="//' -e 's/#.*//' -e 's/"$//') || true
  if [ -z "$url" ] || ! curl -fsS -m 600 -o "$cache/$SDIST.part" "$url"; then
    echo "vllm own tests: the registry could not be reached for $SDIST" >&2
    exit 3
  fi
  mv "$cache/$SDIST.part" "$cache/$SDIST"
  echo "$SDIST_SHA256  $cache/$SDIST" | sha256sum --check --quiet
  rm -rf "$cache/src"
fi
if [ ! -f "$src/tests/v1/simple_kv_offload/test_scheduler.py" ]; then
  mkdir -p "$cache/src"
  tar xzf "$cache/$SDIST" -C "$cache/src" vllm-0.33.0/tests   # the tests import helpers across tests/
fi

# -- a Hugging Face cache holding only the configuration the tests name ---------------------------
hf="$cache/hf"
snapshot="$hf/hub/models--facebook--opt-125m/snapshots/0000000000000000000000000000000000000000"
if [ ! -f "$snapshot/config.json" ]; then
  mkdir -p "$snapshot" "$hf/hub/models--facebook--opt-125m/refs"
  printf 0000000000000000000000000000000000000000 > "$hf/hub/models--facebook--opt-125m/refs/main"
  cat > "$snapshot/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "word_embed_proj_dim": 768,
 "ffn_dim": 3072, "num_attention_heads": 12, "num_hidden_layers": 12, "vocab_size": 50272,
 "max_position_embeddings": 2048, "torch_dtype": "float16", "do_layer_norm_before": true,
 "activation_function": "relu", "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}
JSON
fi
printf '[pytest]\nmarkers =\n    vllm: needs real vLLM 0.33.0\n' > "$cache/pytest.ini"

# -- one run per venv --------------------------------------------------------------------------------
runs=()
status=0
for venv in "$@"; do
  py="$venv/bin/python"
  if [ ! -x "$py" ]; then
    echo "vllm own tests: no venv at $venv (scripts/setup-vllm-venv.sh, scripts/setup-vllm-patched.sh)" >&2
    exit 1
  fi
  if ! "$py" -c 'import pytest_timeout' 2>/dev/null; then
    # a patched venv has no pip of its own: it reaches the base venv's packages
    pip_py=$py; "$py" -m pip --version >/dev/null 2>&1 || pip_py="$here/.vllm-venv/bin/python"
    "$pip_py" -m pip install --quiet --disable-pip-version-check pytest-timeout || exit 3
  fi
  # the patch the venv's manager module names (CPU_EVICTION_RESTORE), read without importing vLLM
  patch=$(sed -n 's/^CPU_EVICTION_RESTORE = "\(.*\)"$/\1/p' "$venv"/lib/python3*/site-packages/vllm/v1/simple_kv_offload/manager.py)
  label=vllm${patch:++$patch}
  echo "vllm own tests: $label ($venv)"
  rc=0
  (cd "$src" && env HF_HOME="$hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
     PYTHONPATH="$here/tests/vllm_own${PYTHONPATH:+:$PYTHONPATH}" \
     timeout 600 "$py" -m pytest -c "$cache/pytest.ini" --rootdir "$here" --noconftest -p vllm_test_shims \
       -p no:cacheprovider -q --timeout "$TEST_TIMEOUT" --junitxml "$out/$label.xml" \
       tests/v1/simple_kv_offload "$here/tests/vllm_own/test_pr47235_tests.py") \
     > "$out/$label.log" 2>&1 || rc=$?
  tail -n 1 "$out/$label.log"
  if [ "$rc" = 124 ]; then
    echo "vllm own tests: $label timed out after 600 s (log: $out/$label.log)" >&2
    status=1
  fi
  runs+=("$label=$out/$label.xml")
done

python3 "$here/scripts/vllm_own_tests_report.py" \
  --known "$here/patches/vllm-0.33.0/vllm-own-tests-known.tsv" "${runs[@]}" || status=1
exit "$status"
