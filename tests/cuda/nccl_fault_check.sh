#!/usr/bin/env bash
# A dead or stopped NCCL peer must not hang the survivor (issue 14.1). On a machine with 2 GPUs: 2 ranks of
# `train_gpt --preset gpt2-124m`, started (a) by hand with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, (b) under
# bmtrun, (c) under torchrun --no-python; once rank 0 prints training steps, rank 1 gets kill -9 or, separately,
# SIGSTOP. Rank 0 must exit within BMT_TIMEOUT_S (30) + 10 s and the output must name rank 1 (the library's
# "rank 1 is dead: ..." DistError, or, when the launcher stopped the survivor first, the launcher's report of rank 1).
# Prints one line per case and exits non-zero if any case failed. About 3 minutes. BMT_FAULT_MODES (hand bmtrun
# torchrun) and BMT_FAULT_SIGNALS (KILL STOP) run a subset; BMT_FAULT_KEEP_LOGS=DIR copies the cases' logs there.
#   usage: tests/cuda/nccl_fault_check.sh [BUILD_DIR]      (default: the first of build-gpu, build-cuda, build)
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-}
if [ -z "$BUILD" ]; then
  for b in build-gpu build-cuda build; do [ -x "$b/examples/train_gpt" ] && { BUILD=$b; break; }; done
