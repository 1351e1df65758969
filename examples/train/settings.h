// TrainSettings: one run of train_gpt resolved: the command line over the preset's defaults, the data's vocabulary
// (padded to a multiple of tp) and the data-parallel layout, checked before anything large is allocated.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "data/dataset.h"
#include "models/language_model.h"
#include "train/train_args.h"

namespace examples {

struct TrainSettings {
  ModelConfig model;
  int dp = 1, dp_rank = 0;     // data parallelism is over the tp groups (tp_zero_size / tp_zero_rank)
  int64_t seq = 0;             // tokens per sequence
  int64_t steps = 0;           // length of the LR schedule
  int64_t stop = 0;            // last step of this run (--stop-at)
  int64_t batch = 0;           // sequences per data-parallel rank per step
  int64_t warmup = 0, eval_every = 0, task_rows = 0;
  double lr = 0;               // peak
  at::ScalarType dtype = at::kFloat;
};

// Throws bmt::core::Error when --seq (with --batch) needs more memory than this rank has (see below).
TrainSettings resolve_settings(const TrainArgs& args, const Dataset& data);

// A rough lower bound of the bytes one training step needs on a rank that grow with the sequence length
// (activations kept for backward, fp32 logits and their gradient, the gpt position table with its gradient and
// Adam moments), for the check above; deliberately low so that only hopeless settings are refused.
int64_t seq_dependent_nbytes(const ModelConfig& mc, int64_t batch, int64_t seq, int tp, bool checkpointing,
                             int64_t element_nbytes);

// Memory one rank may use: the GPU's total memory, or on CPU MemAvailable split among this node's ranks.
int64_t rank_memory_nbytes();

}  // namespace examples
