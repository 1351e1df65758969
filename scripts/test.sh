#!/usr/bin/env bash
# The test command (README, .ci/run): set up, build the CPU configuration and run its `cpu` and `multirank`
# tests; when nvcc is present, also build the CUDA configuration (compile + link of every `cuda` test binary, the
# examples' included; they run on a GPU machine: scripts/gpu_check.sh). A skipped test fails the run unless
# tests/allowed_skips.txt allows it with a reason (scripts/check_skips.py reads CTest's and pytest's own reports).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The include graph of src/bmt: no cycles, no include running up the layers, no re-declared functions (seconds).
python3 scripts/check_includes.py
start=$(date +%s)
bash scripts/build.sh cpu
echo "[test] CPU build done in $(( $(date +%s) - start )) s"
# The package builds with the system's gloo and nlohmann-json hidden (no system dependency crept back): a fresh
# configure plus the translation units that use them, from ccache after the build above.
start=$(date +%s)
bash scripts/check_no_system_deps.sh
echo "[test] no-system-dependency check done in $(( $(date +%s) - start )) s"
( cd build && ctest --output-on-failure -j2 -L 'cpu|multirank' --timeout 900 ) 2>&1 | tee build/ctest_cpu.log
# The installed package: headers, libbmtrain and find_package(bmtrain), through a consumer (tests/package/).
start=$(date +%s)
bash scripts/check_package.sh
echo "[test] package check done in $(( $(date +%s) - start )) s"
# The Python package: installed from the build above (nothing recompiles), then its tests on CPU ranks (torchrun,
# Gloo) against the installed copy.
start=$(date +%s)
bash scripts/install_python.sh cpu
( cd tests/python && OMP_NUM_THREADS=1 python3 -m pytest -q -rs -p no:cacheprovider . ) 2>&1 | tee build/pytest_cpu.log
echo "[test] Python package install + tests done in $(( $(date +%s) - start )) s"
python3 scripts/check_skips.py --device cpu ctest:build/ctest_cpu.log pytest:build/pytest_cpu.log
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  start=$(date +%s)
  # Library, tools and every `cuda` test binary (the CUDA-graph and fidelity tests need the examples): the CPU
  # tests were built and run above. A build-cuda/ configured earlier without the examples is switched on.
  BMT_CMAKE_ARGS="-DBMT_BUILD_EXAMPLES=ON" bash scripts/build.sh cuda build.ninja
  if grep -q '^BMT_BUILD_EXAMPLES:BOOL=OFF' build-cuda/CMakeCache.txt; then
    cmake -S . -B build-cuda -DBMT_BUILD_EXAMPLES=ON > /dev/null
  fi
  targets=$(ninja -C build-cuda -t targets all | grep -oE '^[A-Za-z0-9_-]*cuda_tests:' | tr -d ':' | sort -u | tr '\n' ' ')
  for t in bmt_fidelity_cuda_tests bmt_graph_cuda_tests; do  # a missing one would silently go uncompiled
    case " $targets " in *" $t "*) ;; *) echo "[test] FAIL: CUDA test target $t is not configured"; exit 1 ;; esac
  done
  bash scripts/build.sh cuda bmt bmtrun bmt-bench-comm $targets
  echo "[test] CUDA build (compile + link only, no GPU here) done in $(( $(date +%s) - start )) s"
fi
