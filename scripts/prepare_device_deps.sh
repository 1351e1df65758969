#!/usr/bin/env bash
# Copies what the GPU machine lacks and cannot download (it has no network) into .deps/ (git-ignored), to be
# carried with a device run: GoogleTest's sources and gloo's headers.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/include
[ -d .deps/googletest ] || cp -r /usr/src/googletest .deps/googletest
[ -d .deps/include/gloo ] || cp -r /usr/include/gloo .deps/include/gloo
du -sh .deps
