#!/usr/bin/env bash
# Run vLLM 0.33.0's own scheduler tests (tests/v1/core/ of its sdist) on this
# CPU-only machine, in the active virtual environment (see install.sh):
#
#   bash tests/vllm/run.sh [pytest args...]
#   bash tests/vllm/run.sh -p gpukv.vllm.testing        # on gpukv's manager
#
# Steps: fetch the tests into a work folder (default build/vllm-tests/, which
# is git-ignored), write a config-only Hugging Face cache there, set the
# environment vLLM needs on CPU and offline, cd there and run pytest on the
# test files below (GPUKV_VLLM_TEST_FILES overrides that list: paths relative
# to the work folder, space-separated). Extra arguments go to pytest as given.
#
# Node ids are relative to the work folder: tests/v1/core/test_x.py::test_y.
# The work folder holds tests/ and the caches only, so `import vllm` is the
# installed wheel, and it has its own pytest.ini, so this repository's pytest
# settings (setup.cfg) do not apply. --noconftest: vLLM's conftest.py files
# start its LLM test harness and are not part of what is fetched.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="${GPUKV_VLLM_WORK:-$repo/build/vllm-tests}"
py="${PYTHON:-python}"

default_files="tests/v1/core/test_scheduler.py
tests/v1/core/test_async_scheduler.py
tests/v1/core/test_prefix_caching.py
tests/v1/core/test_deferred_block_free.py
tests/v1/core/test_priority_preemption_bug.py
tests/v1/core/test_worker_slot_overflow.py
tests/v1/core/test_swa_inflight_window_free.py
tests/v1/core/test_kv_cache_utils.py"
files="${GPUKV_VLLM_TEST_FILES:-$default_files}"

mkdir -p "$work"
"$py" "$here/fetch_tests.py" "$work"

# The config-only HF cache: rewritten only when hf_cache.py changed.
stamp="$work/hf/.gpukv-hf-cache"
want="$("$py" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$here/hf_cache.py")"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    "$py" "$here/hf_cache.py" "$work/hf"
    echo "$want" >"$stamp"
fi

cat >"$work/pytest.ini" <<'EOF'
[pytest]
# vLLM's marks, registered (they select test subsets in vLLM's CI only).
markers =
    cpu_test: vLLM CI mark
    skip_global_cleanup: vLLM CI mark
EOF

export VLLM_TARGET_DEVICE=cpu      # else "Failed to infer device type"
export HF_HUB_OFFLINE=1            # resolve model names from the cache only
export TRANSFORMERS_OFFLINE=1
export HF_HOME="$work/hf"
export VLLM_CACHE_ROOT="$work/vllm-cache"   # vLLM's model-inspection cache, kept out of ~/.cache
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1

cd "$work"
# shellcheck disable=SC2086  # $files is a whitespace-separated list on purpose
exec "$py" -m pytest -c pytest.ini --rootdir=. --noconftest -p no:cacheprovider $files "$@"
