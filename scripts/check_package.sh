#!/usr/bin/env bash
# Installs the CPU build (build/) into a prefix and builds + runs a consumer that uses find_package(bmtrain)
# (tests/package/): every installed header must compile without the implementation-only ones. Run after
# scripts/build.sh cpu; scripts/test.sh (CI) runs it. Cheap on a rerun: the prefix and the consumer's build live
# under build/package_check/, the prefix is installed afresh (no stale header survives) but with the sources'
# timestamps, so the consumer is configured once and recompiled only when an installed header changed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD/build/package_check
prefix=$root/prefix
work=$root/consumer
rm -rf "$prefix"
mkdir -p "$work"
cmake --install build --prefix "$prefix" > /dev/null
for f in tests/package/consumer.cmake.txt:CMakeLists.txt tests/package/main.cpp:main.cpp; do
  cmp -s "${f%%:*}" "$work/${f##*:}" || cp "${f%%:*}" "$work/${f##*:}"
done
if [ ! -f "$work/b/build.ninja" ]; then
  cmake -S "$work" -B "$work/b" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
fi
ninja -C "$work/b" > /dev/null
MASTER_PORT=${MASTER_PORT:-29777} "$work/b/consumer"
