# Sourced by the side-by-side GPU benchmark scripts (run_step_kernels_bench.sh, run_epilogue_bench.sh): one
# process per run, each under a share of a wall-clock budget, its JSON row appended to bench/results/, and a table.
#
#   bench_setup NAME BUDGET_S ONLY_REGEX PORT_BASE RUN_CAP_S   sets LOGDIR ($OUT/NAME or a temp dir) and RESULTS
#   bench_run ID ENV CMD...    ENV: VAR=value[,VAR=value...] or - ; skipped unless ID matches ONLY_REGEX (if set)
#   bench_table                prints (and writes $LOGDIR/table.txt) tokens/s, step, peak memory, losses per run
bench_setup() {
  BENCH_NAME=$1 BENCH_BUDGET=$2 BENCH_ONLY=$3 BENCH_PORT_BASE=$4 BENCH_RUN_CAP=$5
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  BMT_BENCH_MACHINE=${BMT_BENCH_MACHINE:-$(echo "${gpu:-$(hostname)}" | tr -c 'A-Za-z0-9\n' '-' | sed 's/--*/-/g;s/-$//')}
  BMT_GIT_COMMIT=${BMT_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  export BMT_BENCH_MACHINE BMT_GIT_COMMIT
  LOGDIR=${OUT:+$OUT/$BENCH_NAME}
  LOGDIR=${LOGDIR:-$(mktemp -d "/tmp/$BENCH_NAME.XXXXXX")}
  mkdir -p "$LOGDIR" bench/results
  RESULTS=bench/results/$(date -u +%Y-%m-%d)-$BMT_BENCH_MACHINE.jsonl
  BENCH_START=$(date +%s) BENCH_N=0
  echo "[$BENCH_NAME] $BMT_BENCH_MACHINE, commit $BMT_GIT_COMMIT, budget ${BENCH_BUDGET}s"
}

bench_run() {
  local id=$1 envs=$2
  shift 2
  BENCH_N=$((BENCH_N + 1))
  if [ -n "$BENCH_ONLY" ] && ! [[ $id =~ $BENCH_ONLY ]]; then return; fi
  local left=$((BENCH_BUDGET - ($(date +%s) - BENCH_START)))
  if [ "$left" -lt 40 ]; then echo "[$BENCH_NAME] $id: skipped (time budget)"; return; fi
  local json=$LOGDIR/$id.json log=$LOGDIR/$id.log t0 env_args=()
  t0=$(date +%s)
  rm -f "$json"
  echo "$*" > "$log"
  [ "$envs" != - ] && env_args=(env ${envs//,/ })
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((BENCH_PORT_BASE + BENCH_N)) \
    timeout -k 10 "$((left < BENCH_RUN_CAP ? left : BENCH_RUN_CAP))" \
    ${env_args[@]+"${env_args[@]}"} "$@" --json "$json" >> "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] && [ -s "$json" ]; then
    cat "$json" >> "$RESULTS"
    echo "[$BENCH_NAME] $id: $(grep '^RESULT' "$log" | tail -1 | sed 's/^RESULT //') [$(( $(date +%s) - t0 ))s]"
  else
    echo "[$BENCH_NAME] $id: failed (rc $rc); last lines:"; tail -5 "$log" | cut -c1-300 | sed 's/^/    /'
  fi
}

bench_table() {
  python3 - "$LOGDIR" <<'PY' | tee "$LOGDIR/table.txt"
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
PY
}
