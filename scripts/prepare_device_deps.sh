#!/usr/bin/env bash
# Copies what the GPU machine lacks and cannot download (it has no network) into .deps/ (git-ignored), to be
# carried with a device run: GoogleTest's sources (the C++ tests' only dependency not in the repository; gloo's and
# nlohmann-json's headers are in third_party/).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
[ -d .deps/googletest ] || cp -r /usr/src/googletest .deps/googletest
du -sh .deps
