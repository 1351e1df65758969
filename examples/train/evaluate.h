// Held-out evaluation (collective: every rank calls it; each evaluates its own share, results are global).
// Shares are per data-parallel rank (tp_zero_rank; the rank at tp_size 1): a tp group evaluates one share.
//   eval_loss      mean next-token loss over `batches` held-out batches per data-parallel rank (batch index
//                  dp_rank + dp·i)
//   task_accuracy  exact-match accuracy on the dataset's held-out task examples (rows split over data-parallel
//                  ranks); nullopt when the dataset has no task
#pragma once

#include <optional>

#include "data/dataset.h"
#include "models/language_model.h"

namespace examples {

double eval_loss(LanguageModel& model, const Dataset& data, int64_t batches, int64_t rows, int64_t seq);
std::optional<double> task_accuracy(LanguageModel& model, const Dataset& data, int64_t rows);

// The teacher-forced exact-match verdict per row (rows,) bool for a task batch on this rank (no collectives
// besides the model's own): logits (rows, len - 1, V or V / tp) = model.forward(tokens[:, :-1]).
at::Tensor task_correct_rows(LanguageModel& model, const at::Tensor& logits, const TaskBatch& batch);

}  // namespace examples
