#!/usr/bin/env bash
# run_torchops_bench.sh [BUILD_DIR] [CONFIG...]: the GPT written with torch's functional ops (bench/torchops_gpt.py)
# trained by the Python package (framework bmtrain-py-torchops), by FSDP2 and by plain PyTorch eager, beside the
# C++ engine's own GPT (bmt-bench-train --framework bmt, JSON framework "bmt"), in one call on one GPU; each run its
# own process. Every row gets the same call_id; rows are appended to bench/results/<date>-<machine>.jsonl (and,
# with $OUT set, copied with the logs and the table to $OUT/torchops_bench/).
#
#   CONFIG     any of 124m 1p3b 1p3b_ckpt 6p7b_ckpt 1p3b_offload (default: all five, in that order)
#   TORCHOPS_FRAMEWORKS="bmtpy fsdp2 plain bmt"   which rows per config (offload: bmtpy and bmt only)
#   TORCHOPS_COMPILE=1      after the eager rows, 124m with --compile for bmtpy and fsdp2 (0: none)
#   TORCHOPS_ABLATE=1       then 124m and 1p3b_ckpt on the package with BMT_ROUTE_TORCH_OPS=0 (variant no-route)
#                           with BMT_STEP_IN_BACKWARD=0 (variant no-sib), without the gelu_linear route
#                           (variant no-gelu-linear) and, checkpointed, BMT_RECOMPUTE_SKIP_TAIL=0 (no-skip-tail)
#   TORCHOPS_BUDGET_S=560   wall-clock budget; a run starts only while >= 40 s remain, its timeout is what is left
#   TORCHOPS_HOST=1         first, bench/host_overhead.py on the GPU: host µs per layer, rows in the same file
#   TORCHOPS_FP8=0          1: only issue 34's FP8 rows, at 1p3b and 6p7b_ckpt (or the CONFIGs given): the package
#                           bf16 and --fp8, FSDP2 + torchao float8 eager and compiled (torchao from .deps/wheels,
#                           scripts/prepare_device_deps.sh), the engine's bf16, --fp8 and --fp8 with rowwise scales
#                           (BMT_FP8_SCALING=row)
#   TORCHOPS_FP8_RUNS="bmt bmt_fp8 fsdp2_fp8 fsdp2_fp8_compile bmtpy bmtpy_fp8 bmt_fp8row"   the FP8 mode's runs per
#                           config, in order; also bmt_fp8_noepi (the engine's FP8 with BMT_GEMM_EPILOGUES=0: the
#                           FP8 MLP's GELU, GELU gradient and residual add as separate passes; variant fp8-no-epilogues)
#                           and bmt_fp8_sepamax (BMT_FP8_AMAX_FROM_SUM=0: each gradient's amax by its own pass, not
#                           taken by its bias gradient's column sum; variant fp8-separate-amax), bmt_fp8_sepdgelu
#                           (BMT_FP8_DGELU_FUSED=0: the FP8 MLP's GELU gradient by torch's gelu_backward, then the
#                           bias gradient's column sum; variant fp8-separate-dgelu; bmt_fp8_dgelu: =1, the default
#                           since session 25, variant fp8-fused-dgelu); bmt_fp8_head (--fp8-head: the LM head in FP8 too; variant fp8-head),
#                           bmt_fp8_dgelu_head (both; variant fp8-fused-dgelu-head); bmt_fp8_delayed
#                           (BMT_FP8_DELAYED_GELU=1: c_fc's GEMM writes the GELU output in E4M3 with a delayed
#                           scale; variant fp8-delayed-gelu), bmt_fp8_all (the three: variant
#                           fp8-fused-dgelu-delayed-gelu-head), bmt_fp8_inputs (BMT_FP8_DELAYED_INPUTS=1: the
#                           linears' inputs cast with delayed scales; variant fp8-delayed-inputs), bmt_fp8_all_inputs
#                           (the four; variant fp8-fused-dgelu-delayed-gelu-head-delayed-inputs), bmt_fp8_grads
#                           (BMT_FP8_DELAYED_GRADS=1: the output gradients cast with delayed scales, the bias gradient
#                           from the same pass; variant fp8-delayed-grads), bmt_fp8_all_grads (the five; variant
#                           ...-delayed-inputs-delayed-grads), bmt_fp8_recipe (the same by --fp8-recipe delayed
#                           --fp8-head; variant fp8-recipe-delayed-head), bmt_fp8_recipe_nohead (--fp8-recipe
#                           delayed alone, the LM head in bf16; variant fp8-recipe-delayed), bmt_fp8_recipe_headbwd (the same with
#                           --fp8-head-backward; variant fp8-recipe-delayed-head-backward), bmtpy_fp8_delayed (the package's --fp8
#                           under BMT_FP8_RECIPE=delayed; variant fp8-recipe-delayed); bmt_tune and bmt_fp8_tune
#                           (BMT_GEMM_AUTOTUNE=1: each GEMM shape's cuBLASLt algorithm timed among its candidates;
#                           variants autotune, fp8-autotune)
#   TORCHOPS_SMOKE=1        every run on the tiny preset, 1 + 1 steps, rows to $LOGDIR/smoke.jsonl (CPU without a GPU)
# The C++ engine's rows use its own best settings per config (124m --cuda-graphs; checkpointed configs
# --step-in-backward; offload --offload-grad-bf16 --offload-async); its config string is mapped to the five names
# and its own kept as engine_config.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-gpu}
[ $# -gt 0 ] && shift
BIN=$BUILD/bench/bmt-bench-train
. bench/bench_lib.sh
SMOKE=${TORCHOPS_SMOKE:-0}
bench_setup torchops_bench "${TORCHOPS_BUDGET_S:-560}" "" 29760 "${TORCHOPS_RUN_CAP_S:-240}"
[ "$SMOKE" = 1 ] && RESULTS=$LOGDIR/smoke.jsonl
export BMT_CALL_ID=${BMT_CALL_ID:-$(date -u +%Y%m%dT%H%M%SZ)-$BMT_GIT_COMMIT-$$}
export PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
# The package rows measure the documented switch for the step inside the backward (off by default in the package).
export BMT_STEP_IN_BACKWARD=${BMT_STEP_IN_BACKWARD:-auto}
# ... and the recompute's tail skip (opt-in; python/bmtrain/recompute_tail.py)
export BMT_RECOMPUTE_SKIP_TAIL=${BMT_RECOMPUTE_SKIP_TAIL:-1}
echo "[torchops_bench] call_id $BMT_CALL_ID, results $RESULTS"
CONFIGS=("$@")
[ ${#CONFIGS[@]} -eq 0 ] && CONFIGS=(124m 1p3b 1p3b_ckpt 6p7b_ckpt 1p3b_offload)
FRAMEWORKS=${TORCHOPS_FRAMEWORKS:-bmtpy fsdp2 plain bmt}
FP8_RUNS=${TORCHOPS_FP8_RUNS:-bmt bmt_fp8 fsdp2_fp8 fsdp2_fp8_compile bmtpy bmtpy_fp8 bmt_fp8row}

# shape and step counts of a config id; sets P (python flags), C (engine flags), CANON (the config name)
shape_of() {
  case $1 in
    124m) P="--preset gpt2-124m --seq 1024 --batch 16 --warmup 5 --steps 20"; C="$P --cuda-graphs"
          CANON="gpt2-124m seq1024 batch16" ;;
    1p3b) P="--preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 5"; C="$P"; CANON="gpt-1.3b seq2048 batch8" ;;
    1p3b_ckpt) P="--preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 5 --checkpointing"
          C="$P --step-in-backward"; CANON="gpt-1.3b seq2048 batch8 ckpt" ;;
    6p7b_ckpt) P="--preset gpt-6.7b --seq 2048 --batch 2 --warmup 2 --steps 4 --checkpointing"
          C="$P --step-in-backward"; CANON="gpt-6.7b seq2048 batch2 ckpt" ;;
    1p3b_offload) P="--preset gpt-1.3b --seq 2048 --batch 8 --warmup 2 --steps 4 --offload"
          C="$P --offload-grad-bf16 --offload-async"; CANON="gpt-1.3b seq2048 batch8 offload" ;;
    *) echo "[torchops_bench] unknown config '$1' (use 124m 1p3b 1p3b_ckpt 6p7b_ckpt 1p3b_offload)" >&2; return 1 ;;
  esac
  if [ "$SMOKE" = 1 ]; then
    local extra=""
    [[ $P == *--checkpointing* ]] && extra+=" --checkpointing"
    [[ $P == *--offload* ]] && extra+=" --offload"
    P="--preset tiny --warmup 1 --steps 1$extra"; C="$P"
    if [[ $1 == 1p3b_offload ]]; then C+=" --offload-grad-bf16 --offload-async"; fi
  fi
  return 0
}

