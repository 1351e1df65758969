// GPT-2 (pre-LN) over bmtrain's ZeRO layers.
//
//   h = wte[ids] + wpe[0..T)
//   per layer:  h += attn.c_proj(causal_sdpa(split(attn.c_attn(ln_1(h)))))
//               h += mlp.c_proj(gelu_tanh(mlp.c_fc(ln_2(h))))
//   logits = ln_f(h) · wteᵀ           (tied output projection; wte gathered once per forward)
// Biases on; weights normal(0, 0.02), biases 0, LayerNorm weight 1 / bias 0, eps 1e-5. Linear weights are stored
// (out, in) like torch (Hugging Face's Conv1D stores (in, out): export/hf_gpt2.cpp transposes).
// Pipeline parallelism (pipe_size > 1): stage 0 holds wte and wpe, the last stage ln_f and a copy of wte for the
// tied projection (gradients summed over the two copies: PipelineTransformerBlockList::tie_first_last); keys are
// unchanged (wte.weight is saved once).
// State-dict keys: wte.weight, wpe.weight, layers.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}.*,
// ln_f.{weight,bias}.
//
// Tensor parallelism (bmt::config().tp_size > 1; the same layout in models/llama.h): the model code above knows
// nothing of it; gpt_tp_plan() (a bmt::nn::TpPlan, nn/tp_plan.h) says how its layers split. Every rank of a tp
// group gets the same batch; heads, ff features and the vocabulary are split over the group:
//   layers.*.attn.c_attn   column, split_groups 3: this rank's heads of Q, K and V (num_heads / tp)
//   layers.*.attn.c_proj   row                     layers.*.mlp.c_fc column      layers.*.mlp.c_proj row
//   wte                    vocab_embedding: lookup of this rank's vocabulary range, tied projection to its logits
//   loss                   bmt::loss::fused_cross_entropy(parallel) on the slices: the (rows, vocab) logits never exist
// Everything else (wpe, LayerNorms) is replicated. Activation layout: the batch's B·T tokens are rows (row = b·T +
// t). Sequence parallel (InitOptions::sequence_parallel, the default): the rows are padded to a multiple of tp, and
// tp rank r holds the r-th contiguous chunk of them between the tensor-parallel regions (embedding sum, positions
// wpe[row % T], residuals, LayerNorms on the local rows). A column-parallel layer all-gathers the rows; attention
// sees whole (B, T) sequences of its heads; a row-parallel layer reduce-scatters back to the local rows. With
// sequence_parallel = false (Megatron) every rank holds all rows and row-parallel outputs are all-reduced.
// tp-replicated parameters (wpe, LayerNorms, row-parallel biases) have their gradients summed over tp (sequence
// parallel: each rank saw its rows) or averaged (Megatron). Parameter names, shapes and state_dict values are
// those of the tp_size 1 model (c_attn keeps its (3d, d) layout). tp_size must divide heads, ff and vocab.
#pragma once

#include "bmt/engine/block_list.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/planned_layers.h"
#include "models/language_model.h"

namespace examples {

// The GPT layout above; sequence_parallel as InitOptions::sequence_parallel.
bmt::nn::TpPlan gpt_tp_plan(bool sequence_parallel = true);

// Layers are built in `tp`, the scope of their module path ("layers.3", "layers.3.attn").
class GptAttentionImpl : public torch::nn::Module {
 public:
  GptAttentionImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp);
  // x: token rows (rows, d); shape: TokenRows::shape.
  // residual + c_proj(attention(c_attn(x))): the residual add is fused into c_proj's GEMM where it can be.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& shape, const at::Tensor& residual);
  int64_t head_dim;
  bmt::nn::PlannedLinear c_attn, c_proj;
};
TORCH_MODULE(GptAttention);

class GptMlpImpl : public torch::nn::Module {
 public:
  GptMlpImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp);
  // residual + c_proj(gelu(c_fc(x))): one fused MLP (nn::gelu_mlp) when neither linear is split over tp.
  // compute_output = false: the caller will only root a backward at the result (a checkpointed Block's recompute,
  // bmt::skip_block_outputs_now()): the fused MLP skips c_proj's GEMM.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& residual, bool compute_output = true);
  bmt::nn::PlannedLinear c_fc, c_proj;
  // The FP8 MLP's delayed scale of its GELU output (used under BMT_FP8_DELAYED_GELU=1; not in checkpoints).
  bmt::nn::Fp8DelayedScale gelu_scale;
};
TORCH_MODULE(GptMlp);

class GptLayerImpl : public torch::nn::Module {
 public:
  GptLayerImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp);
  // {x rows (rows, d), TokenRows::shape} -> {output rows}.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in);
  bmt::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  GptAttention attn{nullptr};
  GptMlp mlp{nullptr};
};
TORCH_MODULE(GptLayer);

class Gpt : public LanguageModel {
 public:
  Gpt(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype);
  const ModelConfig& config() const override { return config_; }

  bmt::nn::PlannedEmbedding wte;
  bmt::nn::Embedding wpe{nullptr};
  std::shared_ptr<bmt::TransformerBlockList> layers;
  bmt::nn::LayerNorm ln_f{nullptr};

 protected:
  at::Tensor logit_rows(const TokenRows& rows) override;
  at::Tensor embed_rows(const TokenRows& rows) override;
  at::Tensor head_rows(const at::Tensor& hidden, const TokenRows& rows) override;

 private:
  ModelConfig config_;
};

}  // namespace examples
