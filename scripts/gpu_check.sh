#!/usr/bin/env bash
# On the GPU machine (after scripts/prepare_device_deps.sh here, carrying .deps): build the CUDA configuration
# (targets given by BMT_GPU_TARGETS, default all), run every test binary CTest labels `cuda` (one run per binary,
# results read from gtest's XML), the runtime demo, the NCCL fault check when BMT_FAULT_CHECK=1 and 2 GPUs are
# visible (tests/cuda/nccl_fault_check.sh), then each extra command given as an argument (benchmarks).
# Ends with one line "N passed, N failed, N skipped" and exits non-zero on any failed test, any failed check or
# command, and any skipped test this machine should have run (a skip that does not say it needs more GPUs than
# there are, and is not allowed with its reason in tests/allowed_skips.txt). Logs go to $OUT when set; the extra
# commands' new bench/results rows and plots to $OUT/00-results (here: python3 scripts/device_results.py merge
# FILES_AT appends them to bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin" NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/bmt-gpu-out}
mkdir -p "$OUT/gtest"
: > "$OUT/checks"  # "name rc" of the checks that are not gtest binaries
: > "$OUT/gtest/exit_codes"
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DBMT_WITH_CUDA=ON \
  -DBMT_GTEST_SOURCE_DIR="$PWD/.deps/googletest" > "$OUT/configure.log" 2>&1 \
  || { tail -30 "$OUT/configure.log"; echo "[gpu] FAIL: configure"; exit 1; }
ninja -C build-gpu -j"$(nproc)" ${BMT_GPU_TARGETS:-all} > "$OUT/build.log" 2>&1 \
  || { grep -E "error|FAILED" -A3 "$OUT/build.log" | head -60; echo "[gpu] FAIL: build"; exit 1; }
echo "[gpu] build: $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
NGPU=$(nvidia-smi -L | wc -l)

# The cuda-labelled tests as CTest knows them (binaries may be renamed or added): their distinct executables.
(cd build-gpu && ctest -L cuda --show-only=json-v1) > "$OUT/ctest_cuda.json" 2> "$OUT/ctest_list.log"
mapfile -t BINS < <(python3 -c '
import json, sys
seen = []
for t in json.load(open(sys.argv[1])).get("tests", []):
    cmd = t.get("command") or []
    if cmd and cmd[0] not in seen: seen.append(cmd[0])
print("\n".join(seen))' "$OUT/ctest_cuda.json")
[ "${#BINS[@]}" -gt 0 ] && [ -n "${BINS[0]}" ] || { echo "[gpu] FAIL: CTest lists no cuda-labelled test"; exit 1; }
for bin in "${BINS[@]}"; do
  name=$(basename "$bin")
  rm -f "$OUT/gtest/$name.xml"
  t0=$(date +%s)
  timeout 3600 "$bin" --gtest_brief=1 --gtest_output="xml:$OUT/gtest/$name.xml" > "$OUT/gtest/$name.log" 2>&1
  rc=$?
  echo "$name $rc" >> "$OUT/gtest/exit_codes"
  echo "[gpu] $name: exit $rc, $(( $(date +%s) - t0 )) s"
  grep -E "^\[  FAILED  \]|Failure$" "$OUT/gtest/$name.log" | head -20
done

check() {  # name, command...: runs a check that is not a gtest binary, records its exit status
  local name=$1; shift
  echo "[gpu] $name"
  "$@" 2>&1 | tee -a "$OUT/extra.log" | tail -40
  echo "$name ${PIPESTATUS[0]}" >> "$OUT/checks"
}
check "runtime demo" build-gpu/tools/bmtrun --nproc "$NGPU" build-gpu/tools/bmt-demo-runtime
if [ "${BMT_FAULT_CHECK:-0}" = 1 ]; then
  if [ "$NGPU" -ge 2 ]; then check "nccl fault check" bash tests/cuda/nccl_fault_check.sh build-gpu
  else echo "[gpu] nccl fault check: needs 2 GPUs, $NGPU visible (not run)"; fi
fi
# (the benchmarks' new rows and plots into $OUT/00-results, a name that sorts first among the few files a device
# call returns: scripts/device_results.py)
[ "$#" -gt 0 ] && python3 scripts/device_results.py snapshot
for cmd in "$@"; do check "$cmd" bash -c "$cmd"; done
[ "$#" -gt 0 ] && python3 scripts/device_results.py collect "$OUT"

# One summary over every binary's XML, the binaries' exit codes and the other checks.
python3 - "$OUT" "$NGPU" <<'PY'
import os, re, sys
import xml.etree.ElementTree as ET
out, ngpu = sys.argv[1], int(sys.argv[2])
passed = failed = skipped = 0
problems = []
sys.path.insert(0, "scripts")
from check_skips import read_allowed
allowed = {what for kind, what, _ in read_allowed("tests/allowed_skips.txt", "cuda") if kind == "gtest"}
def expected_skip(full, msg):
    m = re.search(r"needs (\d+) GPU", msg)
    if m: return int(m.group(1)) > ngpu          # a multi-GPU test on a machine with fewer GPUs
    return full in allowed                       # anything else only where tests/allowed_skips.txt says why
for line in open(os.path.join(out, "gtest", "exit_codes")):
    name, rc = line.split()
    path = os.path.join(out, "gtest", name + ".xml")
    if not os.path.exists(path):
        failed += 1
        problems.append(f"{name}: no test report (exit {rc}; crashed or timed out? see {name}.log)")
        continue
    failures_here = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        full = f"{case.get('classname')}.{case.get('name')}"
        if case.find("failure") is not None:
            failed += 1; failures_here += 1
            problems.append(f"{name}: FAILED {full}")
        elif case.get("result") == "skipped" or case.find("skipped") is not None:
            skipped += 1
            node = case.find("skipped")
            msg = (node.get("message", "") if node is not None else "") + (node.text or "" if node is not None else "")
            if not expected_skip(full, msg):
                problems.append(f"{name}: SKIPPED {full} although this machine ({ngpu} GPUs) should run it: "
                                f"{msg.strip().splitlines()[-1] if msg.strip() else '(no reason given)'}")
        else:
            passed += 1
    if rc != "0" and failures_here == 0:
        failed += 1
        problems.append(f"{name}: exit {rc} without a failed test (crash at exit?); see {name}.log")
for line in open(os.path.join(out, "checks")):
    name, rc = line.rsplit(" ", 1)
    if rc.strip() == "0": passed += 1
    else:
        failed += 1
        problems.append(f"check '{name}' exited {rc.strip()}")
for p in problems: print("[gpu] " + p)
print(f"[gpu] {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if problems else 0)
PY