# one run: ID KIND CANON COMMAND... (KIND bmt: the engine's row, normalised to the five config names)
run_one() {
  local id=$1 kind=$2 canon=$3
  shift 3
  local left=$((BENCH_BUDGET - ($(date +%s) - BENCH_START)))
  if [ "$left" -lt 40 ]; then echo "[torchops_bench] $id: skipped (time budget)"; return; fi
  local json=$LOGDIR/$id.json log=$LOGDIR/$id.log t0
  t0=$(date +%s)
  rm -f "$json"
  echo "$*" > "$log"
  BENCH_N=$((BENCH_N + 1))
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((BENCH_PORT_BASE + BENCH_N)) timeout -k 10 "$((left < BENCH_RUN_CAP ? left : BENCH_RUN_CAP))" \
    "$@" --json "$json" >> "$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ] && [ -s "$json" ]; then
    python3 - "$json" "$kind" "$canon" >> "$RESULTS" <<'PY'
import json, os, sys
rec = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
if sys.argv[2] == "bmt":  # the engine's row under the five names
    rec["engine_config"], rec["engine_framework"] = rec.get("config"), rec.get("framework")
    rec["framework"], rec["config"] = "bmt", sys.argv[3]
rec["call_id"] = os.environ["BMT_CALL_ID"]
rec["variant"] = os.environ.get("BENCH_VARIANT") or rec.get("variant") or ("fp8" if rec.get("fp8") else "eager")
print(json.dumps(rec))
PY
    echo "[torchops_bench] $id: $(grep '^RESULT' "$log" | tail -1 | sed 's/^RESULT //') [$(( $(date +%s) - t0 ))s]"
  else
    echo "[torchops_bench] $id: failed (rc $rc); last lines:"; tail -5 "$log" | cut -c1-300 | sed 's/^/    /'
  fi
}

