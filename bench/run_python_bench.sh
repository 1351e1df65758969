#!/usr/bin/env bash
# run_python_bench.sh [BUILD_DIR]: the GPT trained through the Python package (bench/bmt_py_gpt.py) beside the same
# model in C++ (bmt-bench-train --framework bmt), side by side on one GPU, each run its own process; then one table
# (tokens/s, peak GiB, Python / C++). Results are appended to bench/results/<date>-<machine>.jsonl and, with $OUT
# set, copied to $OUT/bench_python/ (runs.jsonl, table.txt, logs.tgz). BENCH_ONLY=REGEX picks run ids; PY_BENCH_BUDGET_S (360) bounds the whole.
# Exits 1 when a run failed, wrote no result, or was left out for the budget (every run asked for must report).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
BIN=$BUILD/bench/bmt-bench-train
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
machine=${BMT_BENCH_MACHINE:-$(echo "${gpu:-$(hostname)}" | tr -c 'A-Za-z0-9\n' '-' | sed 's/--*/-/g;s/-$//')}
export BMT_BENCH_MACHINE=$machine BMT_GIT_COMMIT=${BMT_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LOG=$(mktemp -d /tmp/bench_python.XXXXXX)  # per-run logs; with $OUT set: runs.jsonl, table.txt and a tarball of them
mkdir -p "$LOG" bench/results
RESULTS=bench/results/$(date -u +%Y-%m-%d)-$machine.jsonl
BUDGET=${PY_BENCH_BUDGET_S:-360}
start=$(date +%s)
CONFIGS=(
  "124m|gpt2-124m|1024|16|3|10|"
  "1p3b|gpt-1.3b|2048|8|2|5|"
  "1p3b_ckpt|gpt-1.3b|2048|8|2|5|--checkpointing"
  "1p3b_offload|gpt-1.3b|2048|8|2|4|--offload"
)
: > "$LOG/runs.jsonl"
failures=0
for c in "${CONFIGS[@]}"; do
  IFS='|' read -r id preset seq batch warm steps extra <<< "$c"
  if [ -n "${BENCH_ONLY:-}" ] && ! [[ $id =~ $BENCH_ONLY ]]; then continue; fi
  for fw in cpp python; do
    left=$((BUDGET - ($(date +%s) - start)))
    if [ "$left" -lt 30 ]; then echo "[pybench] FAIL: $fw $id not run (budget PY_BENCH_BUDGET_S=$BUDGET spent)"; failures=$((failures + 1)); continue; fi
    limit=$(( left < 200 ? left : 200 ))
    flags=(--preset "$preset" --seq "$seq" --batch "$batch" --warmup "$warm" --steps "$steps" $extra)
    json=$LOG/$fw-$id.json
    rm -f "$json"
    if [ "$fw" = cpp ]; then
      # The Python run's offload: bf16 gradient transfer, asynchronous step, overlap with the backward.
      [[ " $extra " == *" --offload "* ]] && flags+=(--offload-grad-bf16 --offload-async)
      MASTER_ADDR=127.0.0.1 MASTER_PORT=29650 timeout -k 10 "$limit" "$BIN" --framework bmt "${flags[@]}" --json "$json" > "$LOG/$fw-$id.log" 2>&1
    else
      MASTER_ADDR=127.0.0.1 MASTER_PORT=29651 timeout -k 10 "$limit" python3 bench/bmt_py_gpt.py "${flags[@]}" --json "$json" > "$LOG/$fw-$id.log" 2>&1
    fi
    rc=$?
    grep RESULT "$LOG/$fw-$id.log" | sed "s/^/[pybench] $fw $id: /" || true
    [ "$rc" = 0 ] || { echo "[pybench] FAIL: $fw $id (rc $rc):"; tail -5 "$LOG/$fw-$id.log"; failures=$((failures + 1)); }
    [ "$rc" != 0 ] || [ -s "$json" ] || { echo "[pybench] FAIL: $fw $id wrote no result ($json)"; failures=$((failures + 1)); }
    if [ -s "$json" ]; then
      python3 - "$json" "$fw" "$id" >> "$LOG/runs.jsonl" <<'PY'
import json, sys
rec = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
rec["run_id"] = "py_" + sys.argv[3] if sys.argv[2] == "python" else "bmtcpp_" + sys.argv[3]
print(json.dumps(rec))
PY
    fi
  done
done
cat "$LOG/runs.jsonl" >> "$RESULTS"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/bench_python"
  cp "$LOG/runs.jsonl" "$OUT/bench_python/"
  tar -czf "$OUT/bench_python/logs.tgz" -C "$LOG" . 2>/dev/null
fi
python3 - "$LOG/runs.jsonl" <<'PY' | tee "$LOG/table.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    kind, cid = r["run_id"].split("_", 1)
    by.setdefault(cid, {})[kind] = r
print(f"{'config':<34} {'C++ tok/s':>11} {'Py tok/s':>11} {'Py/C++':>7} {'C++ GiB':>8} {'Py GiB':>8}")
for cid, d in by.items():
    c, p = d.get("bmtcpp"), d.get("py")
    name = (c or p)["config"]
    ct = c["tokens_per_s"] if c else float("nan")
    pt = p["tokens_per_s"] if p else float("nan")
    cg = (c or {}).get("peak_gpu_gib") or float("nan")
    pg = (p or {}).get("peak_gpu_gib") or float("nan")
    print(f"{name:<34} {ct:>11,.0f} {pt:>11,.0f} {pt / ct:>7.3f} {cg:>8.1f} {pg:>8.1f}")
PY
[ -n "${OUT:-}" ] && cp "$LOG/table.txt" "$OUT/bench_python/table.txt"
[ "$failures" = 0 ] || { echo "[pybench] $failures run(s) failed or not run"; exit 1; }
exit 0
