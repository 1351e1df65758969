#include "models/llama.h"

#include "bmt/engine/block.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/nn/attention.h"
#include "models/attention.h"
#include "models/rope.h"

namespace examples {

bmt::nn::TpPlan llama_tp_plan(bool sequence_parallel) {
  using bmt::nn::TpStyle;
  bmt::nn::TpPlan plan;
  plan.sequence_parallel = sequence_parallel;
  // This rank's query heads [r·H/tp, (r+1)·H/tp) use exactly its kv heads [r·Hkv/tp, (r+1)·Hkv/tp).
  plan.modules = {
      {"tok_embeddings", {TpStyle::kVocabEmbedding}},
      {"layers.*.attention.wq", {TpStyle::kColumn}},
      {"layers.*.attention.wk", {TpStyle::kColumn}},
      {"layers.*.attention.wv", {TpStyle::kColumn}},
      {"layers.*.attention.wo", {TpStyle::kRow}},
      {"layers.*.feed_forward.w1", {TpStyle::kColumn}},
      {"layers.*.feed_forward.w2", {TpStyle::kRow}},
      {"layers.*.feed_forward.w3", {TpStyle::kColumn}},
      {"output", {TpStyle::kVocabHead}},
  };
  return plan;
}

LlamaAttentionImpl::LlamaAttentionImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp)
    : head_dim(c.head_dim()), rope_theta(c.rope_theta) {
  wq = tp.linear(*this, "wq", c.dim, c.num_heads * head_dim, false, dtype);
  wk = tp.linear(*this, "wk", c.dim, c.kv_heads() * head_dim, false, dtype);
  wv = tp.linear(*this, "wv", c.dim, c.kv_heads() * head_dim, false, dtype);
  wo = tp.linear(*this, "wo", c.num_heads * head_dim, c.dim, false, dtype);
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& shape) {
  RopeTables rope = rope_tables(shape.size(1), head_dim, rope_theta, x.device());
  const at::Tensor in = bmt::nn::shared_input(x, {&wq, &wk, &wv});  // one all-gather for the three projections
  // The heads this rank computes (all of them unless the projections are split).
  const int64_t heads = wq.local_out_features() / head_dim, kv_heads = wk.local_out_features() / head_dim;
  at::Tensor q = apply_rope(split_heads(rows_to_batch(wq.forward_input(in), shape), heads), rope);
  at::Tensor k = apply_rope(split_heads(rows_to_batch(wk.forward_input(in), shape), kv_heads), rope);
  at::Tensor v = split_heads(rows_to_batch(wv.forward_input(in), shape), kv_heads);
  return wo.forward(batch_to_rows(merge_heads(bmt::nn::causal_attention(q, k, v)), shape));
}

LlamaFeedForwardImpl::LlamaFeedForwardImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp) {
  w1 = tp.linear(*this, "w1", c.dim, c.ffn_dim, false, dtype);
  w2 = tp.linear(*this, "w2", c.ffn_dim, c.dim, false, dtype);
  w3 = tp.linear(*this, "w3", c.dim, c.ffn_dim, false, dtype);
}

at::Tensor LlamaFeedForwardImpl::forward(const at::Tensor& x) {
  const at::Tensor in = bmt::nn::shared_input(x, {&w1, &w3});  // one all-gather for w1 and w3
  return w2.forward(at::silu(w1.forward_input(in)) * w3.forward_input(in));
}

LlamaLayerImpl::LlamaLayerImpl(const ModelConfig& c, at::ScalarType dtype, const bmt::nn::TpScope& tp) {
  attention_norm = register_module("attention_norm", bmt::nn::RMSNorm(c.dim, c.norm_eps, dtype));
  attention = register_module("attention", LlamaAttention(c, dtype, tp.child("attention")));
  ffn_norm = register_module("ffn_norm", bmt::nn::RMSNorm(c.dim, c.norm_eps, dtype));
  feed_forward = register_module("feed_forward", LlamaFeedForward(c, dtype, tp.child("feed_forward")));
}

