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
# Most of our C++ compiles through a precompiled header, which ccache refuses ("could not use precompiled header")
# unless told what may differ (sloppiness) and given -fpch-preprocess; paths relative to the checkout (base dir,
# no hashed working directory) let a clone in another folder, such as CI's, reuse what an earlier build compiled.
if command -v ccache >/dev/null 2>&1; then
  flags+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache
          "-DCMAKE_CXX_FLAGS=${CXXFLAGS:-} -fpch-preprocess")
  export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi
if [ ! -f "$dir/build.ninja" ]; then
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${flags[@]}" ${BMT_CMAKE_ARGS:-}
fi
ninja -C "$dir" -j"${BMT_JOBS:-$(nproc)}" "$@"
