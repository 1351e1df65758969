#!/usr/bin/env bash
# run_step_kernels_bench.sh [BUILD_DIR]: the training step with our column-reduction kernels (a Linear's bias
# gradient, LayerNorm's weight/bias gradients; core/kernels/column_reduce) against the same step with torch's
# (BMT_FUSED_REDUCTIONS=0), side by side in one call on one GPU, with FSDP2 at the same shapes as the peer.
# Runs alternate torch / ours so that a drift of the machine shows as a spread, not as a gain. GPT-124M eager
# and with --cuda-graphs, GPT-1.3B default and --step-in-backward, one profiled 124M run of each.
#
#   STEP_BENCH_ONLY=REGEX  only the run ids matching REGEX;  STEP_BENCH_BUDGET_S=420  wall-clock budget
# Results: bench/results/<date>-<machine>.jsonl (appended), $OUT/step_bench/ (each run's log and JSON).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
BIN=$BUILD/bench/bmt-bench-train
. bench/bench_lib.sh
bench_setup step_bench "${STEP_BENCH_BUDGET_S:-420}" "${STEP_BENCH_ONLY:-}" 29710 200
# id, reductions (0 torch / 1 ours / - not ours), command...
run() {
  local id=$1 fused=$2
  shift 2
  bench_run "$id" "$([ "$fused" = - ] && echo - || echo "BMT_FUSED_REDUCTIONS=$fused")" "$@"
}
S124=(--preset gpt2-124m --seq 1024 --batch 16 --warmup 3 --steps 20)
S13=(--preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 5)
run torch_124m 0 "$BIN" --framework bmt "${S124[@]}"
run ours_124m 1 "$BIN" --framework bmt "${S124[@]}"
run torch_124m_graphs 0 "$BIN" --framework bmt "${S124[@]}" --cuda-graphs
run ours_124m_graphs 1 "$BIN" --framework bmt "${S124[@]}" --cuda-graphs
run ours_124m_b 1 "$BIN" --framework bmt "${S124[@]}"
run torch_124m_b 0 "$BIN" --framework bmt "${S124[@]}"
run ours_124m_graphs_profile 1 "$BIN" --framework bmt "${S124[@]}" --cuda-graphs --profile
run fsdp2_124m - python3 bench/fsdp2_gpt.py --preset gpt2-124m --seq 1024 --batch 16 --warmup 3 --steps 10
run torch_1p3b 0 "$BIN" --framework bmt "${S13[@]}"
run ours_1p3b 1 "$BIN" --framework bmt "${S13[@]}"
run ours_1p3b_sib 1 "$BIN" --framework bmt "${S13[@]}" --step-in-backward
run ours_1p3b_ckpt_sib 1 "$BIN" --framework bmt "${S13[@]}" --checkpointing --step-in-backward
run ours_1p3b_profile 1 "$BIN" --framework bmt "${S13[@]}" --profile
run fsdp2_1p3b - python3 bench/fsdp2_gpt.py "${S13[@]}"
bench_table
