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
BUDGET=${STEP_BENCH_BUDGET_S:-420}
ONLY=${STEP_BENCH_ONLY:-}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
BMT_BENCH_MACHINE=${BMT_BENCH_MACHINE:-$(echo "${gpu:-$(hostname)}" | tr -c 'A-Za-z0-9\n' '-' | sed 's/--*/-/g;s/-$//')}
BMT_GIT_COMMIT=${BMT_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BMT_BENCH_MACHINE BMT_GIT_COMMIT
LOGDIR=${OUT:+$OUT/step_bench}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/step_bench.XXXXXX)}
mkdir -p "$LOGDIR" bench/results
RESULTS=bench/results/$(date -u +%Y-%m-%d)-$BMT_BENCH_MACHINE.jsonl
start=$(date +%s)
n=0
echo "[step-bench] $BMT_BENCH_MACHINE, commit $BMT_GIT_COMMIT, budget ${BUDGET}s"
# id, reductions (0 torch / 1 ours / - not ours), command...
run() {
  local id=$1 fused=$2
  shift 2
  n=$((n + 1))
  if [ -n "$ONLY" ] && ! [[ $id =~ $ONLY ]]; then return; fi
  local left=$((BUDGET - ($(date +%s) - start)))
  if [ "$left" -lt 40 ]; then echo "[step-bench] $id: skipped (time budget)"; return; fi
  local json=$LOGDIR/$id.json log=$LOGDIR/$id.log t0
  t0=$(date +%s)
  rm -f "$json"
  echo "$*" > "$log"
  local env_fused=()
  [ "$fused" != - ] && env_fused=(env BMT_FUSED_REDUCTIONS="$fused")
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29710 + n)) timeout -k 10 "$((left < 200 ? left : 200))" \
    ${env_fused[@]+"${env_fused[@]}"} "$@" --json "$json" >> "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] && [ -s "$json" ]; then
    cat "$json" >> "$RESULTS"
    echo "[step-bench] $id: $(grep '^RESULT' "$log" | tail -1 | sed 's/^RESULT //') [$(( $(date +%s) - t0 ))s]"
  else
    echo "[step-bench] $id: failed (rc $rc); last lines:"; tail -5 "$log" | cut -c1-300 | sed 's/^/    /'
  fi
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
python3 - "$LOGDIR" <<'EOF' | tee "$LOGDIR/table.txt"
import json, os, sys
d = sys.argv[1]
print(f"{'run':<28}{'tokens/s':>11}{'step ms':>9}{'peak GiB':>9}  loss first -> last")
for f in sorted(os.listdir(d), key=lambda f: os.path.getmtime(os.path.join(d, f))):
    if not f.endswith(".json"):
        continue
    lines = [l for l in open(os.path.join(d, f)) if l.strip()]
    if not lines:
        continue
    r = json.loads(lines[-1])
    print(f"{f[:-5]:<28}{r['tokens_per_s']:>11,.0f}{r['step_s'] * 1e3:>9.2f}{r.get('peak_gpu_gib') or 0:>9.2f}  "
          f"{r.get('loss_first')} -> {r.get('loss_last')}")
EOF
