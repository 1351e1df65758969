// run_training: the train_gpt loop (collective: every rank of an initialised bmtrain job calls it).
//
// Per step: this data-parallel rank's batch (data/dataset.h, different on every data-parallel rank; the ranks of
// a tensor-parallel group (--tp) share one) -> forward -> fp32 cross-entropy (LanguageModel::loss) ->
// OptimManager backward (gradients summed over the data-parallel group by the ZeRO reduce-scatter, divided by its
// size: the mean) -> global-norm clipping -> AdamW step on the local shards -> cosine LR schedule
// with linear warm-up. The reported loss is the mean over ranks. Held-out loss and task accuracy at step 0,
// every eval_every steps and at the end; checkpoints every save_every steps and at the end; samples and the
// optional Hugging Face export after the last step. Rank 0 prints progress and writes the metrics log.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "train/train_args.h"

namespace examples {

struct TrainResult {
  int64_t start_step = 0, end_step = 0;
  double first_loss = 0;  // train loss of the first step of this run
  double last_loss = 0;   // mean train loss of the last (up to) 20 steps
  std::optional<double> first_eval_loss, last_eval_loss, first_task_acc, last_task_acc;
  double wall_s = 0, mean_tokens_per_s = 0;
  std::vector<std::string> samples;  // "prompt|completion" per sample
};

TrainResult run_training(const TrainArgs& args);

}  // namespace examples
