#!/usr/bin/env bash
# run_fp8_fidelity.sh [BUILD_DIR] [CONFIG...]: issue 34's loss fidelity. train_gpt trains the same GPT twice on real
# text (bench/make_text_corpus.py: torch's own Python sources, byte-level, last 10% held out), in bf16 and with
# --fp8, from the same initialisation and the same batches (same seed: the data order and the init do not depend
# on --fp8), 1000 steps each with the held-out loss every EVAL steps. bench/fp8_fidelity_report.py then writes one
# row per run (the held-out curve, the final losses, fp8) and one comparison row per config to
# bench/results/<date>-<machine>.jsonl under one call_id, and an SVG of the curves next to them.
#
#   CONFIG   124m (gpt2-124m, seq 1024, batch 16, eval every 50) and/or 1p3b (gpt-1.3b, seq 1024, batch 4, eval every
#            100); default both
#   FIDELITY_RUNS="bf16 fp8"  the runs of each config, bf16 first (the reference): bf16 or fp8, each followed by
#            modifiers joined with _: e4m3grad (BMT_FP8_GRAD=e4m3), row (BMT_FP8_SCALING=row), ends
#            (--fp8-bf16-layers 0,-1), head (--fp8-head), headbwd (--fp8-head-backward: the head's
#            backward GEMMs only), delayed (BMT_FP8_DELAYED_GELU=1: the MLP's GELU output
#            in E4M3 from c_fc's GEMM, delayed scaling), inputs (BMT_FP8_DELAYED_INPUTS=1: the linears' inputs and
#            weights cast with delayed scales), grads (BMT_FP8_DELAYED_GRADS=1: the output gradients cast with
#            delayed scales), mlp / attn (--fp8-linears), seedN (--seed N:
#            bf16_seed2 is the noise floor, a bf16 run from another init and data order); e.g. "bf16 fp8 fp8_e4m3grad fp8_row fp8_ends bf16_seed2".
#            A recipe run with 2+ seeds beside bf16 with 2+ ("bf16 fp8 bf16_seed2 fp8_seed2 bf16_seed3 fp8_seed3")
#            also gets a verdict on the seed means (the 124M final loss moves by ~0.5-5% with any perturbation)
#   FIDELITY_STEPS=1000     training steps per run
#   FIDELITY_SMOKE=1        the tiny preset for 40 steps on the CPU (a check of the script, not a measurement)
#   FIDELITY_BUDGET_S=560   wall-clock budget; each run's timeout is what is left, and a run starts only while at
#                           least FIDELITY_MIN_LEFT_S=30 seconds are left
#   FIDELITY_CORPUS=PATH    train on this text file instead (kept); FIDELITY_TRAIN_GPT=PATH the train_gpt binary
#   FIDELITY_REUSE=1        a run that already finished in this OUT with the same arguments is not trained again
#                           (its metrics are reported with the new runs: one comparison across several device calls)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
[ $# -gt 0 ] && shift
BIN=${FIDELITY_TRAIN_GPT:-$BUILD/examples/train_gpt}
. bench/bench_lib.sh
SMOKE=${FIDELITY_SMOKE:-0}
bench_setup fp8_fidelity "${FIDELITY_BUDGET_S:-560}" "" 29860 100000
export BMT_CALL_ID=${BMT_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-$BMT_GIT_COMMIT-fidelity}
[ "$SMOKE" = 1 ] && RESULTS=$LOGDIR/smoke.jsonl
STEPS=${FIDELITY_STEPS:-1000}
read -ra RUNS <<< "${FIDELITY_RUNS:-bf16 fp8}"
# run_recipe NAME: FLAGS (train_gpt's) and ENVS (VAR=VALUE words) of a run name; false for an unknown one
run_recipe() {
  local parts m
  IFS=_ read -ra parts <<< "$1"
  FLAGS="" ENVS=""
  case ${parts[0]} in bf16) ;; fp8) FLAGS=--fp8 ;; *) return 1 ;; esac
  for m in "${parts[@]:1}"; do
    case $m in
      e4m3grad) ENVS="$ENVS BMT_FP8_GRAD=e4m3" ;;
      row) ENVS="$ENVS BMT_FP8_SCALING=row" ;;
      ends) FLAGS="$FLAGS --fp8-bf16-layers 0,-1" ;;
      head) FLAGS="$FLAGS --fp8-head" ;;
      headbwd) FLAGS="$FLAGS --fp8-head-backward" ;;
      delayed) ENVS="$ENVS BMT_FP8_DELAYED_GELU=1" ;;
      inputs) ENVS="$ENVS BMT_FP8_DELAYED_INPUTS=1" ;;
      grads) ENVS="$ENVS BMT_FP8_DELAYED_GRADS=1" ;;
      mlp | attn) FLAGS="$FLAGS --fp8-linears $m" ;;
      seed[0-9]*) FLAGS="$FLAGS --seed ${m#seed}" ;;
      *) return 1 ;;
    esac
  done
}
[ "${RUNS[0]:-}" = bf16 ] || { echo "[fp8_fidelity] FIDELITY_RUNS must start with bf16 (the reference)" >&2; exit 2; }
for run in "${RUNS[@]}"; do
  run_recipe "$run" || { echo "[fp8_fidelity] FIDELITY_RUNS: unknown run '$run' (bf16|fp8 with _e4m3grad _row _ends _head _delayed _inputs _grads _mlp _attn _seedN)" >&2; exit 2; }
