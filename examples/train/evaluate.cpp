#include "train/evaluate.h"

#include "bmt/runtime/distributed.h"

namespace examples {

// Data parallelism is over tp groups: the ranks of one tp group evaluate the same rows (tp_zero_rank), and
// results are combined over the data-parallel group (tp_zero_comm; every rank at tp_size 1).

double eval_loss(LanguageModel& model, const Dataset& data, int64_t batches, int64_t rows, int64_t seq) {
  const auto& cfg = bmt::config();
  at::NoGradGuard no_grad;
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    at::Tensor tokens =
        data.eval_batch(cfg.tp_zero_rank + static_cast<int64_t>(cfg.tp_zero_size) * i, rows, seq).to(cfg.device);
    total += model.loss(tokens.narrow(1, 0, seq), tokens.narrow(1, 1, seq)).item<double>();
  }
  // The mean over every rank: tp ranks hold equal values.
  return bmt::sum_loss(at::tensor(total / static_cast<double>(batches), at::kDouble).to(cfg.device)).item<double>();
}

at::Tensor task_correct_rows(LanguageModel& model, const at::Tensor& logits, const TaskBatch& batch) {
  // The prediction for token t comes from position t - 1.
  at::Tensor predicted = model.argmax_vocab(logits.narrow(1, batch.answer_begin - 1, batch.answer_len));
  at::Tensor expected = batch.tokens.narrow(1, batch.answer_begin, batch.answer_len).to(predicted.device());
  return (predicted == expected).all(1);
}

std::optional<double> task_accuracy(LanguageModel& model, const Dataset& data, int64_t rows) {
  const auto& cfg = bmt::config();
  std::optional<TaskBatch> batch = data.task_batch(rows);
  if (!batch) return std::nullopt;
  at::NoGradGuard no_grad;
  // Data-parallel rank d scores rows d, d + dp, ... (an empty share still joins the model's collectives).
  const int dp = cfg.tp_zero_size, dp_rank = cfg.tp_zero_rank;
  at::Tensor mine = batch->tokens.slice(0, dp_rank, rows, dp);
  TaskBatch local{mine, batch->answer_begin, batch->answer_len};
  double correct = 0;
  if (mine.size(0) > 0) {
    at::Tensor input = mine.narrow(1, 0, mine.size(1) - 1).to(cfg.device);
    correct = task_correct_rows(model, model.forward(input), local).sum().item<double>();
  } else {
    model.forward(batch->tokens.narrow(0, 0, 1).narrow(1, 0, batch->tokens.size(1) - 1).to(cfg.device));
  }
  at::Tensor sum = bmt::distributed::all_reduce(at::tensor(correct, at::kDouble).to(cfg.device),
                                                bmt::core::ReduceOp::kSum, *cfg.tp_zero_comm);
  return sum.item<double>() / static_cast<double>(rows);
}

}  // namespace examples
