#!/usr/bin/env bash
# Installs the CPU build into a temporary prefix and builds + runs a consumer that uses find_package(bmtrain)
# (tests/package/). Not part of CI (it re-configures LibTorch for the consumer); run after scripts/build.sh cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=$(mktemp -d)
work=$(mktemp -d)
cmake --install build --prefix "$prefix" > /dev/null
cp tests/package/consumer.cmake.txt "$work/CMakeLists.txt"
cp tests/package/main.cpp "$work/"
cmake -S "$work" -B "$work/b" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
ninja -C "$work/b" > /dev/null
MASTER_PORT=${MASTER_PORT:-29777} "$work/b/consumer"
rm -rf "$prefix" "$work"
