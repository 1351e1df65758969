#!/usr/bin/env bash
# run_gpu_bench.sh [BUILD_DIR]: training throughput side by side on one GPU — bmtrain (bmt-bench-train
# --framework bmt), the same GPT in plain LibTorch (--framework plain) and PyTorch FSDP2 (bench/fsdp2_gpt.py) —
# then one table against peers.md's figures and the targets; last, checkpoint I/O of gpt-1.3b (bmt-bench-ckpt,
# run id ckptio_1p3b; BENCH_CKPT=0 drops it). See BENCHMARKS.md.
#
#   BUILD_DIR            the CMake build holding bench/bmt-bench-train (default build-gpu; built here when missing)
#   BENCH_BUDGET_S=480   wall-clock budget: each run's timeout is cut to what is left; runs start only while
#                        >= 30 s remain (the rest are reported as skipped)
#   BENCH_ONLY=REGEX     run only the run ids matching REGEX (e.g. 'bmt_' or '1p3b'); BENCH_7B=0 drops the
#                        optional last run (llama-7b, offload + checkpointing)
#   BENCH_6P7B=1         adds gpt-6.7b with checkpointing: bmt, bmt --step-in-backward, FSDP2
#   BENCH_SMOKE=1        every run on the tiny preset (seq 64, batch 2, 1 + 2 steps; CPU when no GPU): tests the script
#   BMT_BENCH_MACHINE, BMT_GIT_COMMIT  override the JSON fields (default: GPU name, git rev-parse or "unknown")
# Each run is its own process (peak memory per run) with its own timeout; a failure does not stop the others.
# Results: bench/results/<date>-<machine>.jsonl (appended) and, when $OUT is set, $OUT/bench_train/ (the JSON
# lines, every run's log, the table).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
BIN=$BUILD/bench/bmt-bench-train
CKPT_BIN=$BUILD/bench/bmt-bench-ckpt
BUDGET=${BENCH_BUDGET_S:-480}
ONLY=${BENCH_ONLY:-}
SMOKE=${BENCH_SMOKE:-0}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
start=$(date +%s)

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ -z "${BMT_BENCH_MACHINE:-}" ]; then
  if [ -n "$gpu_name" ]; then BMT_BENCH_MACHINE=$(echo "$gpu_name" | tr -c 'A-Za-z0-9\n' '-' | sed 's/--*/-/g;s/-$//')
  else BMT_BENCH_MACHINE=$(hostname); fi
fi
BMT_GIT_COMMIT=${BMT_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export BMT_BENCH_MACHINE BMT_GIT_COMMIT
LOGDIR=${OUT:+$OUT/bench_train}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/bench_train.XXXXXX)}
mkdir -p "$LOGDIR"
if [ "$SMOKE" = 1 ]; then RESULTS=$LOGDIR/smoke.jsonl  # smoke numbers never go to bench/results
else RESULTS=bench/results/$(date -u +%Y-%m-%d)-$BMT_BENCH_MACHINE.jsonl; mkdir -p bench/results; fi
: > "$LOGDIR/status.tsv"
echo "[bench] machine $BMT_BENCH_MACHINE (${gpu_name:-no GPU}), commit $BMT_GIT_COMMIT, budget ${BUDGET}s, logs $LOGDIR"

if { [ ! -x "$BIN" ] || [ ! -x "$CKPT_BIN" ]; } && [ -f "$BUILD/build.ninja" ]; then
  echo "[bench] building bmt-bench-train and bmt-bench-ckpt in $BUILD"
  ninja -C "$BUILD" bmt-bench-train bmt-bench-ckpt > "$LOGDIR/build.log" 2>&1 || tail -20 "$LOGDIR/build.log"
fi
[ -x "$BIN" ] || echo "[bench] WARNING: $BIN missing: the bmt and plain runs will fail"
[ -x "$CKPT_BIN" ] || echo "[bench] WARNING: $CKPT_BIN missing: the checkpoint run will fail"