PY=(python3 bench/torchops_gpt.py)
# host time per layer at a tiny width (bench/host_overhead.py: the GPU waits for the host there), ~20 s
if [ "${TORCHOPS_HOST:-1}" = 1 ] && [ "$SMOKE" != 1 ]; then
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$((BENCH_PORT_BASE + 99)) timeout -k 10 120 python3 bench/host_overhead.py \
    --device cuda --json "$RESULTS" > "$LOGDIR/host_overhead.log" 2>&1 \
    && grep '^RESULT' "$LOGDIR/host_overhead.log" | sed 's/^/[torchops_bench] host: /' \
    || { echo "[torchops_bench] host_overhead failed:"; tail -5 "$LOGDIR/host_overhead.log"; }
fi
if [ "${TORCHOPS_FP8:-0}" = 1 ]; then
  if ! python3 -c "import torchao" 2>/dev/null && ls .deps/wheels/torchao-*.whl >/dev/null 2>&1; then
    pip install -q --no-deps .deps/wheels/torchao-*.whl
  fi
  [ "$#" -eq 0 ] && CONFIGS=(1p3b 6p7b_ckpt)
  for cfg in "${CONFIGS[@]}"; do
    shape_of "$cfg" || exit 2
    # (the issue's comparison first: the engine bf16 / FP8 and FSDP2 + torchao; the budget cuts the rest first)
    for run in $FP8_RUNS; do
      case $run in
        bmt) run_one "bmt_$cfg" bmt "$CANON" "$BIN" --framework bmt $C ;;
        bmt_fp8) run_one "bmt_fp8_$cfg" bmt "$CANON" "$BIN" --framework bmt $C --fp8 ;;
        fsdp2_fp8 | fsdp2_fp8_compile)
          if python3 -c "import torchao" 2>/dev/null; then
            extra=""; [ $run = fsdp2_fp8_compile ] && extra=--compile
            run_one "${run}_$cfg" py "$CANON" "${PY[@]}" --framework fsdp2 $P --fp8 $extra
          else
            echo "[torchops_bench] torchao not importable (scripts/prepare_device_deps.sh puts its wheel in" \
              ".deps/wheels): no $run row"
          fi ;;
        bmtpy) run_one "bmtpy_$cfg" py "$CANON" "${PY[@]}" --framework bmtrain $P ;;
        bmtpy_fp8) run_one "bmtpy_fp8_$cfg" py "$CANON" "${PY[@]}" --framework bmtrain $P --fp8 ;;
        bmt_fp8row) run_one "bmt_fp8row_$cfg" bmt "$CANON" env BMT_FP8_SCALING=row "$BIN" --framework bmt $C --fp8 ;;
        # the FP8 MLP without its epilogue GEMMs (GELU, its gradient and the residual add as separate passes)
        bmt_fp8_noepi) BENCH_VARIANT=fp8-no-epilogues run_one "bmt_fp8_noepi_$cfg" bmt "$CANON" \
                         env BMT_GEMM_EPILOGUES=0 "$BIN" --framework bmt $C --fp8 ;;
        bmt_fp8_sepamax) BENCH_VARIANT=fp8-separate-amax run_one "bmt_fp8_sepamax_$cfg" bmt "$CANON" \
                           env BMT_FP8_AMAX_FROM_SUM=0 "$BIN" --framework bmt $C --fp8 ;;
        # the FP8 MLP's GELU gradient by torch's gelu_backward, then the column sum (not one fused kernel)
        bmt_fp8_sepdgelu) BENCH_VARIANT=fp8-separate-dgelu run_one "bmt_fp8_sepdgelu_$cfg" bmt "$CANON" \
                            env BMT_FP8_DGELU_FUSED=0 "$BIN" --framework bmt $C --fp8 ;;
        bmt_fp8_dgelu) BENCH_VARIANT=fp8-fused-dgelu run_one "bmt_fp8_dgelu_$cfg" bmt "$CANON" \
                         env BMT_FP8_DGELU_FUSED=1 "$BIN" --framework bmt $C --fp8 ;;
        bmt_fp8_head) BENCH_VARIANT=fp8-head run_one "bmt_fp8_head_$cfg" bmt "$CANON" \
                        "$BIN" --framework bmt $C --fp8 --fp8-head ;;
        bmt_fp8_dgelu_head) BENCH_VARIANT=fp8-fused-dgelu-head run_one "bmt_fp8_dgelu_head_$cfg" bmt "$CANON" \
                              env BMT_FP8_DGELU_FUSED=1 "$BIN" --framework bmt $C --fp8 --fp8-head ;;
        # the GELU output written in E4M3 by c_fc's GEMM (delayed scaling), alone and with the two above
        bmt_fp8_delayed) BENCH_VARIANT=fp8-delayed-gelu run_one "bmt_fp8_delayed_$cfg" bmt "$CANON" \
                           env BMT_FP8_DELAYED_GELU=1 "$BIN" --framework bmt $C --fp8 ;;
        bmt_fp8_all) BENCH_VARIANT=fp8-fused-dgelu-delayed-gelu-head run_one "bmt_fp8_all_$cfg" bmt "$CANON" \
                       env BMT_FP8_DGELU_FUSED=1 BMT_FP8_DELAYED_GELU=1 "$BIN" --framework bmt $C --fp8 --fp8-head ;;
        # and the linears' inputs cast with delayed scales (no amax pass over them)
        bmt_fp8_all_inputs) BENCH_VARIANT=fp8-fused-dgelu-delayed-gelu-head-delayed-inputs \
          run_one "bmt_fp8_all_inputs_$cfg" bmt "$CANON" env BMT_FP8_DGELU_FUSED=1 BMT_FP8_DELAYED_GELU=1 \
          BMT_FP8_DELAYED_INPUTS=1 "$BIN" --framework bmt $C --fp8 --fp8-head ;;
        # and the linears' output gradients too (one pass: the cast with the bias gradient; the MLP's d pre never
        # written in bf16)
        bmt_fp8_all_grads) BENCH_VARIANT=fp8-fused-dgelu-delayed-gelu-head-delayed-inputs-delayed-grads \
          run_one "bmt_fp8_all_grads_$cfg" bmt "$CANON" env BMT_FP8_DGELU_FUSED=1 BMT_FP8_DELAYED_GELU=1 \
          BMT_FP8_DELAYED_INPUTS=1 BMT_FP8_DELAYED_GRADS=1 "$BIN" --framework bmt $C --fp8 --fp8-head ;;
        # the delayed recipe by its one switch (the three delayed scalings) with the FP8 head: bmt_fp8_all_grads's
        # numerics; and the package's routed FP8 linears under the same recipe (their scales on the weights)
        bmt_fp8_recipe) BENCH_VARIANT=fp8-recipe-delayed-head run_one "bmt_fp8_recipe_$cfg" bmt "$CANON" \
                          "$BIN" --framework bmt $C --fp8 --fp8-recipe delayed --fp8-head ;;
        # the delayed recipe without the FP8 head: the fastest combination the 124M loss accepts (session 31)
        bmt_fp8_recipe_nohead) BENCH_VARIANT=fp8-recipe-delayed run_one "bmt_fp8_recipe_nohead_$cfg" bmt "$CANON" \
                                 "$BIN" --framework bmt $C --fp8 --fp8-recipe delayed ;;
        # and with the head's backward GEMMs in FP8 (its logits in bf16)
        bmt_fp8_recipe_headbwd) BENCH_VARIANT=fp8-recipe-delayed-head-backward \
          run_one "bmt_fp8_recipe_headbwd_$cfg" bmt "$CANON" "$BIN" --framework bmt $C --fp8 --fp8-recipe delayed \
          --fp8-head-backward ;;
        bmtpy_fp8_delayed) run_one "bmtpy_fp8_delayed_$cfg" py "$CANON" env BMT_FP8_RECIPE=delayed "${PY[@]}" \
                             --framework bmtrain $P --fp8 --variant fp8-recipe-delayed ;;
        bmt_fp8_grads) BENCH_VARIANT=fp8-delayed-grads run_one "bmt_fp8_grads_$cfg" bmt "$CANON" \
                         env BMT_FP8_DELAYED_GRADS=1 "$BIN" --framework bmt $C --fp8 ;;
        bmt_fp8_inputs) BENCH_VARIANT=fp8-delayed-inputs run_one "bmt_fp8_inputs_$cfg" bmt "$CANON" \
                          env BMT_FP8_DELAYED_INPUTS=1 "$BIN" --framework bmt $C --fp8 ;;
        # cuBLASLt's candidate algorithms timed per GEMM shape (BMT_GEMM_AUTOTUNE=1), bf16 and FP8
        bmt_tune) BENCH_VARIANT=autotune run_one "bmt_tune_$cfg" bmt "$CANON" \
                    env BMT_GEMM_AUTOTUNE=1 "$BIN" --framework bmt $C ;;
        bmt_fp8_tune) BENCH_VARIANT=fp8-autotune run_one "bmt_fp8_tune_$cfg" bmt "$CANON" \
                        env BMT_GEMM_AUTOTUNE=1 "$BIN" --framework bmt $C --fp8 ;;
        *) echo "[torchops_bench] TORCHOPS_FP8_RUNS: unknown run '$run'" >&2; exit 2 ;;
      esac
    done
  done
  CONFIGS=()
  TORCHOPS_ABLATE=0 TORCHOPS_COMPILE=0
