#!/usr/bin/env bash
# The main job (README): set up, build, and train the example GPT (`tiny` preset, embedded synthetic data)
# with ZeRO-3 over one rank per GPU (NCCL), or 2 CPU ranks over Gloo when there is no GPU (BMT_NPROC overrides).
# Extra arguments go to train_gpt, e.g. scripts/run_main.sh --steps 400.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One rank per GPU (CUDA_VISIBLE_DEVICES narrows the list, as it does for the ranks); 2 CPU ranks without GPUs.
gpu_count() {
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    local v=${CUDA_VISIBLE_DEVICES// /}
    [ -z "$v" ] || [ "$v" = "-1" ] && { echo 0; return; }
    echo "$v" | tr ',' '\n' | grep -c .
  elif command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}
gpus=$(gpu_count)
# The CUDA build where there are GPUs and nvcc (BMT_MAIN_BUILD=cpu|cuda overrides), else the CPU build.
kind=${BMT_MAIN_BUILD:-$([ "${gpus:-0}" -gt 0 ] && { command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && echo cuda || echo cpu)}
if [ "$kind" = cuda ]; then
  dir=build-cuda
  nproc_ranks=${BMT_NPROC:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 1)}
else
  dir=build
  nproc_ranks=${BMT_NPROC:-2}
fi
echo "[main] $kind build, $nproc_ranks rank(s)"
if [ -f examples/train_gpt.cpp ]; then
  bash scripts/build.sh "$kind" bmtrun train_gpt bmt-plot-metrics
  mkdir -p runs
  "$dir"/tools/bmtrun --nproc "$nproc_ranks" "$dir"/examples/train_gpt --metrics runs/metrics.jsonl "$@"
  if [ -x "$dir"/tools/bmt-plot-metrics ]; then
    "$dir"/tools/bmt-plot-metrics runs/metrics.jsonl runs/loss.png && echo "loss curve: runs/loss.png"
  fi
else
  bash scripts/build.sh "$kind" bmtrun bmt-demo-runtime
  "$dir"/tools/bmtrun --nproc "$nproc_ranks" "$dir"/tools/bmt-demo-runtime "$@"
fi