fi
BUILD=$(cd "${BUILD:-build}" 2>/dev/null && pwd)
TRAIN=$BUILD/examples/train_gpt
BMTRUN=$BUILD/tools/bmtrun
[ -x "$TRAIN" ] || { echo "[fault] FAIL: no train_gpt under '${BUILD:-?}' (build the CUDA configuration first)"; exit 1; }
export NCCL_NVLS_ENABLE=0 BMT_TIMEOUT_S=${BMT_TIMEOUT_S:-30}
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE
LIMIT=$((BMT_TIMEOUT_S + 10))
NGPU=${BMT_FAULT_NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
if [ "$NGPU" -lt 2 ]; then echo "[fault] SKIP: needs 2 GPUs, $NGPU visible"; exit 0; fi
TMP=$(mktemp -d /tmp/bmt_fault_XXXXXX)
# BMT_FAULT_TRAIN_ARGS replaces the model options (e.g. "--preset tiny" for a dry run of this script on CPU ranks).
read -r -a MODEL_ARGS <<< "${BMT_FAULT_TRAIN_ARGS:---preset gpt2-124m --steps 20000}"
ARGS=("${MODEL_ARGS[@]}" --progress lines --log-every 5 --metrics "$TMP/metrics.jsonl")
# Rank 0 names a dead peer itself; a launcher may stop the survivor first and report the dead rank instead.
NAMES_RANK1='rank 1 is dead'
LAUNCHER_NAMES_RANK1='rank 1 \(pid [0-9]+\)|rank *: *1 |local_rank: 1'
failures=0 passes=0
t_all=$(date +%s)

descendants() { local k; for k in $(pgrep -P "$1" 2>/dev/null); do echo "$k"; descendants "$k"; done; }
# The train_gpt process of rank $2 below process $1 (launcher cases).
rank_pid() {
  local p
  for p in $(descendants "$1"); do
    [ "$(cat /proc/"$p"/comm 2>/dev/null)" = train_gpt ] || continue
    tr '\0' '\n' < /proc/"$p"/environ 2>/dev/null | grep -qx "RANK=$2" && { echo "$p"; return; }
  done
}
# Gone = no such process, or a zombie not yet reaped.
gone() { local s; s=$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null); [ -z "$s" ] || [ "$s" = Z ] || [ "$s" = X ]; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

run_case() {  # $1 = hand | bmtrun | torchrun, $2 = KILL | STOP
  local mode=$1 sig=$2 log=$TMP/$1-$2 port=$((20000 + RANDOM % 30000)) p0 p1 groups=() t0 t1 dt ok msg verdict
  case $mode in
    hand)
      for r in 0 1; do
        RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
          setsid "$TRAIN" "${ARGS[@]}" > "$log.rank$r" 2>&1 &
        groups+=($!); disown $!
      done
      p0=${groups[0]}; p1=${groups[1]};;
    bmtrun)
      setsid "$BMTRUN" --nproc 2 "$TRAIN" "${ARGS[@]}" > "$log.rank0" 2>&1 &
      groups+=($!); disown $!;;
    torchrun)
      if ! python3 -c "import torch.distributed.run" 2>/dev/null; then
        echo "[fault] FAIL torchrun kill -$sig: python3 cannot import torch.distributed.run"
        failures=$((failures + 1)); return
      fi
      setsid python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python "$TRAIN" "${ARGS[@]}" \
        > "$log.rank0" 2>&1 &
      groups+=($!); disown $!;;
  esac
  # Wait until rank 0 trains (and, with a launcher, both ranks are found).
  local deadline=$(( $(date +%s) + 150 ))
  while :; do
    if grep -q "step [0-9]" "$log.rank0" 2>/dev/null; then
      if [ "$mode" != hand ]; then p0=$(rank_pid "${groups[0]}" 0); p1=$(rank_pid "${groups[0]}" 1); fi
      [ -n "${p0:-}" ] && [ -n "${p1:-}" ] && break
    fi
    if [ "$(date +%s)" -gt "$deadline" ] || gone "${groups[0]}"; then
      echo "[fault] FAIL $mode kill -$sig: rank 0 never started training; its output:"; tail -5 "$log.rank0"
      failures=$((failures + 1)); kill -KILL -- "${groups[@]/#/-}" 2>/dev/null; return
    fi
    sleep 0.5
  done
  sleep 2  # a few steps in flight
  t0=$(now_ms)
  kill -"$sig" "$p1"
  while ! gone "$p0" && [ $(( $(now_ms) - t0 )) -le $(( (LIMIT + 20) * 1000 )) ]; do sleep 0.1; done
  t1=$(now_ms)
  dt=$(( t1 - t0 ))
  sleep 1  # the launcher's report
  cat "$log".rank* > "$log.all"
  ok=1
  gone "$p0" || ok=0
  [ "$dt" -le $(( LIMIT * 1000 )) ] || ok=0
  if grep -qE "$NAMES_RANK1" "$log.all"; then
    verdict="library"; msg=$(grep -m1 -E "$NAMES_RANK1" "$log.all")
  elif [ "$mode" != hand ] && grep -qE "$LAUNCHER_NAMES_RANK1" "$log.all"; then
    verdict="launcher"; msg=$(grep -m1 -E "$LAUNCHER_NAMES_RANK1" "$log.all")
  else
    ok=0; verdict="nobody"; msg=$(grep -m1 -iE "error|abort" "$log.all" || echo "(no error message)")
  fi
  printf '[fault] %s %-8s kill -%-4s survivor exited after %d.%d s (limit %d s), rank 1 named by %s: %s\n' \
    "$([ $ok = 1 ] && echo PASS || echo FAIL)" "$mode" "$sig" $((dt / 1000)) $((dt % 1000 / 100)) "$LIMIT" \
    "$verdict" "${msg:0:400}"
  if [ $ok = 1 ]; then passes=$((passes + 1)); else failures=$((failures + 1)); echo "[fault]   logs: $log.*"; fi
  # Clean up: the stopped rank, the launcher, anything left in the cases' process groups.
  kill -KILL "$p1" 2>/dev/null
  kill -KILL -- "${groups[@]/#/-}" 2>/dev/null
  wait 2>/dev/null
}

# BMT_FAULT_MODES / BMT_FAULT_SIGNALS pick a subset (e.g. "hand" and "KILL" to look at one case).
read -r -a MODES <<< "${BMT_FAULT_MODES:-hand bmtrun torchrun}"
read -r -a SIGNALS <<< "${BMT_FAULT_SIGNALS:-KILL STOP}"
for mode in "${MODES[@]}"; do
  for sig in "${SIGNALS[@]}"; do run_case "$mode" "$sig"; done
done
echo "[fault] $passes passed, $failures failed of $(( ${#MODES[@]} * ${#SIGNALS[@]} )) cases in $(( $(date +%s) - t_all )) s (BMT_TIMEOUT_S=$BMT_TIMEOUT_S)"
[ -n "${BMT_FAULT_KEEP_LOGS:-}" ] && mkdir -p "$BMT_FAULT_KEEP_LOGS" && cp "$TMP"/* "$BMT_FAULT_KEEP_LOGS"/ 2>/dev/null
[ "$failures" = 0 ] && rm -rf "$TMP"
[ "$failures" = 0 ]
