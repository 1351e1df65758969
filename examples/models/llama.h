// Llama over bmtrain's ZeRO layers: RMSNorm, rotary positions (models/rope.h), SwiGLU, no biases, optional
// grouped-query attention (num_kv_heads < num_heads), untied output projection.
//
//   h = tok_embeddings[ids]
//   per layer:  h += attention.wo(sdpa_causal(rope(wq·x), rope(wk·x), wv·x)),  x = attention_norm(h)
//               h += feed_forward.w2(silu(w1·x) * (w3·x)),                     x = ffn_norm(h)
//   logits = output(norm(h))
// Weights normal(0, 0.02), RMSNorm weights 1. State-dict keys follow Meta's checkpoint names:
// tok_embeddings.weight, layers.<i>.{attention_norm,attention.{wq,wk,wv,wo},ffn_norm,feed_forward.{w1,w2,w3}}.weight,
// norm.weight, output.weight.
#pragma once

#include "bmt/block_list.h"
#include "bmt/nn/layers.h"
#include "models/language_model.h"

namespace examples {

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  int64_t num_heads, num_kv_heads, head_dim;
  double rope_theta;
  bmt::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
};
TORCH_MODULE(LlamaAttention);

class LlamaFeedForwardImpl : public torch::nn::Module {
 public:
  LlamaFeedForwardImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  bmt::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(LlamaFeedForward);

class LlamaLayerImpl : public torch::nn::Module {
 public:
  LlamaLayerImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  bmt::nn::RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  LlamaAttention attention{nullptr};
  LlamaFeedForward feed_forward{nullptr};
};
TORCH_MODULE(LlamaLayer);

class Llama : public LanguageModel {
 public:
  Llama(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& ids) override;
  const ModelConfig& config() const override { return config_; }

  bmt::nn::Embedding tok_embeddings{nullptr};
  std::shared_ptr<bmt::TransformerBlockList> layers;
  bmt::nn::RMSNorm norm{nullptr};
  bmt::nn::Linear output{nullptr};

 private:
  ModelConfig config_;
};

}  // namespace examples
