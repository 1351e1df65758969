#!/usr/bin/env bash
# run_recompute_bench.sh [BUILD_DIR]: checkpointed training with the step in the backward, before and after two
# changes, side by side in one call on one GPU, with FSDP2 at the same shapes:
#   BMT_KEEP_FOR_RECOMPUTE   the attention's output and log-sum-exp kept from the first run (recompute_keep.h), so
#                            the recompute skips the attention's forward
#   BMT_GRADIENT_HANDOVER    one rank: the optimizer reads the parameters' bf16 gradients (no fp32 copy first)
# Runs alternate old / new so that a drift of the machine shows as a spread, not as a gain.
#   RC_BENCH_ONLY=REGEX  only the run ids matching REGEX;  RC_BENCH_BUDGET_S=480  wall-clock budget
# Results: bench/results/<date>-<machine>.jsonl (appended), $OUT/rc_bench/ (each run's log and JSON, table.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
BIN=$BUILD/bench/bmt-bench-train
. bench/bench_lib.sh
bench_setup rc_bench "${RC_BENCH_BUDGET_S:-480}" "${RC_BENCH_ONLY:-}" 29870 240
run() { bench_run "$@"; }
OLD=BMT_KEEP_FOR_RECOMPUTE=0,BMT_GRADIENT_HANDOVER=0
NEW=BMT_KEEP_FOR_RECOMPUTE=1,BMT_GRADIENT_HANDOVER=1
S13=(--preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 5 --checkpointing --step-in-backward)
S67=(--preset gpt-6.7b --seq 2048 --batch 2 --warmup 2 --steps 4 --checkpointing --step-in-backward)
run old_1p3b "$OLD" "$BIN" --framework bmt "${S13[@]}"
run new_1p3b "$NEW" "$BIN" --framework bmt "${S13[@]}"
run keep_only_1p3b BMT_KEEP_FOR_RECOMPUTE=1,BMT_GRADIENT_HANDOVER=0 "$BIN" --framework bmt "${S13[@]}"
run handover_only_1p3b BMT_KEEP_FOR_RECOMPUTE=0,BMT_GRADIENT_HANDOVER=1 "$BIN" --framework bmt "${S13[@]}"
run old_1p3b_b "$OLD" "$BIN" --framework bmt "${S13[@]}"
run new_1p3b_b "$NEW" "$BIN" --framework bmt "${S13[@]}"
run new_1p3b_profile "$NEW" "$BIN" --framework bmt "${S13[@]}" --profile
# The plain 1.3B step (no checkpointing) also goes through nn::causal_attention now: issue 17's 64K row.
run plain_1p3b - "$BIN" --framework bmt --preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 5
run fsdp2_1p3b_ckpt - python3 bench/fsdp2_gpt.py --preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 5 --checkpointing
run old_6p7b "$OLD" "$BIN" --framework bmt "${S67[@]}"
run new_6p7b "$NEW" "$BIN" --framework bmt "${S67[@]}"
run new_6p7b_profile "$NEW" "$BIN" --framework bmt "${S67[@]}" --profile
run fsdp2_6p7b_ckpt - python3 bench/fsdp2_gpt.py --preset gpt-6.7b --seq 2048 --batch 2 --warmup 2 --steps 4 --checkpointing
bench_table