n=0
# run ID TIMEOUT_S COMMAND... : one benchmark process; its JSON line goes to $LOGDIR/ID.json.
run() {
  local id=$1 limit=$2
  shift 2
  n=$((n + 1))
  if [ -n "$ONLY" ] && ! [[ $id =~ $ONLY ]]; then return; fi
  local now left status secs rc
  now=$(date +%s)
  left=$((BUDGET - (now - start)))
  if [ "$left" -lt 30 ]; then
    printf '%s\tskipped (time budget)\t0\n' "$id" >> "$LOGDIR/status.tsv"
    echo "[bench] $id: skipped (time budget)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local json=$LOGDIR/$id.json log=$LOGDIR/$id.log
  rm -f "$json"
  echo "$*" > "$log"
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29610 + n)) timeout -k 15 "$limit" "$@" --json "$json" >> "$log" 2>&1
  rc=$?
  secs=$(($(date +%s) - now))
  if [ $rc -eq 0 ] && [ -s "$json" ]; then status=ok
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="timeout (${limit}s)"
  elif [ $rc -eq 3 ]; then status="skipped (host memory)"
  elif grep -qi "out of memory" "$log"; then status="OOM"
  else status="failed (rc $rc)"; fi
  printf '%s\t%s\t%s\n' "$id" "$status" "$secs" >> "$LOGDIR/status.tsv"
  if [ "$status" = ok ]; then
    cat "$json" >> "$RESULTS"
    echo "[bench] $id: $(grep '^RESULT' "$log" | tail -1 | sed 's/^RESULT //') [${secs}s]"
  else
    echo "[bench] $id: $status [${secs}s]; last lines of $log:"
    grep -v '^\s*$' "$log" | tail -4 | cut -c1-300 | sed 's/^/    /'
  fi
}

# Configurations: id, timeout, framework, preset, seq, batch, warm-up, steps, extra flags.
CONFIGS=(
  "bmt_124m|120|bmt|gpt2-124m|1024|16|3|10|"
  "bmt_1p3b|180|bmt|gpt-1.3b|2048|8|2|5|"
  "bmt_1p3b_ckpt|180|bmt|gpt-1.3b|2048|8|2|5|--checkpointing"
  "bmt_1p3b_sib|180|bmt|gpt-1.3b|2048|8|2|5|--step-in-backward"
  "bmt_1p3b_ckpt_sib|180|bmt|gpt-1.3b|2048|8|2|5|--checkpointing --step-in-backward"
  "bmt_1p3b_offload|240|bmt|gpt-1.3b|2048|8|2|4|--offload"
  "bmt_1p3b_offload_bf16g|240|bmt|gpt-1.3b|2048|8|2|4|--offload --offload-grad-bf16"
  "bmt_1p3b_offload_async|240|bmt|gpt-1.3b|2048|8|2|4|--offload --offload-grad-bf16 --offload-async"
  "bmt_1p3b_offload_gpu2|240|bmt|gpt-1.3b|2048|8|2|4|--offload-gpu-blocks 2 --offload-grad-bf16 --offload-async"
  "bmt_1p3b_offload_gpu4|240|bmt|gpt-1.3b|2048|8|2|4|--offload-gpu-blocks 4 --offload-grad-bf16 --offload-async"
  "plain_124m|120|plain|gpt2-124m|1024|16|3|10|"
  "fsdp2_124m|150|fsdp2|gpt2-124m|1024|16|3|10|"
  "plain_1p3b|180|plain|gpt-1.3b|2048|8|2|5|"
  "fsdp2_1p3b|180|fsdp2|gpt-1.3b|2048|8|2|5|"
  "plain_1p3b_ckpt|180|plain|gpt-1.3b|2048|8|2|5|--checkpointing"
  "fsdp2_1p3b_ckpt|180|fsdp2|gpt-1.3b|2048|8|2|5|--checkpointing"
)
# gpt-6.7b with checkpointing (the peers' 6.7B row), with and without the step in backward: BENCH_6P7B=1.
[ "${BENCH_6P7B:-0}" = 1 ] && CONFIGS+=(
  "bmt_6p7b_ckpt|240|bmt|gpt-6.7b|2048|2|2|4|--checkpointing"
  "bmt_6p7b_ckpt_sib|240|bmt|gpt-6.7b|2048|2|2|4|--checkpointing --step-in-backward"
  "fsdp2_6p7b_ckpt|240|fsdp2|gpt-6.7b|2048|2|2|4|--checkpointing")
[ "${BENCH_7B:-1}" = 1 ] && CONFIGS+=("bmt_7b_offload_ckpt|300|bmt|llama-7b|2048|2|1|2|--offload --checkpointing --offload-grad-bf16 --offload-async")

