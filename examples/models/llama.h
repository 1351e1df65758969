// Llama over bmtrain's ZeRO layers: RMSNorm, rotary positions (models/rope.h), SwiGLU, no biases, optional
// grouped-query attention (num_kv_heads < num_heads), untied output projection. Under pipeline parallelism
// (pipe_size > 1) the layers are a bmt::PipelineTransformerBlockList: tok_embeddings on the first stage, norm and
// output on the last (models/pipeline_lm.cpp runs the step).
//
//   h = tok_embeddings[ids]
//   per layer:  h += attention.wo(sdpa_causal(rope(wq·x), rope(wk·x), wv·x)),  x = attention_norm(h)
//               h += feed_forward.w2(silu(w1·x) * (w3·x)),                     x = ffn_norm(h)
//   logits = output(norm(h))
// Weights normal(0, 0.02), RMSNorm weights 1. State-dict keys follow Meta's checkpoint names:
// tok_embeddings.weight, layers.<i>.{attention_norm,attention.{wq,wk,wv,wo},ffn_norm,feed_forward.{w1,w2,w3}}.weight,
// norm.weight, output.weight.
//
// Tensor parallelism (tp_size > 1): llama_tp_plan(), the layout of models/gpt.h (sequence parallel by default).
// wq, wk, wv, w1, w3 column, wo and w2 row, tok_embeddings vocab_embedding, output vocab_head; each rank
// computes num_heads / tp query heads with their num_kv_heads / tp kv heads (tp must divide both), RoPE on whole
// sequences after the column-parallel all-gather (one gather for wq/wk/wv, one for w1/w3: nn::shared_input); the
// loss is the vocabulary-parallel fused cross-entropy on output's slices. RMSNorm weights are tp-replicated
// (gradients summed, or averaged without sequence parallelism).
#pragma once

#include "bmt/engine/block_list.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/planned_layers.h"
#include "models/language_model.h"

namespace examples {

// The Llama layout above; sequence_parallel as InitOptions::sequence_parallel.
bmt::nn::TpPlan llama_tp_plan(bool sequence_parallel = true);

// Layers are built in `tp`, the scope of their module path ("layers.3", "layers.3.attention").
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp);
  // x: token rows (rows, d); shape: TokenRows::shape.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& shape);
  int64_t head_dim;
  double rope_theta;
  bmt::nn::PlannedLinear wq, wk, wv, wo;
};
TORCH_MODULE(LlamaAttention);

class LlamaFeedForwardImpl : public torch::nn::Module {
 public:
  LlamaFeedForwardImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp);
  at::Tensor forward(const at::Tensor& x);
  bmt::nn::PlannedLinear w1, w2, w3;
};
TORCH_MODULE(LlamaFeedForward);

class LlamaLayerImpl : public torch::nn::Module {
 public:
  LlamaLayerImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp);
  // {x rows (rows, d), TokenRows::shape} -> {output rows}.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in);
  bmt::nn::RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  LlamaAttention attention{nullptr};
  LlamaFeedForward feed_forward{nullptr};
};
TORCH_MODULE(LlamaLayer);

class Llama : public LanguageModel {
 public:
  Llama(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype);
  const ModelConfig& config() const override { return config_; }

  bmt::nn::PlannedEmbedding tok_embeddings;
  std::shared_ptr<bmt::TransformerBlockList> layers;
  bmt::nn::RMSNorm norm{nullptr};
  bmt::nn::PlannedLinear output;

 protected:
  at::Tensor logit_rows(const TokenRows& rows) override;
  at::Tensor embed_rows(const TokenRows& rows) override;
  at::Tensor head_rows(const at::Tensor& hidden, const TokenRows& rows) override;

 private:
  ModelConfig config_;
};

}  // namespace examples
