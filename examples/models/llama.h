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
//
// Tensor parallelism (tp_size > 1): the layout of models/gpt.h (sequence parallel by default). wq, wk, wv, w1, w3
// and output are ColumnParallelLinear, wo and w2 RowParallelLinear, tok_embeddings a VPEmbedding; each rank
// computes num_heads / tp query heads with their num_kv_heads / tp kv heads (tp must divide both), RoPE on whole
// sequences after the column-parallel all-gather; the loss is the vocabulary-parallel fused cross-entropy on
// output's slices. RMSNorm weights are tp-replicated (gradients summed, or averaged without sequence parallelism).
#pragma once

#include "bmt/block_list.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/parallel_layers.h"
#include "models/language_model.h"

namespace examples {

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const ModelConfig& c, at::ScalarType dtype);
  // shape: TokenRows::shape (tp_size > 1 only; x is then rows (rows, d)).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& shape = {});
  int64_t num_heads, num_kv_heads, head_dim;  // heads on this rank (divided by tp_size)
  double rope_theta;
  bmt::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};  // tp_size 1
  bmt::nn::ColumnParallelLinear wq_tp{nullptr}, wk_tp{nullptr}, wv_tp{nullptr};  // tp_size > 1 (same names)
  bmt::nn::RowParallelLinear wo_tp{nullptr};
};
TORCH_MODULE(LlamaAttention);

class LlamaFeedForwardImpl : public torch::nn::Module {
 public:
  LlamaFeedForwardImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  bmt::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};       // tp_size 1
  bmt::nn::ColumnParallelLinear w1_tp{nullptr}, w3_tp{nullptr};  // tp_size > 1 (same names)
  bmt::nn::RowParallelLinear w2_tp{nullptr};
};
TORCH_MODULE(LlamaFeedForward);

class LlamaLayerImpl : public torch::nn::Module {
 public:
  LlamaLayerImpl(const ModelConfig& c, at::ScalarType dtype);
  // {x} (tp_size 1) or {x rows, TokenRows::shape} (tp_size > 1) -> {output}.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in);
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

  bmt::nn::Embedding tok_embeddings{nullptr};  // tp_size 1
  bmt::nn::VPEmbedding tok_embeddings_tp{nullptr};  // tp_size > 1, registered as tok_embeddings
  std::shared_ptr<bmt::TransformerBlockList> layers;
  bmt::nn::RMSNorm norm{nullptr};
  bmt::nn::Linear output{nullptr};                // tp_size 1
  bmt::nn::ColumnParallelLinear output_tp{nullptr};  // tp_size > 1, registered as output

 protected:
  at::Tensor logit_rows(const TokenRows& rows) override;

 private:
  ModelConfig config_;
};

}  // namespace examples
