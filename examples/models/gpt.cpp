#include "models/gpt.h"

#include "bmt/engine/block.h"
#include "bmt/engine/recompute_keep.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_mlp.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/params/parameter.h"
#include "bmt/pipeline/pipeline.h"
#include "bmt/nn/attention.h"
#include "models/attention.h"

namespace examples {

bmt::nn::TpPlan gpt_tp_plan(bool sequence_parallel) {
  using bmt::nn::TpStyle;
  bmt::nn::TpPlan plan;
  plan.sequence_parallel = sequence_parallel;
  plan.modules = {
      {"wte", {TpStyle::kVocabEmbedding}},
      // Q, K and V are three blocks of c_attn's output features, each split over tp: this rank's heads of each.
      {"layers.*.attn.c_attn", {TpStyle::kColumn, 3}},
      {"layers.*.attn.c_proj", {TpStyle::kRow}},
      {"layers.*.mlp.c_fc", {TpStyle::kColumn}},
      {"layers.*.mlp.c_proj", {TpStyle::kRow}},
  };
  return plan;
}

GptAttentionImpl::GptAttentionImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp)
    : head_dim(c.head_dim()) {
  c_attn = tp.linear(*this, "c_attn", c.dim, 3 * c.dim, true, dtype);
  c_proj = tp.linear(*this, "c_proj", c.dim, c.dim, true, dtype);
}

at::Tensor GptAttentionImpl::forward(const at::Tensor& x, const at::Tensor& shape, const at::Tensor& residual) {
  // Rows in; Q, K and V of the heads this rank computes (all of them unless c_attn is split) for every row.
  // (as three pieces of one node: the FP8 backward reads q's, k's and v's gradients without concatenating them)
  std::vector<at::Tensor> qkv = c_attn.forward_parts(x, 3);
  for (at::Tensor& t : qkv) t = rows_to_batch(t, shape);
  const int64_t heads = qkv[0].size(-1) / head_dim;
  at::Tensor y =
      bmt::nn::causal_attention(split_heads(qkv[0], heads), split_heads(qkv[1], heads), split_heads(qkv[2], heads));
  const at::Tensor rows = batch_to_rows(merge_heads(y), shape);
  if (bmt::nn::Linear proj = c_proj.dense()) {
    if (proj->fp8)
      return bmt::nn::fp8_linear_residual(rows, bmt::gathered(proj->weight), bmt::gathered(proj->bias), residual,
                                          bmt::nn::fp8_grad_format(), bmt::nn::fp8_scaling(), &proj->fp8_scales);
    return bmt::nn::linear_residual(rows, bmt::gathered(proj->weight), bmt::gathered(proj->bias), residual);
  }
  return residual + c_proj.forward(rows);  // (row-parallel: the add follows the reduction over tp)
}

GptMlpImpl::GptMlpImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp) {
  c_fc = tp.linear(*this, "c_fc", c.dim, c.ffn_dim, true, dtype);
  c_proj = tp.linear(*this, "c_proj", c.ffn_dim, c.dim, true, dtype);
}

at::Tensor GptMlpImpl::forward(const at::Tensor& x, const at::Tensor& residual, bool compute_output) {
  bmt::nn::Linear fc = c_fc.dense(), proj = c_proj.dense();
  if (fc && proj && fc->fp8 && proj->fp8)  // FP8 GEMMs with GELU, its gradient and the residual in epilogues
    return bmt::nn::fp8_gelu_mlp(x, bmt::gathered(fc->weight), bmt::gathered(fc->bias), bmt::gathered(proj->weight),
                                 bmt::gathered(proj->bias), residual, bmt::nn::fp8_grad_format(), compute_output,
                                 &gelu_scale, &fc->fp8_scales, &proj->fp8_scales);
  if (fc && proj && (fc->fp8 || proj->fp8)) {  // one of the two in FP8: separate GELU and residual add
    const at::Tensor h = at::gelu(fc->forward(x), "tanh");
    if (compute_output || !proj->fp8) return residual + proj->forward(h);
    // the recompute's tail: c_proj's node without its GEMM (the add stays: it carries the residual's gradient)
    return residual + bmt::nn::linear_or_fp8(h, bmt::gathered(proj->weight), bmt::gathered(proj->bias), true, false,
                                             &proj->fp8_scales);
  }
  if (fc && proj)
    return bmt::nn::gelu_mlp(x, bmt::gathered(fc->weight), bmt::gathered(fc->bias), bmt::gathered(proj->weight),
                             bmt::gathered(proj->bias), residual, compute_output);
  return residual + c_proj.forward(at::gelu(c_fc.forward(x), "tanh"));
}

