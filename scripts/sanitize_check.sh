#!/usr/bin/env bash
# ASan + UBSan check of the library and its CPU test suite: configures build-asan/ (CPU only, BMT_SANITIZE,
# no Python module, examples and benchmarks off unless BMT_SANITIZE_EXAMPLES=1), builds it and runs
# `ctest -L 'cpu|multirank'` with the sanitizer options below, then prints a summary (README.md, "Sanitizers and fuzzing").
#   BMT_SANITIZE=address,undefined  sanitizers (cmake/BmtSanitize.cmake)
#   BMT_JOBS=2                      compile jobs; BMT_SANITIZE_BUILD_ONLY=1 stops after the build;
#                                   BMT_SANITIZE_TARGETS="a b" builds only these ninja targets (default: all)
#   BMT_SANITIZE_CTEST_J=2          ctest -j;     extra arguments are passed to ctest (e.g. -R Checkpoint)
#   BMT_SANITIZE_CMAKE_ARGS="..."   extra configure flags (on the GPU machine: the carried .deps, see gpu_check.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dir=${BMT_SANITIZE_DIR:-build-asan}
sanitizers=${BMT_SANITIZE:-address,undefined}
examples=OFF
[ "${BMT_SANITIZE_EXAMPLES:-0}" = 1 ] && examples=ON
flags=(-DBMT_WITH_CUDA=OFF -DBMT_SANITIZE="$sanitizers" -DBMT_BUILD_PYTHON=OFF -DBMT_BUILD_EXAMPLES=$examples
       -DBMT_BUILD_BENCHMARKS=OFF -DBMT_TEST_TIMEOUT_SCALE="${BMT_SANITIZE_TIMEOUT_SCALE:-3}")
# shellcheck disable=SC2206  # word splitting of the extra flags is intended
flags+=(${BMT_SANITIZE_CMAKE_ARGS:-})
if command -v ccache >/dev/null 2>&1; then
  flags+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
start=$(date +%s)
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${flags[@]}" >/dev/null
ninja -C "$dir" -j"${BMT_JOBS:-$(nproc)}" ${BMT_SANITIZE_TARGETS:-}
build_s=$(( $(date +%s) - start ))
echo "[sanitize] build of $dir ($sanitizers) done in ${build_s} s"
[ "${BMT_SANITIZE_BUILD_ONLY:-0}" = 1 ] && exit 0

# Exported, so every process a test starts inherits them: run_ranks' ranks (fork + exec of the test binary),
# bmtrun's children, the Python interop test's calls of bmt-ckpt.
# Leaks are checked (detect_leaks=1) with the suppressions in tests/sanitize/lsan.supp: each entry names a leak of
# libtorch/gloo/the C runtime that is not ours, with the reason. UBSan findings abort the process
# (-fno-sanitize-recover at compile time, halt_on_error here) so a test cannot pass over one.
export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1:strict_init_order=1:${ASAN_OPTIONS_EXTRA:-}"
export LSAN_OPTIONS="suppressions=$root/tests/sanitize/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$root/tests/sanitize/ubsan.supp"
start=$(date +%s)
set +e
ctest --test-dir "$dir" -L 'cpu|multirank' -j"${BMT_SANITIZE_CTEST_J:-2}" --output-on-failure "$@" 2>&1 \
  | tee "$dir/sanitize_ctest.log"
rc=${PIPESTATUS[0]}
set -e
test_s=$(( $(date +%s) - start ))
log=$dir/Testing/Temporary/LastTest.log
asan=$(grep -c "ERROR: AddressSanitizer" "$log" || true)
lsan=$(grep -c "ERROR: LeakSanitizer" "$log" || true)
ubsan=$(grep -c "runtime error:" "$log" || true)
echo "[sanitize] $(grep -E '[0-9]+% tests passed' "$dir/sanitize_ctest.log" | tail -1)"
echo "[sanitize] reports in the test output: AddressSanitizer $asan, LeakSanitizer $lsan, UBSan $ubsan"
echo "[sanitize] tests took ${test_s} s (build ${build_s} s) on $(nproc) cores; log: $dir/sanitize_ctest.log, $log"
if [ "$rc" -ne 0 ] || [ "$asan" -ne 0 ] || [ "$lsan" -ne 0 ] || [ "$ubsan" -ne 0 ]; then
  echo "[sanitize] FAILED"
  exit 1
fi
echo "[sanitize] clean"
