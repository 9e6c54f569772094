#!/usr/bin/env bash
# One run on a machine with an NVIDIA GPU, Numba, numba-cuda, CuPy, pytest and
# pytest-benchmark already installed (gpukv itself is used from this checkout):
#
#   1. the CUDA backend's tests: every backend-parametrized test that runs in
#      Numba's simulator elsewhere runs on the GPU here (GPUKV_TEST_CUDA=1);
#   2. the match benchmarks (bench/test_match.py) with gpukv on `cuda`, the
#      Python baseline and the list conversion beside them, and the report.
#
# Everything lands in $OUT (default /tmp/gpukv-gpu): gpu.txt, tests_cuda.log,
# bench_cuda.log, match_cuda.json, match_cuda.md. The trace comes from
# $GPUKV_TRACE or shared/data/ in or next to the checkout. Budget: TEST_TIMEOUT
# and BENCH_TIMEOUT seconds (default 240 each; the first run compiles every
# kernel for the GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpukv-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import sys; from gpukv.cli import main; sys.exit(main(['info']))" 2>&1 | tee -a "$OUT/gpu.txt"

# The GPU parameters carry the `cudasim` mark; GPUKV_TEST_CUDA=1 runs them on `cuda`.
GPUKV_TEST_CUDA=1 timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider -m "cudasim and not slow" \
    -o addopts="" tests 2>&1 | tee "$OUT/tests_cuda.log"
echo "tests exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/tests_cuda.log"

GPUKV_BENCH_BACKEND=cuda timeout "${BENCH_TIMEOUT:-240}" $PY -m pytest -q -p no:cacheprovider bench/test_match.py \
    --benchmark-only --benchmark-json="$OUT/match_cuda.json" 2>&1 | tee "$OUT/bench_cuda.log"
echo "bench exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/bench_cuda.log"
[ -s "$OUT/match_cuda.json" ] && $PY bench/tools/report.py "$OUT/match_cuda.json" | tee "$OUT/match_cuda.md"
