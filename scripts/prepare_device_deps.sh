#!/usr/bin/env bash
# Copies what the GPU machine lacks and cannot download (it has no network) into .deps/ (git-ignored), to be
# carried with a device run: GoogleTest's sources (the C++ tests' only dependency not in the repository; gloo's and
# nlohmann-json's headers are in third_party/) and torchao's wheel (the FP8 peer rows).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
[ -d .deps/googletest ] || cp -r /usr/src/googletest .deps/googletest
# torchao's wheel for the FSDP2 + torchao float8 rows (bench/run_torchops_bench.sh, TORCHOPS_FP8=1); optional
mkdir -p .deps/wheels
ls .deps/wheels/torchao-*.whl >/dev/null 2>&1 || pip download -q --no-deps torchao -d .deps/wheels \
  || echo "prepare_device_deps: torchao not downloaded (no network?): the FP8 bench runs without its FSDP2 rows"
du -sh .deps
