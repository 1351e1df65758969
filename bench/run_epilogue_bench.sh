#!/usr/bin/env bash
# run_epilogue_bench.sh [BUILD_DIR]: the training step with the MLP and residual adds fused into the GEMMs'
# epilogues (nn::gelu_mlp / nn::linear_residual over core/kernels/gemm_epilogue: cuBLASLt GELU_AUX_BIAS,
# DGELU_BGRAD, BIAS + residual) against the same step with separate ops (BMT_GEMM_EPILOGUES=0), side by side in
# one call on one GPU, with FSDP2 at the same shapes. Runs alternate separate / fused so that a drift of the
# machine shows as a spread, not as a gain.
#
# Variants: BMT_GELU_MLP_BACKWARD=dgelu (default) | dgelu_bgrad | separate (nn/fused_linear.h).
#   EPI_BENCH_ONLY=REGEX  only the run ids matching REGEX;  EPI_BENCH_BUDGET_S=480  wall-clock budget
# Results: bench/results/<date>-<machine>.jsonl (appended), $OUT/epi_bench/ (each run's log and JSON, table.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
BIN=$BUILD/bench/bmt-bench-train
. bench/bench_lib.sh
bench_setup epi_bench "${EPI_BENCH_BUDGET_S:-480}" "${EPI_BENCH_ONLY:-}" 29810 240
run() { bench_run "$@"; }
S124=(--preset gpt2-124m --seq 1024 --batch 16 --warmup 3 --steps 20 --cuda-graphs)
S13=(--preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 5)
S67=(--preset gpt-6.7b --seq 2048 --batch 2 --warmup 2 --steps 4 --checkpointing --step-in-backward)
run sep_124m_graphs BMT_GEMM_EPILOGUES=0 "$BIN" --framework bmt "${S124[@]}"
run epi_124m_graphs BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S124[@]}"
run episep_124m_graphs BMT_GEMM_EPILOGUES=1,BMT_GELU_MLP_BACKWARD=separate "$BIN" --framework bmt "${S124[@]}"
run epi_124m_graphs_profile BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S124[@]}" --profile
run sep_1p3b BMT_GEMM_EPILOGUES=0 "$BIN" --framework bmt "${S13[@]}"
run bgrad_1p3b BMT_GEMM_EPILOGUES=1,BMT_GELU_MLP_BACKWARD=dgelu_bgrad "$BIN" --framework bmt "${S13[@]}"
run episep_1p3b BMT_GEMM_EPILOGUES=1,BMT_GELU_MLP_BACKWARD=separate "$BIN" --framework bmt "${S13[@]}"
run epi_1p3b BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S13[@]}"
run epi_1p3b_b BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S13[@]}"
run sep_1p3b_b BMT_GEMM_EPILOGUES=0 "$BIN" --framework bmt "${S13[@]}"
run epi_1p3b_sib BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S13[@]}" --step-in-backward
run sep_1p3b_ckpt_sib BMT_GEMM_EPILOGUES=0 "$BIN" --framework bmt "${S13[@]}" --checkpointing --step-in-backward
run epi_1p3b_ckpt_sib BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S13[@]}" --checkpointing --step-in-backward
run sep_1p3b_graphs BMT_GEMM_EPILOGUES=0 "$BIN" --framework bmt "${S13[@]}" --cuda-graphs
run epi_1p3b_graphs BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S13[@]}" --cuda-graphs
run epi_1p3b_profile BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S13[@]}" --profile
run fsdp2_1p3b - python3 bench/fsdp2_gpt.py "${S13[@]}"
run sep_6p7b_ckpt_sib BMT_GEMM_EPILOGUES=0 "$BIN" --framework bmt "${S67[@]}"
run epi_6p7b_ckpt_sib BMT_GEMM_EPILOGUES=1 "$BIN" --framework bmt "${S67[@]}"
bench_table