std::vector<at::Tensor> LlamaLayerImpl::forward(const std::vector<at::Tensor>& in) {
  const at::Tensor& x = in.at(0);
  const at::Tensor& shape = in.at(1);
  at::Tensor h = x + attention->forward(attention_norm->forward(x), shape);
  return {h + feed_forward->forward(ffn_norm->forward(h))};
}

Llama::Llama(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype) : config_(config) {
  config_.validate();
  bmt::nn::TpBuilder tp(plan_for(parallel, llama_tp_plan(bmt::config().sequence_parallel)));
  // Pipeline stages hold only their part: tok_embeddings on the first, norm and output on the last (untied).
  const bmt::Topology& topo = bmt::config().topology;
  const bool pipelined = topo.pipe_size > 1;
  const bool first = !pipelined || topo.is_first_stage(), last = !pipelined || topo.is_last_stage();
  if (first) tok_embeddings = tp.root().embedding(*this, "tok_embeddings", config_.vocab_size, config_.dim, dtype);
  bmt::BlockOptions block_options;
  block_options.zero_level = parallel.zero_level;
  block_options.use_checkpoint = parallel.checkpointing;
  auto make_layer = [&](int64_t i) {
    bmt::nn::TpScope scope = tp.scope("layers." + std::to_string(i));
    LlamaLayer layer(config_, dtype, scope);
    if (fp8_layer(parallel, i, config_.num_layers)) {  // every linear of the layer; embeddings and the output head stay in dtype
      const bool attn_fp8 = fp8_linear_group(parallel, true), mlp_fp8 = fp8_linear_group(parallel, false);
      for (bmt::nn::PlannedLinear* l : {&layer->attention->wq, &layer->attention->wk, &layer->attention->wv,
                                        &layer->attention->wo})
        l->set_fp8(attn_fp8);
      for (bmt::nn::PlannedLinear* l : {&layer->feed_forward->w1, &layer->feed_forward->w2, &layer->feed_forward->w3})
        l->set_fp8(mlp_fp8);
    }
    scope.finish(*layer);  // the RMSNorms replicated, before the Block packs them
    return bmt::make_block(layer.ptr(), block_options);
  };
  layers = register_layers(config_.num_layers, make_layer, parallel);
  if (last) {
    norm = register_module("norm", bmt::nn::RMSNorm(config_.dim, config_.norm_eps, dtype));
    output = tp.root().linear(*this, "output", config_.dim, config_.vocab_size, false, dtype);
    output.set_fp8(fp8_head(parallel), parallel.fp8_head_backward);
  }
  if (pipelined) {
    tp.root().finish(*this);  // plan entries of other stages' modules match nothing here
  } else {
    tp.finish(*this);
  }
  if (first && last)
    set_vocab_layout(tp, "tok_embeddings", tok_embeddings.vocab_parallel(), "output", output.splits_output());
  else if (first)  // each stage checks the vocabulary layout of the end it holds
    set_vocab_layout(tp, "tok_embeddings", tok_embeddings.vocab_parallel(), "tok_embeddings",
                     tok_embeddings.vocab_parallel());
  else if (last)
    set_vocab_layout(tp, "output", output.splits_output(), "output", output.splits_output());
}

at::Tensor Llama::embed_rows(const TokenRows& rows) {
  BMT_CHECK(rows.seq <= config_.max_seq_len, "Llama: sequence of ", rows.seq, " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  return tok_embeddings.forward(rows.ids);
}

at::Tensor Llama::head_rows(const at::Tensor& hidden, const TokenRows&) { return output.forward(norm->forward(hidden)); }

at::Tensor Llama::logit_rows(const TokenRows& rows) {
  BMT_CHECK(rows.seq <= config_.max_seq_len, "Llama: sequence of ", rows.seq, " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  at::Tensor h = layers->forward({tok_embeddings.forward(rows.ids), rows.shape})[0];
  return output.forward(norm->forward(h));
}

}  // namespace examples
