// LanguageModel under pipeline parallelism (declared in models/language_model.h): the micro-batch callbacks that
// put the embedding on the first stage and the head and loss on the last.
#include <ATen/core/grad_mode.h>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/pipeline/pipeline.h"
#include "models/language_model.h"

namespace examples {

at::Tensor LanguageModel::embed_rows(const TokenRows&) {
  BMT_ERROR("model ", config().arch, ": pipeline parallelism is not implemented for this architecture (use gpt)");
}

at::Tensor LanguageModel::head_rows(const at::Tensor&, const TokenRows&) {
  BMT_ERROR("model ", config().arch, ": pipeline parallelism is not implemented for this architecture (use gpt)");
}

struct LanguageModel::PipelineBatch {
  std::vector<at::Tensor> ids, targets;  // per micro-batch
  std::vector<TokenRows> rows;
};

namespace {

// Splits (B, T) ids and targets into the pipeline's micro-batches along B.
void split_micro(const at::Tensor& ids, const at::Tensor& targets, int micro, std::vector<at::Tensor>& ids_out,
                 std::vector<at::Tensor>& targets_out, std::vector<TokenRows>& rows_out) {
  BMT_CHECK(ids.dim() == 2 && targets.sizes() == ids.sizes(), "model: pipeline batches are (B, T) ids and targets");
  const int64_t B = ids.size(0);
  BMT_CHECK(B % micro == 0, "model: a batch of ", B, " sequences per data-parallel rank cannot be split into ", micro,
            " equal micro-batches; choose a batch size that is a multiple of the micro-batch count (--micro-batches)");
  const int64_t b = B / micro;
  for (int m = 0; m < micro; ++m) {
    ids_out.push_back(ids.narrow(0, m * b, b));
    targets_out.push_back(targets.narrow(0, m * b, b));
    rows_out.push_back(token_rows(ids_out.back()));
  }
}

}  // namespace

bmt::PipelineTransformerBlockList::Step LanguageModel::pipeline_callbacks(const at::Tensor& ids,
                                                                        const at::Tensor& targets) {
  auto batch = std::make_shared<PipelineBatch>();
  split_micro(ids, targets, pipe_->num_micro_batches(), batch->ids, batch->targets, batch->rows);
  bmt::PipelineTransformerBlockList::Step step;
  step.first = [this, batch](int m) { return std::vector<at::Tensor>{embed_rows(batch->rows[m])}; };
  step.extra_args = [batch](int m) { return std::vector<at::Tensor>{batch->rows[m].shape}; };
  step.last = [this, batch](int m, const std::vector<at::Tensor>& h) {
    return rows_loss(head_rows(h.at(0), batch->rows[m]), batch->rows[m], batch->targets[m]);
  };
  return step;
}

at::Tensor LanguageModel::pipeline_step(const at::Tensor& ids, const at::Tensor& targets,
                                        bmt::optim::OptimManager& optim) {
  BMT_CHECK(pipelined(), "model: pipeline_step needs pipe_size > 1 (use loss() and OptimManager::backward)");
  bmt::PipelineTransformerBlockList::Step step = pipeline_callbacks(ids, targets);
  step.scale_loss = [&optim](const at::Tensor& l) { return optim.scale_loss(l); };
  return pipe_->forward_backward(step);
}

at::Tensor LanguageModel::pipeline_eval_loss(const at::Tensor& ids, const at::Tensor& targets) {
  BMT_CHECK(!at::GradMode::is_enabled(), "model: with pipeline parallelism loss() only evaluates (under no_grad); "
            "train with pipeline_step(ids, targets, optim)");
  return pipe_->forward_only(pipeline_callbacks(ids, targets));
}

}  // namespace examples
