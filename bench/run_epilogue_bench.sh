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
BUDGET=${EPI_BENCH_BUDGET_S:-480}
ONLY=${EPI_BENCH_ONLY:-}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
BMT_BENCH_MACHINE=${BMT_BENCH_MACHINE:-$(echo "${gpu:-$(hostname)}" | tr -c 'A-Za-z0-9\n' '-' | sed 's/--*/-/g;s/-$//')}
BMT_GIT_COMMIT=${BMT_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BMT_BENCH_MACHINE BMT_GIT_COMMIT
LOGDIR=${OUT:+$OUT/epi_bench}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/epi_bench.XXXXXX)}
mkdir -p "$LOGDIR" bench/results
RESULTS=bench/results/$(date -u +%Y-%m-%d)-$BMT_BENCH_MACHINE.jsonl
start=$(date +%s)
n=0
echo "[epi-bench] $BMT_BENCH_MACHINE, commit $BMT_GIT_COMMIT, budget ${BUDGET}s"
# id, environment (VAR=value,VAR=value or -), command...
run() {
  local id=$1 envs=$2
  shift 2
  n=$((n + 1))
  if [ -n "$ONLY" ] && ! [[ $id =~ $ONLY ]]; then return; fi
  local left=$((BUDGET - ($(date +%s) - start)))
  if [ "$left" -lt 40 ]; then echo "[epi-bench] $id: skipped (time budget)"; return; fi
  local json=$LOGDIR/$id.json log=$LOGDIR/$id.log t0
  t0=$(date +%s)
  rm -f "$json"
  echo "$*" > "$log"
  local env_epi=()
  [ "$envs" != - ] && env_epi=(env ${envs//,/ })
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29810 + n)) timeout -k 10 "$((left < 240 ? left : 240))" \
    ${env_epi[@]+"${env_epi[@]}"} "$@" --json "$json" >> "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] && [ -s "$json" ]; then
    cat "$json" >> "$RESULTS"
    echo "[epi-bench] $id: $(grep '^RESULT' "$log" | tail -1 | sed 's/^RESULT //') [$(( $(date +%s) - t0 ))s]"
  else
    echo "[epi-bench] $id: failed (rc $rc); last lines:"; tail -5 "$log" | cut -c1-300 | sed 's/^/    /'
  fi
}
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
python3 - "$LOGDIR" <<'PY' | tee "$LOGDIR/table.txt"
import json, os, sys
d = sys.argv[1]
print(f"{'run':<24}{'tokens/s':>11}{'step ms':>9}{'peak GiB':>9}  loss first -> last")
for f in sorted(os.listdir(d), key=lambda f: os.path.getmtime(os.path.join(d, f))):
    if not f.endswith(".json"):
        continue
    lines = [l for l in open(os.path.join(d, f)) if l.strip()]
    if not lines:
        continue
    r = json.loads(lines[-1])
    print(f"{f[:-5]:<24}{r['tokens_per_s']:>11,.0f}{r['step_s'] * 1e3:>9.2f}{r.get('peak_gpu_gib') or 0:>9.2f}  "
          f"{r.get('loss_first')} -> {r.get('loss_last')}")
PY