fi
for cfg in "${CONFIGS[@]}"; do
  shape_of "$cfg" || exit 2
  for fw in $FRAMEWORKS; do
    offload=0; [[ $cfg == *offload* ]] && offload=1
    case $fw in
      bmtpy) run_one "bmtpy_$cfg" py "$CANON" "${PY[@]}" --framework bmtrain $P ;;
      fsdp2) [ $offload = 1 ] || run_one "fsdp2_$cfg" py "$CANON" "${PY[@]}" --framework fsdp2 $P ;;
      plain) [ $offload = 1 ] || run_one "plain_$cfg" py "$CANON" "${PY[@]}" --framework plain $P ;;
      bmt) run_one "bmt_$cfg" bmt "$CANON" "$BIN" --framework bmt $C ;;
      *) echo "[torchops_bench] unknown framework '$fw' in TORCHOPS_FRAMEWORKS (bmtpy fsdp2 plain bmt)" >&2; exit 2 ;;
    esac
  done
done
# what each change brings: the package with routing off, and with the step inside the backward off (last, so the
# budget cuts these first)
if [ "${TORCHOPS_ABLATE:-1}" = 1 ]; then
  for cfg in 124m 1p3b_ckpt; do
    shape_of "$cfg"
    run_one "bmtpy_noroute_$cfg" py "$CANON" env BMT_ROUTE_TORCH_OPS=0 "${PY[@]}" --framework bmtrain $P --variant no-route
    run_one "bmtpy_nosib_$cfg" py "$CANON" env BMT_STEP_IN_BACKWARD=0 "${PY[@]}" --framework bmtrain $P --variant no-sib
    run_one "bmtpy_nogl_$cfg" py "$CANON" env BMT_ROUTE_TORCH_OPS=linear,layer_norm,attention,cross_entropy \
      "${PY[@]}" --framework bmtrain $P --variant no-gelu-linear
    [[ $P == *--checkpointing* ]] && run_one "bmtpy_notail_$cfg" py "$CANON" env BMT_RECOMPUTE_SKIP_TAIL=0 \
      "${PY[@]}" --framework bmtrain $P --variant no-skip-tail
  done
