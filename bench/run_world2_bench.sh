#!/usr/bin/env bash
# run_world2_bench.sh [BUILD_DIR]: the two-GPU rows of BENCHMARKS.md, side by side in one call, on a machine with
# two GPUs (nvidia-h200-x2):
#   ZeRO-3 weak scaling  gpt-1.3b seq 2048 batch 8 per GPU on 1 GPU, then on 2 (bmtrun --nproc 2);
#                        efficiency = tokens/s at world 2 / (2 x tokens/s at world 1)       target >= 97%
#   pipeline             gpt-1.3b pp 2 with 8 micro-batches of 2 (the same 16 x 2048 tokens per step as dp 2)
#                        against dp 2                                                        target >= 0.85x dp 2
#   tensor parallelism   llama-7b seq 2048 batch 4 --checkpointing at tp 2 (without and with the communication
#                        overlap, BMT_TP_OVERLAP_CHUNKS) against dp 2; target: the tp step <= 1.15x the dp step
#   CUDA graphs          gpt2-124m seq 1024 batch 16 at world 2, eager and --cuda-graphs (captured over NCCL)
#   checkpoint I/O       bmt-bench-ckpt gpt-1.3b at world 2 (sharded + async saves, loads from storage)
# Each run is its own process with its own timeout; a failure does not stop the others. Every row gets the same
# call_id and is appended to bench/results/<date>-<machine>.jsonl (machine: GPU name + "x2"); the table with the
# ratios against the targets goes to stdout (and $OUT/world2_bench/ with the logs when $OUT is set).
#   BUILD_DIR          default build-gpu (bmt-bench-train, bmt-bench-ckpt, bmtrun built there)
#   W2_BUDGET_S=480    wall-clock budget; a run starts only while >= 40 s remain
#   W2_ONLY=REGEX      only the run ids matching REGEX
#   BMT_CALL_ID, BMT_GIT_COMMIT   override the rows' fields
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
BIN=$BUILD/bench/bmt-bench-train
CKPT=$BUILD/bench/bmt-bench-ckpt
RUN=$BUILD/tools/bmtrun
BUDGET=${W2_BUDGET_S:-480}
ONLY=${W2_ONLY:-}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
start=$(date +%s)
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -lt 2 ]; then
  echo "[w2] needs 2 GPUs, $ngpu visible: run it on a two-GPU machine (nvidia-h200-x2)"
  exit 2
fi
for b in "$BIN" "$CKPT" "$RUN"; do
  [ -x "$b" ] || { echo "[w2] $b is missing: ninja -C $BUILD bmt-bench-train bmt-bench-ckpt bmtrun"; exit 2; }
done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' '-' | sed 's/--*/-/g;s/-$//')
export BMT_BENCH_MACHINE=${BMT_BENCH_MACHINE:-${gpu}x2}
export BMT_GIT_COMMIT=${BMT_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BMT_CALL_ID=${BMT_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-$BMT_GIT_COMMIT-world2}
LOGDIR=${OUT:+$OUT/world2_bench}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/world2_bench.XXXXXX)}
mkdir -p "$LOGDIR" bench/results
RESULTS=bench/results/$(date -u +%Y-%m-%d)-$BMT_BENCH_MACHINE.jsonl
echo "[w2] $BMT_BENCH_MACHINE, commit $BMT_GIT_COMMIT, call_id $BMT_CALL_ID, budget ${BUDGET}s, logs $LOGDIR"

n=0
# run ID TIMEOUT_S ENV... -- COMMAND...: one benchmark process writing its JSON lines to $LOGDIR/ID.json.
run() {
  local id=$1 limit=$2; shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  n=$((n + 1))
  if [ -n "$ONLY" ] && ! [[ $id =~ $ONLY ]]; then return; fi
  local left=$((BUDGET - ($(date +%s) - start)))
  if [ "$left" -lt 40 ]; then echo "[w2] $id: not run (time budget)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local json=$LOGDIR/$id.json log=$LOGDIR/$id.log t0=$(date +%s)
  rm -f "$json"
  echo "${envs[*]} $*" > "$log"
  env ${envs[@]+"${envs[@]}"} MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29710 + n)) timeout -k 15 "$limit" "$@" \
    --json "$json" >> "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] && [ -s "$json" ]; then
    python3 - "$json" "$id" <<'PY' >> "$RESULTS"
import json, os, sys
for line in open(sys.argv[1]):
    if line.strip():
        rec = json.loads(line)
        rec["run_id"], rec["call_id"] = sys.argv[2], os.environ["BMT_CALL_ID"]
        print(json.dumps(rec))
