#!/usr/bin/env bash
# Configures and builds one configuration: scripts/build.sh [cpu|cuda] [ninja targets...]
#   cpu  -> build/      (BMT_WITH_CUDA=OFF)
#   cuda -> build-cuda/ (BMT_WITH_CUDA=ON; needs nvcc and NCCL)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-cpu}
shift || true
if [ "$kind" = cuda ]; then
  dir=build-cuda
  export PATH="$PATH:/usr/local/cuda/bin"
  flags=(-DBMT_WITH_CUDA=ON)
else
  dir=build
  flags=(-DBMT_WITH_CUDA=OFF)
fi
# ccache (when installed) lets several build folders and worktrees share compiled objects.
if command -v ccache >/dev/null 2>&1; then
  flags+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
if [ ! -f "$dir/build.ninja" ]; then
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${flags[@]}" ${BMT_CMAKE_ARGS:-}
fi
ninja -C "$dir" -j"${BMT_JOBS:-$(nproc)}" "$@"
