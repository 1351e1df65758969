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
//
// Tensor parallelism (bmt::config().tp_size > 1; the same layout in models/llama.h). Every rank of a tp group
// gets the same batch; heads, ff features and the vocabulary are split over the group:
//   attn.c_attn   ColumnParallelLinear(d, 3d, split_groups 3): this rank's heads of Q, K and V (num_heads / tp)
//   attn.c_proj   RowParallelLinear(d, d)          mlp.c_fc ColumnParallelLinear(d, ff)   mlp.c_proj RowParallel
//   wte           VPEmbedding: lookup of this rank's vocabulary range, tied projection to its logits slice
//   loss          bmt::loss::fused_cross_entropy(parallel) on the slices: the (rows, vocab) logits never exist
// Activation layout: sequence parallel (InitOptions::sequence_parallel, the default): the batch's B·T tokens are
// rows (row = b·T + t), padded to a multiple of tp, and tp rank r holds the r-th contiguous chunk of them between
// the tensor-parallel regions (embedding sum, positions wpe[row % T], residuals, LayerNorms on the local rows).
// A column-parallel layer all-gathers the rows; attention sees whole (B, T) sequences of its heads; a row-parallel
// layer reduce-scatters back to the local rows. With sequence_parallel = false (Megatron) every rank holds all
// rows and row-parallel outputs are all-reduced. tp-replicated parameters (wpe, LayerNorms, row-parallel biases)
// have their gradients summed over tp (sequence parallel: each rank saw its rows) or averaged (Megatron).
// Parameter names, shapes and state_dict values are those of the tp_size 1 model (c_attn keeps its (3d, d)
// layout), and tp_size 1 runs exactly the dense code. tp_size must divide heads, ff and vocab (error otherwise).
#pragma once

#include "bmt/block_list.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/parallel_layers.h"
#include "models/language_model.h"

namespace examples {

class GptAttentionImpl : public torch::nn::Module {
 public:
  GptAttentionImpl(const ModelConfig& c, at::ScalarType dtype);
  // shape: TokenRows::shape (tp_size > 1 only; x is then rows (rows, d)).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& shape = {});
  int64_t num_heads;  // heads computed on this rank (num_heads / tp_size)
  bmt::nn::Linear c_attn{nullptr}, c_proj{nullptr};  // tp_size 1
  bmt::nn::ColumnParallelLinear c_attn_tp{nullptr};   // tp_size > 1, registered as c_attn
  bmt::nn::RowParallelLinear c_proj_tp{nullptr};      // tp_size > 1, registered as c_proj
};
TORCH_MODULE(GptAttention);

class GptMlpImpl : public torch::nn::Module {
 public:
  GptMlpImpl(const ModelConfig& c, at::ScalarType dtype);
  at::Tensor forward(const at::Tensor& x);
  bmt::nn::Linear c_fc{nullptr}, c_proj{nullptr};  // tp_size 1
  bmt::nn::ColumnParallelLinear c_fc_tp{nullptr};   // tp_size > 1, registered as c_fc
  bmt::nn::RowParallelLinear c_proj_tp{nullptr};    // tp_size > 1, registered as c_proj
};
TORCH_MODULE(GptMlp);

class GptLayerImpl : public torch::nn::Module {
 public:
  GptLayerImpl(const ModelConfig& c, at::ScalarType dtype);
  // {x} (tp_size 1: x (B, T, d)) or {x, TokenRows::shape} (tp_size > 1: x rows (rows, d)) -> {output}.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in);
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

  bmt::nn::Embedding wte{nullptr}, wpe{nullptr};  // wte: tp_size 1
  bmt::nn::VPEmbedding wte_tp{nullptr};             // tp_size > 1, registered as wte
  std::shared_ptr<bmt::TransformerBlockList> layers;
  bmt::nn::LayerNorm ln_f{nullptr};

 protected:
  at::Tensor logit_rows(const TokenRows& rows) override;

 private:
  ModelConfig config_;
};

}  // namespace examples
