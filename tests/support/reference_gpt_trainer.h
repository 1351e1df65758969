// ReferenceGptTrainer: GPT-2 training in plain LibTorch (ATen ops and autograd only, nothing of bmtrain) with the
// numerics bmtrain's training path has, so that a per-step loss comparison checks our engine rather than the
// precision recipe (issue 17 item 5).
//
// What it reproduces of examples::Gpt + bmt::optim::AdamOptimizer + OptimManager:
//  * the model on token rows (B·T, d) with the same ATen ops in the same shapes: embedding + position rows,
//    pre-LN blocks (layer_norm, linear, causal SDPA, GELU-tanh), tied head at::linear(ln_f(h), wte);
//  * parameters in `param_dtype` (bf16 or fp32) used directly by the ops (no autocast): bf16 activations and
//    residual stream when the parameters are bf16;
//  * the loss: mean fp32 cross-entropy of every "rank's" batch; the backward of each batch runs separately on
//    loss · loss_scale / world (bmt's scale_loss with grad_scale = world), its parameter-dtype gradients (the tied
//    wte's two uses summed by autograd in the parameter dtype, as ours does before GatherParamFn) are converted to
//    fp32 and summed over the batches into fp32 gradient buffers (our reduce-scatter in fp32);
//  * OptimManager's rule: any inf/NaN gradient skips the step (no optimizer step, step counter unchanged), divides
//    the scale by the factor (not below the minimum); loss_scale_steps good steps multiply it (not above the max);
//  * AdamW exactly as core/kernels/adam.h (fp32 master weights, fp32 moments, scalars computed in double and
//    rounded to float, decay = 1 - lr·wd applied to the master, bias corrections of the optimizer's own step
//    count), each operation a separate correctly rounded ATen op, the result rounded to the parameter dtype.
// Initial values: the full state dict of an initialised examples::Gpt (bmt::state_dict), so both start equal.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace bmt::testing {

struct RefGptShape {
  int64_t vocab_size = 0, max_seq_len = 0, num_layers = 0, dim = 0, num_heads = 0, ffn_dim = 0;
  double norm_eps = 1e-5;
};

struct RefTrainOptions {
  at::ScalarType param_dtype = at::kFloat;
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double loss_scale = 0;  // 0: no loss scaling (scale 1), as OptimManagerOptions
  double loss_scale_factor = 2;
  int64_t loss_scale_steps = 1024;
  double min_loss_scale = 1;
  double max_loss_scale = std::numeric_limits<double>::infinity();
};

struct RefStepResult {
  std::vector<double> losses;  // mean loss of each batch (unscaled)
  bool skipped = false;        // inf/NaN gradient: no update
  double loss_scale_used = 1;  // the scale this step's backward ran with
};

class ReferenceGptTrainer {
 public:
  // initial: full tensors under examples::Gpt's state-dict keys (any dtype/device; copied to `device`).
  ReferenceGptTrainer(const RefGptShape& shape, const std::map<std::string, at::Tensor>& initial,
                      const RefTrainOptions& options, at::Device device);

  // One training step over one batch (B, T+1) of token ids per data-parallel rank.
  RefStepResult step(const std::vector<at::Tensor>& rank_batches);

  // Logits (B·T, V) in the parameter dtype of ids (B, T) (no graph).
  at::Tensor logits(const at::Tensor& ids);
  const at::Tensor& param(const std::string& key) const { return params_.at(key); }
  double loss_scale() const { return loss_scale_; }
  int64_t optimizer_steps() const { return adam_step_; }

 private:
  at::Tensor forward_rows(const at::Tensor& ids);  // (B, T) -> logits (B·T, V)
  at::Tensor p(const std::string& key) { return params_.at(key); }
  void adam_update(double inv_scale);

  RefGptShape shape_;
  RefTrainOptions opt_;
  at::Device device_;
  std::map<std::string, at::Tensor> params_;  // param_dtype, leaves that require grad
  std::map<std::string, at::Tensor> master_, exp_avg_, exp_avg_sq_, grad_;  // fp32
  double loss_scale_ = 1;
  bool scaling_ = false;
  int64_t good_steps_ = 0;
  int64_t adam_step_ = 0;
};

}  // namespace bmt::testing
