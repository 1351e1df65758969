#!/usr/bin/env bash
# Copies what the GPU machine lacks and cannot download (it has no network) into .deps/ (git-ignored), to be
# carried with a device run: GoogleTest's sources, gloo's headers and nlohmann-json's headers (CMake finds the
# latter under BMT_GLOO_INCLUDE_DIR=.deps/include).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/include
[ -d .deps/googletest ] || cp -r /usr/src/googletest .deps/googletest
[ -d .deps/include/gloo ] || cp -r /usr/include/gloo .deps/include/gloo
[ -d .deps/include/nlohmann ] || cp -r /usr/include/nlohmann .deps/include/nlohmann
du -sh .deps
