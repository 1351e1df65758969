// plain_gpt: the benchmark's GPT-2 in plain LibTorch (no bmtrain), the "plain PyTorch" baseline of
// BENCHMARKS.md and /work/shared/reference/peers.md.
//
// Same model as examples/models/gpt.h: pre-LN, learned positions, tied embeddings (logits = ln_f(h)·wteᵀ),
// GELU-tanh MLP, causal SDPA attention, biases on; init normal(0, 0.02) for Linear/Embedding weights, biases 0,
// LayerNorm 1/0, eps 1e-5; loss = fp32 cross-entropy.
//
// Precision (peers.md's plain row): fp32 parameters with bf16 autocast on CUDA (AutocastScope around forward and
// loss), fp32 everywhere on CPU. Optimizer: FusedAdamW (at::_fused_adamw_ over every parameter, one fused
// multi-tensor kernel, falls back to torch::optim::AdamW when the fused op is unavailable).
// Activation checkpointing (Gpt::checkpointing): each block runs without a graph in forward and is recomputed in
// backward (re-entrant, like torch.utils.checkpoint(use_reentrant=True)); the autocast state of the forward is
// re-entered for the recomputation.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <vector>

namespace plain {

struct GptConfig {
  int64_t vocab_size = 50304;
  int64_t max_seq_len = 1024;
  int64_t num_layers = 12;
  int64_t dim = 768;
  int64_t num_heads = 12;
  int64_t ffn_dim = 3072;
  double norm_eps = 1e-5;
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const GptConfig& c);
  at::Tensor forward(const at::Tensor& x);
  int64_t num_heads;
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  torch::nn::Linear c_attn{nullptr}, attn_proj{nullptr}, c_fc{nullptr}, mlp_proj{nullptr};
};
TORCH_MODULE(Block);

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptConfig& c);
  // ids (B, T) int64 -> logits (B, T, vocab) (bf16 under autocast, else fp32).
  at::Tensor forward(const at::Tensor& ids);
  // Mean next-token cross-entropy in fp32 over ids (B, T+1): inputs ids[:, :T], targets ids[:, 1:].
  at::Tensor loss(const at::Tensor& ids);
  // Total parameters, and those used in matmuls per token (all but the position embedding).
  int64_t num_params() const;
  int64_t num_matmul_params() const;

  GptConfig config;
  bool checkpointing = false;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Gpt);

// bf16 autocast on `device_type` while alive (enabled = false: does nothing). Mirrors torch.autocast: the weight
// cast cache is cleared when the outermost scope ends.
class AutocastScope {
 public:
  AutocastScope(bool enabled, at::DeviceType device_type, at::ScalarType dtype = at::kBFloat16);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
  at::DeviceType device_type_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

// AdamW over fp32 parameters: at::_fused_adamw_ (CUDA and CPU kernels in torch >= 2.4), else torch::optim::AdamW.
class FusedAdamW {
 public:
  FusedAdamW(std::vector<at::Tensor> params, double lr, double beta1, double beta2, double eps, double weight_decay,
             bool use_fused = true);
  void step();
  void zero_grad();  // set_to_none, like torch's default
  bool fused() const { return fused_; }

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, steps_;
  double lr_, beta1_, beta2_, eps_, weight_decay_;
  bool fused_;
  std::unique_ptr<torch::optim::AdamW> fallback_;
};

}  // namespace plain
