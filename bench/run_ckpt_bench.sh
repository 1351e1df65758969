#!/usr/bin/env bash
# run_ckpt_bench.sh [BUILD_DIR]: checkpoint I/O on one GPU machine in one call (issue 19, issue 17 item 4):
# bmt-bench-ckpt per preset, world 1, with the disk's own dd figures measured in the same process (--disk-gib),
# cold loads (--drop-cache: the whole page cache when root) and the per-stage profile (--profile).
#
#   BUILD_DIR              the build holding bench/bmt-bench-ckpt (default /tmp/b; not built here)
#   CKPT_PRESETS=gpt-1.3b  space-separated presets, run in order while time is left. gpt-1.3b with its fp32 Adam
#                          state writes 18.4 GB per checkpoint (and an async save pins as much host memory).
#                          llama-7b with Adam state is ~100 GB per checkpoint: more than a 64 GB disk holds (the
#                          preset is skipped when the disk's free space is under 2.2x its checkpoint size).
#   CKPT_REPEAT=2          repeats per op (median reported)
#   CKPT_DISK_GIB=8        size of the dd files
#   CKPT_BUDGET_S=450      wall-clock budget; a preset starts only while its estimated time fits
#   CKPT_DIR               where checkpoints go (default a fresh directory under /tmp, removed after)
#   CKPT_DIRECT_PASS=1     then, while >= 150 s are left, one more sharded save + load of the first preset with
#                          BMT_CKPT_DIRECT=1 (O_DIRECT shard writes; the load after it is cold): 0 drops it
# Output: the first async save's stall per preset (a line "first save stall"), the bench's table and RESULT line (with the ratios to dd: save_sharded, save_safetensors against dd write
# with fsync; load_sharded warm and cold against dd's warm and cold read, and each load's two parts on their own:
# load_sharded[_cold].model / .state, the model's tensors and the optimizer state, each read into place); JSON lines in $OUT/bench_ckpt/ckpt.jsonl when $OUT is set (else in
# a temporary directory, printed at the end), plus each preset's log.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-/tmp/b}
BIN=$BUILD/bench/bmt-bench-ckpt
PRESETS=${CKPT_PRESETS:-gpt-1.3b}
REPEAT=${CKPT_REPEAT:-2}
DISK_GIB=${CKPT_DISK_GIB:-8}
BUDGET=${CKPT_BUDGET_S:-450}
start=$(date +%s)
[ -x "$BIN" ] || { echo "run_ckpt_bench: $BIN not found (build the bmt-bench-ckpt target first)"; exit 1; }
LOGDIR=${OUT:+$OUT/bench_ckpt}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/bench_ckpt.XXXXXX)}
mkdir -p "$LOGDIR"
JSON=$LOGDIR/ckpt.jsonl
BASE=${CKPT_DIR:-$(mktemp -d /tmp/bmt-ckpt-bench.XXXXXX)}
mkdir -p "$BASE"
echo "run_ckpt_bench: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM, $(df -h "$BASE" | awk 'NR==2{print $4}') free in $BASE, uid $(id -u)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1

declare -A CKPT_GB=([gpt-1.3b]=19 [gpt2-124m]=2 [llama-7b]=100 [tiny]=1)
declare -A EST_S=([gpt-1.3b]=300 [gpt2-124m]=60 [llama-7b]=900 [tiny]=20)
for preset in $PRESETS; do
  left=$(( BUDGET - ($(date +%s) - start) ))
  need_s=${EST_S[$preset]:-300}
  if [ "$left" -lt "$need_s" ]; then echo "run_ckpt_bench: skipping $preset: ${left}s left, needs ~${need_s}s"; continue; fi
  free_gb=$(df -BG --output=avail "$BASE" | tail -1 | tr -dc 0-9)
  need_gb=$(( ${CKPT_GB[$preset]:-20} * 22 / 10 ))
  if [ "$free_gb" -lt "$need_gb" ]; then echo "run_ckpt_bench: skipping $preset: ${free_gb} GB free, needs ~${need_gb} GB"; continue; fi
  ops=safetensors,sharded,async
  echo "=== $preset (ops $ops, repeat $REPEAT, dd ${DISK_GIB} GiB; timeout ${left}s)"
  timeout --kill-after=10 "$left" "$BIN" --preset "$preset" --repeat "$REPEAT" --ops "$ops" --disk-gib "$DISK_GIB" \
      --drop-cache --profile --dir "$BASE/$preset" --json "$JSON" 2>&1 | tee "$LOGDIR/$preset.log"
  echo "run_ckpt_bench: $preset exit ${PIPESTATUS[0]} after $(( $(date +%s) - start ))s"
  rm -rf "$BASE/$preset"
done
first=${PRESETS%% *}
left=$(( BUDGET - ($(date +%s) - start) ))
if [ "${CKPT_DIRECT_PASS:-1}" = 1 ] && [ "$left" -ge 150 ]; then
  echo "=== $first with O_DIRECT shard writes (BMT_CKPT_DIRECT=1; sharded only, repeat 1; timeout ${left}s)"
  BMT_CKPT_DIRECT=1 timeout --kill-after=10 "$left" "$BIN" --preset "$first" --repeat 1 --ops sharded --profile \
      --dir "$BASE/$first-direct" 2>&1 | tee "$LOGDIR/$first-direct.log"
  rm -rf "$BASE/$first-direct"
fi
[ -z "${CKPT_DIR:-}" ] && rm -rf "$BASE"
# The first async save's stall per preset (its buffers pinned ahead by prepare_async_save; issue 36 item 9).
for preset in $PRESETS; do
  [ -f "$LOGDIR/$preset.log" ] && grep -h "first save stall" "$LOGDIR/$preset.log" | sed "s/^/run_ckpt_bench: $preset: /"
done
echo "run_ckpt_bench: JSON lines in $JSON"