GptLayerImpl::GptLayerImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp) {
  ln_1 = register_module("ln_1", bmt::nn::LayerNorm(c.dim, c.norm_eps, dtype));
  attn = register_module("attn", GptAttention(c, dtype, tp.child("attn")));
  ln_2 = register_module("ln_2", bmt::nn::LayerNorm(c.dim, c.norm_eps, dtype));
  mlp = register_module("mlp", GptMlp(c, dtype, tp.child("mlp")));
}

std::vector<at::Tensor> GptLayerImpl::forward(const std::vector<at::Tensor>& in) {
  const at::Tensor& x = in.at(0);
  const at::Tensor& shape = in.at(1);
  at::Tensor h = attn->forward(ln_1->forward(x), shape, x);
  // (the MLP's sum is the layer's output: in a checkpointed recompute only the backward's root)
  return {mlp->forward(ln_2->forward(h), h, !bmt::skip_block_outputs_now())};
}

Gpt::Gpt(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype) : config_(config) {
  config_.validate();
  bmt::nn::TpBuilder tp(plan_for(parallel, gpt_tp_plan(bmt::config().sequence_parallel)));
  // Pipeline stages hold only their part: wte and wpe on the first, ln_f and a tied copy of wte on the last.
  const bmt::Topology& topo = bmt::config().topology;
  const bool pipelined = topo.pipe_size > 1;
  const bool first = !pipelined || topo.is_first_stage(), last = !pipelined || topo.is_last_stage();
  if (first || last) wte = tp.root().embedding(*this, "wte", config_.vocab_size, config_.dim, dtype);
  if (first) wpe = register_module("wpe", bmt::nn::Embedding(config_.max_seq_len, config_.dim, dtype));
  bmt::BlockOptions block_options;
  block_options.zero_level = parallel.zero_level;
  block_options.use_checkpoint = parallel.checkpointing;
  auto make_layer = [&](int64_t i) {
    bmt::nn::TpScope scope = tp.scope("layers." + std::to_string(i));
    GptLayer layer(config_, dtype, scope);
    if (fp8_layer(parallel, i, config_.num_layers)) {
      // dense, or this rank's GEMM of a column- / row-parallel layer
      const bool attn_fp8 = fp8_linear_group(parallel, true), mlp_fp8 = fp8_linear_group(parallel, false);
      for (bmt::nn::PlannedLinear* l : {&layer->attn->c_attn, &layer->attn->c_proj}) l->set_fp8(attn_fp8);
      for (bmt::nn::PlannedLinear* l : {&layer->mlp->c_fc, &layer->mlp->c_proj}) l->set_fp8(mlp_fp8);
    }
    scope.finish(*layer);  // LayerNorms and row-parallel biases replicated, before the Block packs them
    return bmt::make_block(layer.ptr(), block_options);
  };
  layers = register_layers(config_.num_layers, make_layer, parallel);
  if (last) ln_f = register_module("ln_f", bmt::nn::LayerNorm(config_.dim, config_.norm_eps, dtype));
  if (pipelined) {
    tp.root().finish(*this);  // plan entries of other stages' modules match nothing here
    if (first || last) pipe_->tie_first_last({wte.weight()});
  } else {
    tp.finish(*this);
  }
  if (first || last) set_vocab_layout(tp, "wte", wte.vocab_parallel(), "wte", wte.vocab_parallel());  // tied head
  if (first || last) wte.set_fp8_projection(fp8_head(parallel), parallel.fp8_head_backward);
}

at::Tensor Gpt::embed_rows(const TokenRows& rows) {
  BMT_CHECK(rows.seq <= config_.max_seq_len, "Gpt: sequence of ", rows.seq, " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  return wte.forward(rows.ids) + bmt::gathered(wpe->weight).index_select(0, rows.positions);
}

at::Tensor Gpt::head_rows(const at::Tensor& hidden, const TokenRows&) { return wte.projection(ln_f->forward(hidden)); }

at::Tensor Gpt::logit_rows(const TokenRows& rows) {
  BMT_CHECK(rows.seq <= config_.max_seq_len, "Gpt: sequence of ", rows.seq, " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  at::Tensor E = bmt::gathered(wte.weight());  // gathered once: used by the lookup and the tied projection
  at::Tensor h = wte.forward(rows.ids, E) + bmt::gathered(wpe->weight).index_select(0, rows.positions);
  h = layers->forward({h, rows.shape})[0];
  return wte.projection(ln_f->forward(h), E);
}

}  // namespace examples
