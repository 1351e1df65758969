#!/usr/bin/env bash
# CI check (scripts/test.sh): the Python package configures and builds with the system's gloo and nlohmann-json
# hidden, so the day a build file or a source file reaches for a system copy again (a find_path, an include dir, an
# #include of a header the repository does not carry) this fails. In a private mount namespace (`unshare -m` as root,
# a user namespace otherwise) an empty read-only tmpfs covers every system directory of those two packages (headers
# and CMake package files); in there it configures a fresh build folder with pyproject.toml's CMake definitions
# (what `pip install .` configures; CPU-only, as what these headers serve does not depend on CUDA) and compiles
# every translation unit that includes gloo, c10d's Gloo headers or nlohmann-json (with the precompiled header they
# need); ccache, set up as scripts/build.sh does, serves them from the CPU build when it has compiled them.
# It also checks that the sdist carries those headers. Usage: scripts/check_no_system_deps.sh [build folder]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-nosys}
if [ -z "${BMT_NOSYS_INSIDE:-}" ]; then
  if [ "$(id -u)" = 0 ]; then ns=(unshare --mount --propagation private); else ns=(unshare --user --map-root-user --mount); fi
  "${ns[@]}" true 2> /dev/null || {
    echo "[nosys] FAIL: cannot make a private mount namespace (${ns[*]}): run as root or allow user namespaces" >&2
    exit 1
  }
  exec env BMT_NOSYS_INSIDE=1 "${ns[@]}" bash "$0" "$@"
fi

start=$(date +%s)
hidden=()
for d in /usr/include/gloo /usr/include/nlohmann /usr/local/include/gloo /usr/local/include/nlohmann \
         /usr/share/cmake/Gloo /usr/share/cmake/nlohmann_json /usr/lib/*/cmake/Gloo /usr/lib/*/cmake/nlohmann_json \
         /usr/share/pkgconfig/nlohmann_json.pc; do
  [ -e "$d" ] || continue
  if [ -d "$d" ]; then mount -t tmpfs -o ro,size=4k none "$d"; else mount --bind /dev/null "$d"; fi
  hidden+=("$d")
done
for h in /usr/include/gloo/context.h /usr/include/nlohmann/json.hpp; do
  if [ -e "$h" ]; then echo "[nosys] FAIL: $h is still visible" >&2; exit 1; fi
done
echo "[nosys] hidden: ${hidden[*]:-(none of them is installed here)}"

# pyproject.toml's [tool.scikit-build.cmake.define], as -D flags.
PY=${PYTHON:-python3}
mapfile -t defines < <("$PY" -c '
import tomllib
with open("pyproject.toml", "rb") as f:
    d = tomllib.load(f)["tool"]["scikit-build"]["cmake"]["define"]
for k, v in d.items():
    print(f"-D{k}={v}")
')
launcher=()
if command -v ccache > /dev/null 2>&1; then  # as scripts/build.sh: shared objects, PCH-aware
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache "-DCMAKE_CXX_FLAGS=-fpch-preprocess")
  export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
fi
rm -rf "$dir" && mkdir -p "$dir"  # a fresh configure: a cached find result would hide a new system dependency
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBMT_WITH_CUDA=OFF -DPython3_EXECUTABLE="$(command -v "$PY")" \
  "${defines[@]}" "${launcher[@]}" ${BMT_CMAKE_ARGS:-} > "$dir/configure.log" 2>&1 \
  || { tail -30 "$dir/configure.log"; echo "[nosys] FAIL: configure (log: $dir/configure.log)" >&2; exit 1; }
configured=$(date +%s)

# The translation units that include gloo, c10d's Gloo headers or nlohmann-json, directly or through one of our
# headers that does; their object files as ninja names them.
pattern='^\s*#\s*include\s*[<"](gloo/|nlohmann/|torch/csrc/distributed/c10d/(ProcessGroupGloo|GlooDeviceFactory))'
mapfile -t headers < <(grep -rlE "$pattern" src python/csrc tools --include='*.h' --include='*.hpp' || true)
names=$(printf '%s\n' "${headers[@]}" | sed -n 's|.*/||p' | paste -sd'|')
tu_pattern=$pattern
[ -n "$names" ] && tu_pattern="$pattern|^\\s*#\\s*include\\s*[<\"]([^>\"]*/)?(${names//./\\.})[>\"]"
mapfile -t objects < <("$PY" - "$dir/compile_commands.json" "$tu_pattern" <<'EOF'
import json, os, re, shlex, sys
entries, pattern = json.load(open(sys.argv[1])), re.compile(sys.argv[2], re.M)
for e in entries:
    src = os.path.join(e["directory"], e["file"])
    if pattern.search(open(src, errors="replace").read()):
        args = shlex.split(e["command"])
        out = e.get("output") or args[args.index("-o") + 1]
        print(os.path.relpath(os.path.join(e["directory"], out), os.path.dirname(sys.argv[1])))
EOF
)
if [ ${#objects[@]} -lt 2 ]; then  # the Gloo communicator and the checkpoint JSON, at least
  echo "[nosys] FAIL: found ${#objects[@]} translation units using gloo/nlohmann-json (${objects[*]:-}); expected >= 2" >&2
  exit 1
fi
ninja -C "$dir" -j"${BMT_JOBS:-$(nproc)}" "${objects[@]}" > "$dir/build.log" 2>&1 \
  || { grep -E "error|FAILED" -A3 "$dir/build.log" | head -40; echo "[nosys] FAIL: build (log: $dir/build.log)" >&2; exit 1; }
built=$(date +%s)

# The sdist (scikit-build-core's own hook: what `python -m build --sdist` calls) must carry the headers.
sdist_dir=$(mktemp -d)
trap 'rm -rf "$sdist_dir"' EXIT
sdist=$("$PY" -c 'import sys; from scikit_build_core.build import build_sdist; print(build_sdist(sys.argv[1]))' "$sdist_dir" | tail -1)
listing=$(tar -tzf "$sdist_dir/$sdist")
for f in third_party/gloo/gloo/context.h third_party/gloo/LICENSE third_party/nlohmann_json/nlohmann/json.hpp \
         third_party/nlohmann_json/LICENSE.MIT cmake/BmtDependencies.cmake; do
  grep -q "/$f\$" <<< "$listing" || { echo "[nosys] FAIL: the sdist ($sdist) lacks $f" >&2; exit 1; }
done
echo "[nosys] ok: configure $((configured - start)) s, ${#objects[@]} translation units $((built - configured)) s" \
     "(${objects[*]##*/}), sdist $(($(date +%s) - built)) s"