fi
if [ "${TORCHOPS_COMPILE:-1}" = 1 ]; then
  shape_of 124m
  for fw in bmtrain fsdp2; do
    run_one "${fw}_compile_124m" py "$CANON" "${PY[@]}" --framework $fw $P --compile
  done
fi

# the table: one line per (config, framework, variant)
python3 - "$RESULTS" "$BMT_CALL_ID" <<'PY' | tee "$LOGDIR/table.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if r.get("call_id") == sys.argv[2] and "tokens_per_s" in r]
order = ["bmt", "bmtrain-py-torchops", "fsdp2", "plain"]
print(f"{'config':<34}{'framework':<22}{'variant':<10}{'tokens/s':>11}{'peak GiB':>10}  notes")
for r in sorted(rows, key=lambda r: (r["config"], order.index(r["framework"]) if r["framework"] in order else 9)):
    note = r.get("engine_config", "")
    if "routed_calls" in r:
        note = f"step_in_backward={r.get('step_in_backward')} routed={r['routed_calls']}"
    print(f"{r['config']:<34}{r['framework']:<22}{r.get('variant', ''):<10}{r['tokens_per_s']:>11,.0f}"
          f"{(r.get('peak_gpu_gib') or 0):>10.1f}  {note}")
PY
exit 0