for c in "${CONFIGS[@]}"; do
  IFS='|' read -r id limit fw preset seq batch warm steps extra <<< "$c"
  dev=()
  if [ "$SMOKE" = 1 ]; then
    preset=tiny seq=64 batch=2 warm=1 steps=2
    [ -z "$gpu_name" ] && dev=(--device cpu)
  fi
  # BENCH_PROFILE=1: bmt runs also profile 2 steps after the timed ones (GPU busy vs idle, top kernels)
  [ "$fw" = bmt ] && [ "${BENCH_PROFILE:-0}" = 1 ] && extra="$extra --profile"
  # shellcheck disable=SC2206
  flags=(--preset "$preset" --seq "$seq" --batch "$batch" --warmup "$warm" --steps "$steps" $extra)
  if [ "$fw" = fsdp2 ]; then
    run "$id" "$limit" python3 bench/fsdp2_gpt.py "${flags[@]}" ${dev[@]+"${dev[@]}"}
  elif [ "$fw" = plain ]; then
    run "$id" "$limit" "$BIN" --framework plain "${flags[@]}" ${dev[@]+"${dev[@]}"}
  else
    run "$id" "$limit" "$BIN" --framework bmt "${flags[@]}"
  fi
done

# Checkpoint I/O: consolidated .safetensors/.pt, sharded and async saves/loads of gpt-1.3b with its Adam state
# (its own table in the log; the JSON lines, one per op, go to the results like the others).
ckpt=(--preset gpt-1.3b --seq 2048 --batch 8 --repeat 2)
[ "$SMOKE" = 1 ] && ckpt=(--preset tiny --seq 64 --batch 2 --repeat 1 --warmup 1 --steps 2)
[ "${BENCH_CKPT:-1}" = 1 ] && run ckptio_1p3b 300 "$CKPT_BIN" "${ckpt[@]}"

python3 - "$LOGDIR" "$SMOKE" <<'EOF' | tee "$LOGDIR/table.txt"
import json, os, sys
logdir, smoke = sys.argv[1], sys.argv[2] == "1"
status = {}
for line in open(os.path.join(logdir, "status.tsv")):
    f = line.rstrip("\n").split("\t")
    if len(f) >= 2:
        status[f[0]] = f[1]
res = {}
for rid in status:
    p = os.path.join(logdir, rid + ".json")
    if status[rid] == "ok" and os.path.exists(p):
        lines = [l for l in open(p) if l.strip()]
        if lines:
            res[rid] = json.loads(lines[-1])
# peers.md, measured side by side on one H200 (tokens/s, peak GiB)
PEER = {
    "124m": {"plain": (347813, 16.1), "fsdp2": (247293, 15.3), "bmt": (255820, 15.9), "bmt_offload": (61815, 14.5)},
    "1p3b": {"plain": (56041, 57.0), "fsdp2": (58330, 51.7), "bmt": (58548, 55.5), "bmt_offload": (11526, 40.8)},
    "1p3b_ckpt": {"plain": (46369, 33.0), "fsdp2": (47713, 29.2), "bmt": (46175, 30.7), "bmt_offload": (10785, 16.0)},
}
ROWS = [("gpt2-124m T1024 B16", "124m", ["bmt_124m", "plain_124m", "fsdp2_124m"]),
        ("gpt-1.3b T2048 B8", "1p3b", ["bmt_1p3b", "plain_1p3b", "fsdp2_1p3b"]),
        ("gpt-1.3b T2048 B8 ckpt", "1p3b_ckpt", ["bmt_1p3b_ckpt", "plain_1p3b_ckpt", "fsdp2_1p3b_ckpt"]),
        ("gpt-1.3b T2048 B8 offload", "1p3b", ["bmt_1p3b_offload"]),
        ("  + bf16 grad transfer", "1p3b", ["bmt_1p3b_offload_bf16g"]),
        ("  + async step", "1p3b", ["bmt_1p3b_offload_async"]),
        ("  + layers.0-1 on GPU Adam", "1p3b", ["bmt_1p3b_offload_gpu2"]),
        ("  + layers.0-3 on GPU Adam", "1p3b", ["bmt_1p3b_offload_gpu4"]),
        ("llama-7b T2048 B2 off+ckpt", None, ["bmt_7b_offload_ckpt"])]
