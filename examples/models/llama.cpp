#include "models/llama.h"

#include "bmt/block.h"
#include "bmt/core/error.h"
#include "bmt/init.h"
#include "models/attention.h"
#include "models/rope.h"

namespace examples {

namespace {
int tp_size() { return bmt::config().tp_size; }
bool sequence_parallel() { return bmt::config().sequence_parallel; }

// Column-parallel (this rank's output features of every row) and row-parallel (back to this rank's rows) layers
// of the configured activation layout, without biases.
bmt::nn::ColumnParallelLinear column(int64_t in, int64_t out, at::ScalarType dtype) {
  return bmt::nn::ColumnParallelLinear(in, out, false, dtype, /*gather_output=*/false, sequence_parallel());
}
bmt::nn::RowParallelLinear row(int64_t in, int64_t out, at::ScalarType dtype) {
  return bmt::nn::RowParallelLinear(in, out, false, dtype, /*split_input=*/false, !sequence_parallel());
}
}  // namespace

LlamaAttentionImpl::LlamaAttentionImpl(const ModelConfig& c, at::ScalarType dtype)
    : num_heads(c.num_heads), num_kv_heads(c.kv_heads()), head_dim(c.head_dim()), rope_theta(c.rope_theta) {
  if (tp_size() == 1) {
    wq = register_module("wq", bmt::nn::Linear(c.dim, num_heads * head_dim, false, dtype));
    wk = register_module("wk", bmt::nn::Linear(c.dim, num_kv_heads * head_dim, false, dtype));
    wv = register_module("wv", bmt::nn::Linear(c.dim, num_kv_heads * head_dim, false, dtype));
    wo = register_module("wo", bmt::nn::Linear(num_heads * head_dim, c.dim, false, dtype));
    return;
  }
  // This rank's query heads [r·H/tp, (r+1)·H/tp) use exactly its kv heads [r·Hkv/tp, (r+1)·Hkv/tp).
  wq_tp = register_module("wq", column(c.dim, num_heads * head_dim, dtype));
  wk_tp = register_module("wk", column(c.dim, num_kv_heads * head_dim, dtype));
  wv_tp = register_module("wv", column(c.dim, num_kv_heads * head_dim, dtype));
  wo_tp = register_module("wo", row(num_heads * head_dim, c.dim, dtype));
  num_heads /= tp_size();
  num_kv_heads /= tp_size();
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& shape) {
  if (wq) {
    RopeTables rope = rope_tables(x.size(1), head_dim, rope_theta, x.device());
    at::Tensor q = apply_rope(split_heads(wq->forward(x), num_heads), rope);
    at::Tensor k = apply_rope(split_heads(wk->forward(x), num_kv_heads), rope);
    at::Tensor v = split_heads(wv->forward(x), num_kv_heads);
    return wo->forward(merge_heads(causal_attention(q, k, v)));
  }
  RopeTables rope = rope_tables(shape.size(1), head_dim, rope_theta, x.device());
  const at::Tensor in = wq_tp->input_of(x);  // one all-gather for the three projections
  at::Tensor q = apply_rope(split_heads(rows_to_batch(wq_tp->forward_input(in), shape), num_heads), rope);
  at::Tensor k = apply_rope(split_heads(rows_to_batch(wk_tp->forward_input(in), shape), num_kv_heads), rope);
  at::Tensor v = split_heads(rows_to_batch(wv_tp->forward_input(in), shape), num_kv_heads);
  return wo_tp->forward(batch_to_rows(merge_heads(causal_attention(q, k, v)), shape));
}

LlamaFeedForwardImpl::LlamaFeedForwardImpl(const ModelConfig& c, at::ScalarType dtype) {
  if (tp_size() == 1) {
    w1 = register_module("w1", bmt::nn::Linear(c.dim, c.ffn_dim, false, dtype));
    w2 = register_module("w2", bmt::nn::Linear(c.ffn_dim, c.dim, false, dtype));
    w3 = register_module("w3", bmt::nn::Linear(c.dim, c.ffn_dim, false, dtype));
    return;
  }
  w1_tp = register_module("w1", column(c.dim, c.ffn_dim, dtype));
  w2_tp = register_module("w2", row(c.ffn_dim, c.dim, dtype));
  w3_tp = register_module("w3", column(c.dim, c.ffn_dim, dtype));
}

at::Tensor LlamaFeedForwardImpl::forward(const at::Tensor& x) {
  if (w1) return w2->forward(at::silu(w1->forward(x)) * w3->forward(x));
  const at::Tensor in = w1_tp->input_of(x);  // one all-gather for w1 and w3
  return w2_tp->forward(at::silu(w1_tp->forward_input(in)) * w3_tp->forward_input(in));
}

LlamaLayerImpl::LlamaLayerImpl(const ModelConfig& c, at::ScalarType dtype) {
  attention_norm = register_module("attention_norm", bmt::nn::RMSNorm(c.dim, c.norm_eps, dtype));
  attention = register_module("attention", LlamaAttention(c, dtype));
  ffn_norm = register_module("ffn_norm", bmt::nn::RMSNorm(c.dim, c.norm_eps, dtype));
  feed_forward = register_module("feed_forward", LlamaFeedForward(c, dtype));
}

std::vector<at::Tensor> LlamaLayerImpl::forward(const std::vector<at::Tensor>& in) {
  const at::Tensor& x = in.at(0);
  const at::Tensor shape = in.size() > 1 ? in[1] : at::Tensor();
  at::Tensor h = x + attention->forward(attention_norm->forward(x), shape);
  return {h + feed_forward->forward(ffn_norm->forward(h))};
}

Llama::Llama(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype) : config_(config) {
  config_.validate();
  config_.validate_tensor_parallel(tp_size());
  if (tp_size() == 1)
    tok_embeddings = register_module("tok_embeddings", bmt::nn::Embedding(config_.vocab_size, config_.dim, dtype));
  else
    tok_embeddings_tp = register_module("tok_embeddings", bmt::nn::VPEmbedding(config_.vocab_size, config_.dim, dtype,
                                                                               bmt::init::normal(0.0, 0.02),
                                                                               sequence_parallel()));
  bmt::BlockOptions block_options;
  block_options.zero_level = parallel.zero_level;
  block_options.use_checkpoint = parallel.checkpointing;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    LlamaLayer layer(config_, dtype);
    set_replicated_grad_reduce(*layer);  // the RMSNorms, before the Block packs them
    blocks.push_back(bmt::make_block(layer.ptr(), block_options));
  }
  layers = register_module("layers", std::make_shared<bmt::TransformerBlockList>(blocks));
  norm = register_module("norm", bmt::nn::RMSNorm(config_.dim, config_.norm_eps, dtype));
  set_replicated_grad_reduce(*norm);
  if (tp_size() == 1)
    output = register_module("output", bmt::nn::Linear(config_.dim, config_.vocab_size, false, dtype));
  else
    output_tp = register_module("output", column(config_.dim, config_.vocab_size, dtype));  // vocabulary slices
}

at::Tensor Llama::forward(const at::Tensor& ids) {
  if (tp_size() > 1) return tp_forward(ids);
  BMT_CHECK(ids.size(1) <= config_.max_seq_len, "Llama: sequence of ", ids.size(1), " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  at::Tensor h = layers->forward(tok_embeddings->forward(ids));
  return output->forward(norm->forward(h));
}

at::Tensor Llama::logit_rows(const TokenRows& rows) {
  BMT_CHECK(rows.seq <= config_.max_seq_len, "Llama: sequence of ", rows.seq, " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  at::Tensor h = layers->forward({tok_embeddings_tp->forward(rows.ids), rows.shape})[0];
  return output_tp->forward(norm->forward(h));
}

}  // namespace examples