done
CONFIGS=("$@")
[ ${#CONFIGS[@]} -eq 0 ] && CONFIGS=(124m 1p3b)
CORPUS=${FIDELITY_CORPUS:-$LOGDIR/corpus.txt}
[ -s "$CORPUS" ] || python3 bench/make_text_corpus.py "$CORPUS" | tee "$LOGDIR/corpus.json" || exit 2
echo "[fp8_fidelity] call_id $BMT_CALL_ID"

for cfg in "${CONFIGS[@]}"; do
  case $cfg in
    124m) A="--preset gpt2-124m --seq 1024 --batch 16 --eval-every 50 --eval-batches 16" ;;
    1p3b) A="--preset gpt-1.3b --seq 1024 --batch 4 --eval-every 100 --eval-batches 16" ;;
    *) echo "[fp8_fidelity] unknown config '$cfg' (124m 1p3b)" >&2; exit 2 ;;
  esac
  [ "$SMOKE" = 1 ] && A="--preset tiny --eval-every 10 --eval-batches 2" STEPS=40
  report=()
  for run in "${RUNS[@]}"; do
    id=${cfg}_$run
    run_recipe "$run"
    sig="$A --steps $STEPS $ENVS $FLAGS"
    if [ "${FIDELITY_REUSE:-0}" = 1 ] && [ -s "$LOGDIR/$id.metrics.jsonl" ] && [ "$(cat "$LOGDIR/$id.done" 2>/dev/null)" = "$sig" ]; then
      echo "[fp8_fidelity] $id: reused (FIDELITY_REUSE=1), $(grep '^done:' "$LOGDIR/$id.log" | tail -1)"
      [ "$run" = bf16 ] || report+=(--run "$run=$LOGDIR/$id.metrics.jsonl")
      continue
    fi
    left=$((BENCH_BUDGET - ($(date +%s) - BENCH_START)))
    if [ "$left" -lt "${FIDELITY_MIN_LEFT_S:-30}" ]; then echo "[fp8_fidelity] $id: skipped (time budget)"; continue; fi
    t0=$(date +%s)
    rm -f "$LOGDIR/$id.metrics.jsonl" "$LOGDIR/$id.done"
    env $ENVS MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29860 + RANDOM % 100)) timeout -k 10 "$left" "$BIN" $A \
      --steps "$STEPS" --data "$CORPUS" --data-format text $FLAGS --metrics "$LOGDIR/$id.metrics.jsonl" \
      --progress lines --log-every 100 > "$LOGDIR/$id.log" 2>&1
    rc=$?
    echo "[fp8_fidelity] $id ($ENVS $FLAGS): rc $rc, $(grep '^done:' "$LOGDIR/$id.log" | tail -1) [$(( $(date +%s) - t0 ))s]"
    [ $rc -eq 0 ] || tail -5 "$LOGDIR/$id.log" | cut -c1-300 | sed 's/^/    /'
    [ $rc -eq 0 ] && echo "$sig" > "$LOGDIR/$id.done"
    [ "$run" = bf16 ] || report+=(--run "$run=$LOGDIR/$id.metrics.jsonl")
  done
  python3 bench/fp8_fidelity_report.py --config "$cfg" --bf16 "$LOGDIR/${cfg}_bf16.metrics.jsonl" "${report[@]}" \
    --args "$A --steps $STEPS" --results "$RESULTS" --svg "$LOGDIR/fp8_fidelity_$cfg.svg" \
    --corpus-info "$LOGDIR/corpus.json"
done
[ -n "${FIDELITY_CORPUS:-}" ] || rm -f "$LOGDIR/corpus.txt"  # 41 MB; rebuilt from the installed torch by make_text_corpus.py
exit 0
