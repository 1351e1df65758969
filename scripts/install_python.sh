#!/usr/bin/env bash
# Installs the Python package bmtrain into the current Python (pip, against the installed torch) from a build
# folder that scripts/build.sh already configured and built: scikit-build-core re-runs the same CMake
# configuration there, so nothing recompiles, and installs the `python` component (bmtrain._C, libbmtrain and the
# Python sources). Usage: scripts/install_python.sh [cpu|cuda]   (default cpu -> build/, cuda -> build-cuda/)
# On a machine without a configured build folder, plain `pip install --no-build-isolation .` builds from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-cpu}
dir=build
cuda=OFF
if [ "$kind" = cuda ]; then dir=build-cuda; cuda=ON; fi
if [ ! -f "$dir/CMakeCache.txt" ]; then
  echo "[install_python] $dir is not configured: run scripts/build.sh $kind first" >&2
  exit 1
fi
# The same cache values scripts/build.sh configured, so the re-configure changes no compile flags.
examples=$(grep -E '^BMT_BUILD_EXAMPLES:' "$dir/CMakeCache.txt" | cut -d= -f2)
PY=${PYTHON:-python3}
pip_args=(-q)
if "$PY" -c 'import sys, sysconfig, os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")) else 1)'; then
  pip_args+=(--break-system-packages)
fi
start=$(date +%s)
"$PY" -m pip install "${pip_args[@]}" --no-build-isolation --no-deps . -Cbuild-dir="$dir" \
  -Ccmake.define.BUILD_TESTING=ON -Ccmake.define.BMT_BUILD_EXAMPLES="${examples:-ON}" \
  -Ccmake.define.BMT_BUILD_BENCHMARKS=ON -Ccmake.define.BMT_WITH_CUDA="$cuda"
echo "[install_python] bmtrain installed from $dir in $(( $(date +%s) - start )) s: $("$PY" -c 'import bmtrain, os; print(os.path.dirname(bmtrain.__file__))' 2>/dev/null | tail -1)"
