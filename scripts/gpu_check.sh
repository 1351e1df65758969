#!/usr/bin/env bash
# On the GPU machine (after scripts/prepare_device_deps.sh here, carrying .deps): build the CUDA configuration
# (targets given by BMT_GPU_TARGETS, default all), run every `cuda` test binary, the runtime demo, and then each
# extra command given as an argument (benchmarks). Logs go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/bmt-gpu-out}
mkdir -p "$OUT"
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DBMT_WITH_CUDA=ON \
  -DBMT_GTEST_SOURCE_DIR="$PWD/.deps/googletest" -DBMT_GLOO_INCLUDE_DIR="$PWD/.deps/include" > "$OUT/configure.log" 2>&1 \
  || { tail -30 "$OUT/configure.log"; exit 1; }
ninja -C build-gpu -j"$(nproc)" ${BMT_GPU_TARGETS:-all} > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
echo "[gpu] build: $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for t in build-gpu/tests/*/bmt_*cuda_tests; do
  echo "[gpu] $t"
  "$t" --gtest_brief=1 2>&1 | tee -a "$OUT/cuda_tests.log" | grep -E "PASSED|FAILED|SKIPPED|Failure|tests ran" | head -20
done
build-gpu/tools/bmtrun --nproc "$(nvidia-smi -L | wc -l)" build-gpu/tools/bmt-demo-runtime 2>&1 | tail -4
for cmd in "$@"; do echo "[gpu] $cmd"; bash -c "$cmd" 2>&1 | tee -a "$OUT/extra.log" | tail -40; done
