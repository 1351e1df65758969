// GPT-2 (pre-LN) over bmtrain's ZeRO layers.
//
//   h = wte[ids] + wpe[0..T)
//   per layer:  h += attn.c_proj(causal_sdpa(split(attn.c_attn(ln_1(h)))))
//               h += mlp.c_proj(gelu_tanh(mlp.c_fc(ln_2(h))))
//   logits = ln_f(h) · wteᵀ           (tied output projection; wte gathered once per forward)
// Biases on; weights normal(0, 0.02), biases 0, LayerNorm weight 1 / bias 0, eps 1e-5. Linear weights are stored
// (out, in) like torch (Hugging Face's Conv1D stores (in, out): export/hf_gpt2.cpp transposes).
// State-dict keys: wte.weight, wpe.weight, layers.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}.*,
// ln_f.{weight,bias}.
#pragma once

#include "bmt/block_list.h"
#include "bmt/nn/layers.h"
#include "models/language_model.h"

namespace examples {

class GptAttentionImpl : public torch::nn::Module {
 public:
  GptAttentionImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  int64_t num_heads;
  bmt::nn::Linear c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(GptAttention);

class GptMlpImpl : public torch::nn::Module {
 public:
  GptMlpImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  bmt::nn::Linear c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(GptMlp);

class GptLayerImpl : public torch::nn::Module {
 public:
  GptLayerImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  bmt::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  GptAttention attn{nullptr};
  GptMlp mlp{nullptr};
};
TORCH_MODULE(GptLayer);

class Gpt : public LanguageModel {
 public:
  Gpt(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& ids) override;
  const ModelConfig& config() const override { return config_; }

  bmt::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::shared_ptr<bmt::TransformerBlockList> layers;
  bmt::nn::LayerNorm ln_f{nullptr};

 private:
  ModelConfig config_;
};

}  // namespace examples
