#!/usr/bin/env bash
# The main job (README): set up, build, and train the example GPT (`tiny` preset, embedded synthetic data)
# with ZeRO-3 over 2 ranks — Gloo on CPU ranks when there is no GPU, NCCL on GPUs.
# Extra arguments go to train_gpt, e.g. scripts/run_main.sh --steps 400.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
nproc_ranks=${BMT_NPROC:-2}
if [ -f examples/train_gpt.cpp ]; then
  bash scripts/build.sh cpu bmtrun train_gpt bmt-plot-metrics
  mkdir -p runs
  build/tools/bmtrun --nproc "$nproc_ranks" build/examples/train_gpt --metrics runs/metrics.jsonl "$@"
  if [ -x build/tools/bmt-plot-metrics ]; then
    build/tools/bmt-plot-metrics runs/metrics.jsonl runs/loss.png && echo "loss curve: runs/loss.png"
  fi
else
  bash scripts/build.sh cpu bmtrun bmt-demo-runtime
  build/tools/bmtrun --nproc "$nproc_ranks" build/tools/bmt-demo-runtime "$@"
fi