NAMES = {"bmt": "bmtrain", "plain": "plain", "fsdp2": "fsdp2"}

def tok(v): return f"{v / 1e3:,.1f}K"

def target(rid):
    r = res.get(rid)
    if smoke:
        return "-", ""
    if rid == "bmt_124m":
        return ">=350K tok/s", (r and r["tokens_per_s"] >= 350e3)
    if rid == "bmt_1p3b":
        return ">=58.5K, <=51.7GiB", (r and r["tokens_per_s"] >= 58.5e3 and (r["peak_gpu_gib"] or 1e9) <= 51.7)
    if rid == "bmt_1p3b_ckpt":
        return ">=47.7K, <=29GiB", (r and r["tokens_per_s"] >= 47.7e3 and (r["peak_gpu_gib"] or 1e9) <= 29.0)
    if rid.startswith("bmt_1p3b_offload"):
        base = res.get("bmt_1p3b")
        if not (r and base):
            return ">=0.77x no-offload", None
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        return f">=0.77x no-offl ({ratio:.2f}x)", ratio >= 0.77
    return "-", ""

hdr = f"{'config':<27}{'framework':<10}{'tokens/s':>10}{'MFU':>7}{'peakGiB':>8}{'step_s':>8}  {'peers.md tok/s/GiB':<24}{'target':<27}verdict"
print("\n" + "=" * len(hdr))
print(f"Training throughput, 1 GPU, world 1 — {len(res)} of {len(status)} runs ok (MFU: 6*N_matmul + 6*L*d*T per token, 989 TF)")
if smoke:
    print("SMOKE TEST: every row ran the tiny preset (labels name the real configurations); numbers are meaningless")
print(hdr)
print("-" * len(hdr))
for label, key, ids in ROWS:
    ids = [i for i in ids if i in status]
    for k, rid in enumerate(ids):
        fw = rid.split("_")[0]
        r = res.get(rid)
        peer_key = "bmt_offload" if "offload" in rid else fw
        peer = PEER.get(key or "", {}).get(peer_key) if key else None
        ptxt = ""
        if peer and not smoke:
            ptxt = f"{'BMTrain-py' if fw == 'bmt' else NAMES[fw]} {tok(peer[0])}/{peer[1]:.1f}"
        tname, ok = target(rid)
        verdict = "" if ok == "" else ("PASS" if ok else ("FAIL" if r else "n/a"))
        if r:
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            mem = f"{r['peak_gpu_gib']:.1f}" if r.get("peak_gpu_gib") is not None else "n/a"
            cols = f"{tok(r['tokens_per_s']):>10}{mfu:>7}{mem:>8}{r['step_s']:>8.3f}"
        else:
            cols = f"{status[rid][:33]:>33}"
        print(f"{label if k == 0 else '':<27}{NAMES[fw]:<10}{cols}  {ptxt:<24}{tname:<27}{verdict}")
# bmtrain against the fastest other framework measured here, per configuration
cmp = []
for label, key, ids in ROWS[:3]:
    b = res.get(ids[0])
    others = [res[i]["tokens_per_s"] for i in ids[1:] if i in res]
    if b and others:
        cmp.append(f"{label.split(' ')[0]}{' ckpt' if 'ckpt' in label else ''}: {b['tokens_per_s'] / max(others):.2f}x")
if cmp:
    print("bmtrain / fastest of plain,fsdp2 (this run): " + "; ".join(cmp))
ck_path = os.path.join(logdir, "ckptio_1p3b.json")
if status.get("ckptio_1p3b") == "ok" and os.path.exists(ck_path):
    ck = [json.loads(l) for l in open(ck_path) if l.strip()]
    print(f"checkpoint I/O ({ck[0]['config']}, world {ck[0]['world']}; seconds, GB/s): " + "; ".join(
        f"{c['op']} {c['seconds']:.2f} {c['gb_per_s']:.2f}" + (f" stall {c['stall_s']:.3f}" if c.get("stall_s") is not None else "")
        for c in ck))
print("=" * len(hdr))
EOF
echo "[bench] done in $(($(date +%s) - start)) s; JSON lines: $RESULTS${OUT:+ (copied to $LOGDIR)}"
if [ -n "${OUT:-}" ] && [ -f "$RESULTS" ] && [ "$SMOKE" != 1 ]; then cp "$RESULTS" "$LOGDIR/"; fi
exit 0
