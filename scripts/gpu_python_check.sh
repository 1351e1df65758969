#!/usr/bin/env bash
# On a GPU machine (carrying .deps: scripts/prepare_device_deps.sh): builds the CUDA configuration's library, the
# Python extension and the C++ training benchmark, runs the Python package's tests on the GPUs (NCCL, one process
# per GPU: BMT_TEST_DEVICE=cuda) and then bench/run_python_bench.sh (the Python GPT vs bmt-bench-train, side by
# side). Logs go to $OUT. Exits non-zero when the build, a test or the benchmark fails, when the test folder is
# missing, or on a pytest skip that tests/allowed_skips.txt does not allow (scripts/check_skips.py --device cuda).
#   BMT_GPU_BUILD (build-gpu)   build folder, reused when warm
#   BMT_PY_TESTS (tests/python) the pytest folder to run; BMT_PY_BENCH=0 skips the benchmark
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bmt-gpu-out}
mkdir -p "$OUT"
BUILD=${BMT_GPU_BUILD:-build-gpu}
start=$(date +%s)
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBMT_WITH_CUDA=ON -DBMT_BUILD_PYTHON=ON \
    -DPython3_EXECUTABLE="$(command -v python3)" \
    -DBMT_GTEST_SOURCE_DIR="$PWD/.deps/googletest" > "$OUT/configure.log" 2>&1 \
    || { tail -40 "$OUT/configure.log"; exit 1; }
fi
ninja -C "$BUILD" -j"$(nproc)" bmt bmt_python bmt-bench-train ${BMT_GPU_TARGETS:-} > "$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
echo "[gpu] build: $(( $(date +%s) - start )) s"
case $BUILD in /*) build_abs=$BUILD ;; *) build_abs=$PWD/$BUILD ;; esac
export PYTHONPATH="$build_abs/python${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import bmtrain, torch; print('[gpu] bmtrain', bmtrain.__version__, '| torch', torch.__version__, '|', torch.cuda.device_count(), 'GPUs')" || exit 1
rc=0
TESTS=${BMT_PY_TESTS:-tests/python}
if [ -d "$TESTS" ]; then
  ( cd "$TESTS" && BMT_TEST_DEVICE=cuda timeout -k 10 "${BMT_PY_TEST_BUDGET:-300}" python3 -m pytest -q -rs -p no:cacheprovider . ) \
    > "$OUT/pytest_cuda.log" 2>&1 || rc=1
  tail -25 "$OUT/pytest_cuda.log"
  python3 scripts/check_skips.py --device cuda "pytest:$OUT/pytest_cuda.log" || rc=1
else
  echo "[gpu] FAIL: test folder $TESTS does not exist"
  rc=1
fi
if [ "${BMT_PY_BENCH:-1}" = 1 ]; then
  bash bench/run_python_bench.sh "$BUILD" || { echo "[gpu] FAIL: bench/run_python_bench.sh exited $?"; rc=1; }
fi
exit $rc
