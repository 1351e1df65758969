#!/usr/bin/env bash
# On the GPU machine (after scripts/prepare_device_deps.sh here, carrying .deps): build the CUDA configuration,
# run the `cuda` tests, the runtime demo and the benchmarks given as arguments. Logs go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/bmt-gpu-out}
mkdir -p "$OUT"
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DBMT_WITH_CUDA=ON \
  -DBMT_GTEST_SOURCE_DIR="$PWD/.deps/googletest" -DBMT_GLOO_INCLUDE_DIR="$PWD/.deps/include" > "$OUT/configure.log" 2>&1 \
  || { tail -30 "$OUT/configure.log"; exit 1; }
ninja -C build-gpu -j"$(nproc)" > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; exit 1; }
echo "[gpu] build: $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
(cd build-gpu && ctest -L cuda --output-on-failure --timeout 300 2>&1 | tee "$OUT/ctest_cuda.log" | tail -25)
build-gpu/tools/bmtrun --nproc 1 build-gpu/tools/bmt-demo-runtime 2>&1 | tail -3
for cmd in "$@"; do echo "[gpu] $cmd"; bash -c "$cmd" 2>&1 | tee -a "$OUT/bench.log" | tail -40; done