PY
    echo "[w2] $id: ok [$(($(date +%s) - t0)) s] $(grep -E '^RESULT' "$log" | tail -1 | cut -c1-220)"
  else
    echo "[w2] $id: FAILED (rc $rc) [$(($(date +%s) - t0)) s]; last lines of $log:"
    grep -v '^\s*$' "$log" | tail -6 | cut -c1-300 | sed 's/^/    /'
  fi
}

T=(--framework bmt --seq 2048)
run zero3_1p3b_w1 150 CUDA_VISIBLE_DEVICES=0 -- "$BIN" "${T[@]}" --preset gpt-1.3b --batch 8 --warmup 2 --steps 6
run zero3_1p3b_w2 150 -- "$RUN" --nproc 2 "$BIN" "${T[@]}" --preset gpt-1.3b --batch 8 --warmup 2 --steps 6
run pp2_1p3b 150 -- "$RUN" --nproc 2 "$BIN" "${T[@]}" --preset gpt-1.3b --batch 16 --pp 2 --micro-batches 8 \
  --warmup 2 --steps 6
L=(--preset llama-7b --batch 4 --checkpointing --warmup 2 --steps 4)
run llama7b_dp2 180 -- "$RUN" --nproc 2 "$BIN" "${T[@]}" "${L[@]}"
run llama7b_tp2 180 -- "$RUN" --nproc 2 "$BIN" "${T[@]}" "${L[@]}" --tp 2
run llama7b_tp2_overlap4 180 BMT_TP_OVERLAP_CHUNKS=4 -- "$RUN" --nproc 2 "$BIN" "${T[@]}" "${L[@]}" --tp 2
G=(--framework bmt --preset gpt2-124m --seq 1024 --batch 16 --warmup 3 --steps 20)
run eager_124m_w2 120 -- "$RUN" --nproc 2 "$BIN" "${G[@]}"
run graphs_124m_w2 120 -- "$RUN" --nproc 2 "$BIN" "${G[@]}" --cuda-graphs
run ckptio_1p3b_w2 240 -- "$RUN" --nproc 2 "$CKPT" --preset gpt-1.3b --seq 2048 --batch 8 --repeat 1 --drop-cache \
  --ops sharded,async

python3 - "$RESULTS" "$BMT_CALL_ID" <<'PY' | tee "$LOGDIR/table.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get("call_id") == sys.argv[2]]
by = {r["run_id"]: r for r in rows if r.get("bench") != "checkpoint"}
def tps(i): return by[i]["tokens_per_s"] if i in by else None
def step(i): return by[i].get("step_s") if i in by else None
print(f"call_id {sys.argv[2]}")
for i, r in by.items():
    print(f"  {i:24s} {r.get('tokens_per_s', 0):>10,.0f} tok/s  step {r.get('step_s', 0):.3f} s  "
          f"peak {r.get('peak_gpu_gib', float('nan')):.1f} GiB  loss {r.get('loss_last', float('nan')):.4f}")
def line(what, value, target, ok):
    print(f"  {what}: {value} (target {target}): {'met' if ok else 'NOT met'}")
if tps("zero3_1p3b_w1") and tps("zero3_1p3b_w2"):
    e = tps("zero3_1p3b_w2") / (2 * tps("zero3_1p3b_w1"))
    line("ZeRO-3 weak scaling 1 -> 2 GPUs", f"{e:.1%}", ">= 97%", e >= 0.97)
if tps("pp2_1p3b") and tps("zero3_1p3b_w2"):
    q = tps("pp2_1p3b") / tps("zero3_1p3b_w2")
    line("pp 2 / dp 2 (gpt-1.3b, same tokens per step)", f"{q:.3f}x", ">= 0.85x", q >= 0.85)
for tp in ("llama7b_tp2", "llama7b_tp2_overlap4"):
    if step(tp) and step("llama7b_dp2"):
        q = step(tp) / step("llama7b_dp2")
        line(f"{tp} step / dp 2 step", f"{q:.3f}x", "<= 1.15x", q <= 1.15)
if tps("graphs_124m_w2") and tps("eager_124m_w2"):
    print(f"  CUDA graphs at world 2: {tps('graphs_124m_w2') / tps('eager_124m_w2'):.3f}x eager")
for r in rows:
    if r.get("bench") == "checkpoint":
        print(f"  ckpt {r.get('op')}: " + ", ".join(f"{k} {r[k]}" for k in ("bytes", "seconds", "gb_per_s", "stall_s",
              "commit_s", "storage_read_bytes", "verified") if k in r))
PY
