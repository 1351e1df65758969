#include "train/evaluate.h"

#include "bmt/distributed.h"

namespace examples {

double eval_loss(LanguageModel& model, const Dataset& data, int64_t batches, int64_t rows, int64_t seq) {
  const auto& cfg = bmt::config();
  at::NoGradGuard no_grad;
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    at::Tensor tokens = data.eval_batch(cfg.rank + static_cast<int64_t>(cfg.world_size) * i, rows, seq).to(cfg.device);
    at::Tensor logits = model.forward(tokens.narrow(1, 0, seq));
    total += lm_loss(logits, tokens.narrow(1, 1, seq)).item<double>();
  }
  return bmt::sum_loss(at::tensor(total / static_cast<double>(batches), at::kDouble).to(cfg.device)).item<double>();
}

at::Tensor task_correct_rows(const at::Tensor& logits, const TaskBatch& batch) {
  // The prediction for token t comes from position t - 1.
  at::Tensor predicted = logits.narrow(1, batch.answer_begin - 1, batch.answer_len).argmax(-1);
  at::Tensor expected = batch.tokens.narrow(1, batch.answer_begin, batch.answer_len).to(predicted.device());
  return (predicted == expected).all(1);
}

std::optional<double> task_accuracy(LanguageModel& model, const Dataset& data, int64_t rows) {
  const auto& cfg = bmt::config();
  std::optional<TaskBatch> batch = data.task_batch(rows);
  if (!batch) return std::nullopt;
  at::NoGradGuard no_grad;
  // Rank r scores rows r, r + world, ... (an empty share still joins the model's collectives).
  at::Tensor mine = batch->tokens.slice(0, cfg.rank, rows, cfg.world_size);
  TaskBatch local{mine, batch->answer_begin, batch->answer_len};
  double correct = 0;
  if (mine.size(0) > 0) {
    at::Tensor input = mine.narrow(1, 0, mine.size(1) - 1).to(cfg.device);
    correct = task_correct_rows(model.forward(input), local).sum().item<double>();
  } else {
    model.forward(batch->tokens.narrow(0, 0, 1).narrow(1, 0, batch->tokens.size(1) - 1).to(cfg.device));
  }
  at::Tensor sum = bmt::distributed::all_reduce(at::tensor(correct, at::kDouble).to(cfg.device),
                                                bmt::core::ReduceOp::kSum, *cfg.comm);
  return sum.item<double>() / static_cast<double>(rows);
}

}  // namespace examples
