#!/usr/bin/env bash
# Issue 17 items 5 and 2 in one GPU call (one H200, about 5 minutes), on a CUDA build that already exists:
#
#   scripts/gpu_fidelity_check.sh BUILD_DIR        e.g. scripts/gpu_fidelity_check.sh /tmp/b
#
# 1. tests/cuda/bmt_fidelity_cuda_tests: GPT-2 124M (seq 1024, batch 16, bmt-bench-train's batches and AdamW), 50
#    steps of ZeRO-3 / ZeRO-2 / checkpointing / offload against the same-numerics plain-LibTorch reference (per-step
#    losses within 1e-2), with the per-step table (reference, each variant, the benchmark's plain autocast path from
#    the same init, skipped flags, loss scale) -> $OUT/fidelity.log
# 2. bmt-bench-train gpt-6.7b seq 2048 b2 --checkpointing, 3 steps, --memory-breakdown and --memory-snapshot ->
#    $OUT/mem_6.7b.log, $OUT/mem_6.7b.pickle and its peak summary $OUT/mem_6.7b_peak.txt
#    (tools/memory_snapshot_peak.py), then the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#    (fragmentation) -> $OUT/mem_6.7b_expandable.log
# Writes to $OUT when set (else /tmp/bmt-fidelity-out). Exit status: that of the fidelity test, else of a run.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:?usage: scripts/gpu_fidelity_check.sh BUILD_DIR (a CUDA build: scripts/build.sh cuda)}
OUT=${OUT:-/tmp/bmt-fidelity-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
rc=0
test_bin=$(find "$B" -name bmt_fidelity_cuda_tests -type f -perm -u+x | head -1)
bench_bin=$(find "$B" -name bmt-bench-train -type f -perm -u+x | head -1)
[ -n "$test_bin" ] || { echo "no bmt_fidelity_cuda_tests under $B (ninja -C $B bmt_fidelity_cuda_tests)"; exit 1; }
[ -n "$bench_bin" ] || { echo "no bmt-bench-train under $B (ninja -C $B bmt-bench-train)"; exit 1; }

t0=$(date +%s)
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 240 "$test_bin" --gtest_brief=0 > "$OUT/fidelity.log" 2>&1 || rc=$?
echo "[fidelity] exit $rc, $(( $(date +%s) - t0 )) s"
grep -E "^step|^ *[0-9]+  [0-9]|max \|ours|FAILED|Failure" "$OUT/fidelity.log" | head -80

t0=$(date +%s)
BMT_MEMORY_SNAPSHOT_ENTRIES=${BMT_MEMORY_SNAPSHOT_ENTRIES:-100000} timeout 150 "$bench_bin" --framework bmt \
  --preset gpt-6.7b --seq 2048 --batch 2 --checkpointing --steps 2 --warmup 1 --memory-breakdown \
  --memory-snapshot "$OUT/mem_6.7b.pickle" > "$OUT/mem_6.7b.log" 2>&1
r=$?; [ $rc -ne 0 ] || rc=$r
echo "[memory 6.7b] exit $r, $(( $(date +%s) - t0 )) s"
grep -E "memory breakdown|^  |RESULT|error" "$OUT/mem_6.7b.log" | head -30
if [ -f "$OUT/mem_6.7b.pickle" ]; then
  python3 tools/memory_snapshot_peak.py "$OUT/mem_6.7b.pickle" > "$OUT/mem_6.7b_peak.txt" 2>&1
  head -40 "$OUT/mem_6.7b_peak.txt"
fi

t0=$(date +%s)
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 120 "$bench_bin" --framework bmt --preset gpt-6.7b \
  --seq 2048 --batch 2 --checkpointing --steps 2 --warmup 1 --memory-breakdown > "$OUT/mem_6.7b_expandable.log" 2>&1
r=$?; [ $rc -ne 0 ] || rc=$r
echo "[memory 6.7b expandable_segments] exit $r, $(( $(date +%s) - t0 )) s"
grep -E "memory breakdown|^  |RESULT|error" "$OUT/mem_6.7b_expandable.log" | head -30
exit $rc
