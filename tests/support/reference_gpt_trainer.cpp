#include "reference_gpt_trainer.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>

namespace bmt::testing {

ReferenceGptTrainer::ReferenceGptTrainer(const RefGptShape& shape, const std::map<std::string, at::Tensor>& initial,
                                         const RefTrainOptions& options, at::Device device)
    : shape_(shape), opt_(options), device_(device) {
  TORCH_CHECK(opt_.param_dtype == at::kFloat || opt_.param_dtype == at::kBFloat16 || opt_.param_dtype == at::kHalf,
              "ReferenceGptTrainer: parameters must be fp32, bf16 or fp16");
  at::NoGradGuard no_grad;
  for (const auto& [key, t] : initial) {
    at::Tensor master = t.to(device_, at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    params_[key] = master.to(opt_.param_dtype).contiguous().requires_grad_(true);
    // fp32 parameters are their own master (our kernel updates them in place).
    master_[key] = opt_.param_dtype == at::kFloat ? params_[key] : master;
    exp_avg_[key] = at::zeros_like(master);
    exp_avg_sq_[key] = at::zeros_like(master);
    grad_[key] = at::zeros_like(master);
  }
  scaling_ = opt_.loss_scale > 0;
  loss_scale_ = scaling_ ? opt_.loss_scale : 1.0;
  if (opt_.loss_scale_factor < 1) opt_.loss_scale_factor = 1.0 / opt_.loss_scale_factor;
}

at::Tensor ReferenceGptTrainer::forward_rows(const at::Tensor& ids) {
  const int64_t B = ids.size(0), T = ids.size(1), d = shape_.dim, H = shape_.num_heads, rows = B * T;
  TORCH_CHECK(T <= shape_.max_seq_len, "ReferenceGptTrainer: sequence longer than max_seq_len");
  const at::Tensor E = p("wte.weight");
  at::Tensor positions = at::arange(T, ids.options()).repeat({B});  // row b·T + t has position t
  at::Tensor h = at::embedding(E, ids.reshape({-1})) + p("wpe.weight").index_select(0, positions);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, H, d / H}).transpose(1, 2); };
  for (int64_t i = 0; i < shape_.num_layers; ++i) {
    const std::string L = "layers." + std::to_string(i) + ".";
    at::Tensor a = at::layer_norm(h, {d}, p(L + "ln_1.weight"), p(L + "ln_1.bias"), shape_.norm_eps);
    auto qkv = at::linear(a, p(L + "attn.c_attn.weight"), p(L + "attn.c_attn.bias")).reshape({B, T, 3 * d}).chunk(3, -1);
    at::Tensor y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), /*attn_mask=*/{},
                                                    /*dropout_p=*/0.0, /*is_causal=*/true);
    y = y.transpose(1, 2).reshape({B, T, d}).reshape({rows, d});
    h = h + at::linear(y, p(L + "attn.c_proj.weight"), p(L + "attn.c_proj.bias"));
    at::Tensor m = at::layer_norm(h, {d}, p(L + "ln_2.weight"), p(L + "ln_2.bias"), shape_.norm_eps);
    m = at::gelu(at::linear(m, p(L + "mlp.c_fc.weight"), p(L + "mlp.c_fc.bias")), "tanh");
    h = h + at::linear(m, p(L + "mlp.c_proj.weight"), p(L + "mlp.c_proj.bias"));
  }
  h = at::layer_norm(h, {d}, p("ln_f.weight"), p("ln_f.bias"), shape_.norm_eps);
  return at::linear(h, E);  // tied head
}

at::Tensor ReferenceGptTrainer::logits(const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  return forward_rows(ids.to(device_));
}

RefStepResult ReferenceGptTrainer::step(const std::vector<at::Tensor>& rank_batches) {
  TORCH_CHECK(!rank_batches.empty(), "ReferenceGptTrainer::step: no batches");
  RefStepResult r;
  r.loss_scale_used = loss_scale_;
  std::vector<std::string> keys;
  std::vector<at::Tensor> leaves;
  for (auto& [k, t] : params_) {
    keys.push_back(k);
    leaves.push_back(t);
  }
  for (auto& [k, g] : grad_) g.zero_();
  const double world = static_cast<double>(rank_batches.size());
  for (const at::Tensor& batch : rank_batches) {
    at::Tensor tok = batch.to(device_);
    const int64_t T = tok.size(1) - 1;
    at::Tensor logits = forward_rows(tok.narrow(1, 0, T));
    at::Tensor loss = at::cross_entropy_loss(logits.to(at::kFloat), tok.narrow(1, 1, T).reshape({-1}));
    r.losses.push_back(loss.item<double>());
    auto grads = torch::autograd::grad({loss * (loss_scale_ / world)}, leaves, /*grad_outputs=*/{},
                                       /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < keys.size(); ++i)
      if (grads[i].defined()) grad_[keys[i]].add_(grads[i].to(at::kFloat));
  }
  bool finite = true;
  for (auto& [k, g] : grad_) finite = finite && at::isfinite(g).all().item<bool>();
  if (!finite) {
    r.skipped = true;
    good_steps_ = 0;
    if (scaling_) loss_scale_ = std::max(opt_.min_loss_scale, loss_scale_ / opt_.loss_scale_factor);
    return r;
  }
  adam_update(1.0 / loss_scale_);
  if (scaling_ && ++good_steps_ >= opt_.loss_scale_steps && loss_scale_ < opt_.max_loss_scale) {
    loss_scale_ = std::min(opt_.max_loss_scale, loss_scale_ * opt_.loss_scale_factor);
    good_steps_ = 0;
  }
  return r;
}

void ReferenceGptTrainer::adam_update(double inv_scale) {
  at::NoGradGuard no_grad;
  ++adam_step_;
  const double s = static_cast<double>(adam_step_);
  // The per-tensor scalars of core::kernels::adam_step_scalars: double, then rounded to float.
  const float b1 = static_cast<float>(opt_.beta1), omb1 = static_cast<float>(1.0 - opt_.beta1);
  const float b2 = static_cast<float>(opt_.beta2), omb2 = static_cast<float>(1.0 - opt_.beta2);
  const float eps = static_cast<float>(opt_.eps);
  const float decay = static_cast<float>(1.0 - opt_.lr * opt_.weight_decay);
  const float step_size = static_cast<float>(opt_.lr / (1.0 - std::pow(opt_.beta1, s)));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(opt_.beta2, s)));
  const float inv = static_cast<float>(inv_scale);
  for (auto& [k, param] : params_) {
    at::Tensor& m = exp_avg_[k];
    at::Tensor& v = exp_avg_sq_[k];
    at::Tensor& master = master_[k];
    at::Tensor g = grad_[k].mul(inv);
    m.copy_(m.mul(b1).add(g.mul(omb1)));
    v.copy_(v.mul(b2).add(g.mul(g).mul(omb2)));
    // A tensor divisor: ATen turns division by a scalar into a multiplication by its reciprocal on some devices.
    at::Tensor d = v.sqrt().div(at::full_like(v, bc2_sqrt)).add(eps);
    at::Tensor updated = master.mul(decay).sub(m.div(d).mul(step_size));
    master.copy_(updated);
    if (param.scalar_type() != at::kFloat) param.copy_(updated);  // round to nearest even
  }
}

}  // namespace bmt::testing
