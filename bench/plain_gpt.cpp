#include "plain_gpt.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

namespace plain {

namespace {

// Re-entrant activation checkpoint of one block: forward without a graph (saving only the input), backward
// recomputes the block with grad mode on (under the forward's autocast state) and back-propagates through it.
struct CheckpointFn : public torch::autograd::Function<CheckpointFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t block_address) {
    const at::DeviceType dt = x.device().type();
    ctx->saved_data["block"] = block_address;
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(dt);
    ctx->saved_data["autocast_dtype"] = static_cast<int64_t>(at::autocast::get_autocast_dtype(dt));
    ctx->save_for_backward({x});
    auto* block = reinterpret_cast<BlockImpl*>(block_address);
    return block->forward(x);  // grad mode is off inside a custom Function's forward
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto* block = reinterpret_cast<BlockImpl*>(ctx->saved_data["block"].toInt());
    const bool autocast = ctx->saved_data["autocast"].toBool();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt());
    at::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      AutocastScope scope(autocast, x.device().type(), dtype);
      out = block->forward(x);
    }
    torch::autograd::backward({out}, {grad_outputs[0]});
    return {x.grad(), at::Tensor()};
  }
};

}  // namespace

BlockImpl::BlockImpl(const GptConfig& c) : num_heads(c.num_heads) {
  using torch::nn::LayerNormOptions;
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(LayerNormOptions({c.dim}).eps(c.norm_eps)));
  c_attn = register_module("c_attn", torch::nn::Linear(c.dim, 3 * c.dim));
  attn_proj = register_module("attn_proj", torch::nn::Linear(c.dim, c.dim));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(LayerNormOptions({c.dim}).eps(c.norm_eps)));
  c_fc = register_module("c_fc", torch::nn::Linear(c.dim, c.ffn_dim));
  mlp_proj = register_module("mlp_proj", torch::nn::Linear(c.ffn_dim, c.dim));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  auto qkv = c_attn->forward(ln_1->forward(x)).chunk(3, -1);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, num_heads, C / num_heads}).transpose(1, 2); };
  at::Tensor y = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), /*attn_mask=*/{},
                                                  /*dropout_p=*/0.0, /*is_causal=*/true);
  at::Tensor h = x + attn_proj->forward(y.transpose(1, 2).reshape({B, T, C}));
  return h + mlp_proj->forward(at::gelu(c_fc->forward(ln_2->forward(h)), "tanh"));
}

GptImpl::GptImpl(const GptConfig& c) : config(c) {
  wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.dim));
  wpe = register_module("wpe", torch::nn::Embedding(c.max_seq_len, c.dim));
  for (int64_t i = 0; i < c.num_layers; ++i) blocks.push_back(register_module("h" + std::to_string(i), Block(c)));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim}).eps(c.norm_eps)));
  // GPT-2 init: Linear/Embedding weights normal(0, 0.02), biases 0 (LayerNorm keeps its 1/0 default).
  at::NoGradGuard no_grad;
  wte->weight.normal_(0.0, 0.02);
  wpe->weight.normal_(0.0, 0.02);
  for (auto& b : blocks)
    for (auto* lin : {&b->c_attn, &b->attn_proj, &b->c_fc, &b->mlp_proj}) {
      (*lin)->weight.normal_(0.0, 0.02);
      (*lin)->bias.zero_();
    }
}

at::Tensor GptImpl::forward(const at::Tensor& ids) {
  const int64_t T = ids.size(1);
  TORCH_CHECK(T <= config.max_seq_len, "plain::Gpt: sequence of ", T, " tokens exceeds max_seq_len ",
              config.max_seq_len);
  at::Tensor h = wte->forward(ids) + wpe->forward(at::arange(T, ids.options()));
  const bool ckpt = checkpointing && at::GradMode::is_enabled();
  for (auto& b : blocks) h = ckpt ? CheckpointFn::apply(h, reinterpret_cast<int64_t>(b.get())) : b->forward(h);
  return at::linear(ln_f->forward(h), wte->weight);  // tied output projection
}

at::Tensor GptImpl::loss(const at::Tensor& ids) {
  const int64_t T = ids.size(1) - 1;
  at::Tensor logits = forward(ids.narrow(1, 0, T));
  const int64_t V = logits.size(-1);
  return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, V}), ids.narrow(1, 1, T).reshape({-1}));
}

int64_t GptImpl::num_params() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

int64_t GptImpl::num_matmul_params() const { return num_params() - wpe->weight.numel(); }

AutocastScope::AutocastScope(bool enabled, at::DeviceType device_type, at::ScalarType dtype)
    : enabled_(enabled), device_type_(device_type) {
  if (!enabled_) return;
  prev_enabled_ = at::autocast::is_autocast_enabled(device_type_);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_type_);
  at::autocast::set_autocast_enabled(device_type_, true);
  at::autocast::set_autocast_dtype(device_type_, dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
}

FusedAdamW::FusedAdamW(std::vector<at::Tensor> params, double lr, double beta1, double beta2, double eps,
                       double weight_decay, bool use_fused)
    : params_(std::move(params)),
      lr_(lr),
      beta1_(beta1),
      beta2_(beta2),
      eps_(eps),
      weight_decay_(weight_decay),
      fused_(use_fused) {
  if (fused_) {
    at::NoGradGuard no_grad;
    for (const auto& p : params_) {
      exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
      exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
      steps_.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
    }
  } else {
    fallback_ = std::make_unique<torch::optim::AdamW>(
        params_, torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(weight_decay));
  }
}

void FusedAdamW::step() {
  if (fused_) {
    std::vector<at::Tensor> p, g, m, v, s;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].grad().defined()) continue;
      p.push_back(params_[i]);
      g.push_back(params_[i].grad());
      m.push_back(exp_avg_[i]);
      v.push_back(exp_avg_sq_[i]);
      s.push_back(steps_[i]);
    }
    if (p.empty()) return;
    at::NoGradGuard no_grad;
    try {
      at::_foreach_add_(s, 1);
      at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr_, beta1_, beta2_, weight_decay_, eps_,
                        /*amsgrad=*/false, /*maximize=*/false);
      return;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "plain: at::_fused_adamw_ unavailable (%s); falling back to torch::optim::AdamW\n",
                   std::string(e.what()).substr(0, 200).c_str());
      fused_ = false;
      exp_avg_.clear();
      exp_avg_sq_.clear();
      steps_.clear();
      fallback_ = std::make_unique<torch::optim::AdamW>(
          params_, torch::optim::AdamWOptions(lr_).betas({beta1_, beta2_}).eps(eps_).weight_decay(weight_decay_));
    }
  }
  fallback_->step();
}

void FusedAdamW::zero_grad() {
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
}

}  // namespace plain
