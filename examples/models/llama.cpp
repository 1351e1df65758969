#include "models/llama.h"

#include "bmt/block.h"
#include "bmt/core/error.h"
#include "models/attention.h"
#include "models/rope.h"

namespace examples {

LlamaAttentionImpl::LlamaAttentionImpl(const ModelConfig& c, at::ScalarType dtype)
    : num_heads(c.num_heads), num_kv_heads(c.kv_heads()), head_dim(c.head_dim()), rope_theta(c.rope_theta) {
  wq = register_module("wq", bmt::nn::Linear(c.dim, num_heads * head_dim, false, dtype));
  wk = register_module("wk", bmt::nn::Linear(c.dim, num_kv_heads * head_dim, false, dtype));
  wv = register_module("wv", bmt::nn::Linear(c.dim, num_kv_heads * head_dim, false, dtype));
  wo = register_module("wo", bmt::nn::Linear(num_heads * head_dim, c.dim, false, dtype));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x) {
  RopeTables rope = rope_tables(x.size(1), head_dim, rope_theta, x.device());
  at::Tensor q = apply_rope(split_heads(wq->forward(x), num_heads), rope);
  at::Tensor k = apply_rope(split_heads(wk->forward(x), num_kv_heads), rope);
  at::Tensor v = split_heads(wv->forward(x), num_kv_heads);
  return wo->forward(merge_heads(causal_attention(q, k, v)));
}

LlamaFeedForwardImpl::LlamaFeedForwardImpl(const ModelConfig& c, at::ScalarType dtype) {
  w1 = register_module("w1", bmt::nn::Linear(c.dim, c.ffn_dim, false, dtype));
  w2 = register_module("w2", bmt::nn::Linear(c.ffn_dim, c.dim, false, dtype));
  w3 = register_module("w3", bmt::nn::Linear(c.dim, c.ffn_dim, false, dtype));
}

at::Tensor LlamaFeedForwardImpl::forward(const at::Tensor& x) {
  return w2->forward(at::silu(w1->forward(x)) * w3->forward(x));
}

LlamaLayerImpl::LlamaLayerImpl(const ModelConfig& c, at::ScalarType dtype) {
  attention_norm = register_module("attention_norm", bmt::nn::RMSNorm(c.dim, c.norm_eps, dtype));
  attention = register_module("attention", LlamaAttention(c, dtype));
  ffn_norm = register_module("ffn_norm", bmt::nn::RMSNorm(c.dim, c.norm_eps, dtype));
  feed_forward = register_module("feed_forward", LlamaFeedForward(c, dtype));
}

at::Tensor LlamaLayerImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attention->forward(attention_norm->forward(x));
  return h + feed_forward->forward(ffn_norm->forward(h));
}

Llama::Llama(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype) : config_(config) {
  config_.validate();
  tok_embeddings = register_module("tok_embeddings", bmt::nn::Embedding(config_.vocab_size, config_.dim, dtype));
  bmt::BlockOptions block_options;
  block_options.zero_level = parallel.zero_level;
  block_options.use_checkpoint = parallel.checkpointing;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  for (int64_t i = 0; i < config_.num_layers; ++i)
    blocks.push_back(bmt::make_block(LlamaLayer(config_, dtype).ptr(), block_options));
  layers = register_module("layers", std::make_shared<bmt::TransformerBlockList>(blocks));
  norm = register_module("norm", bmt::nn::RMSNorm(config_.dim, config_.norm_eps, dtype));
  output = register_module("output", bmt::nn::Linear(config_.dim, config_.vocab_size, false, dtype));
}

at::Tensor Llama::forward(const at::Tensor& ids) {
  BMT_CHECK(ids.size(1) <= config_.max_seq_len, "Llama: sequence of ", ids.size(1), " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  at::Tensor h = layers->forward(tok_embeddings->forward(ids));
  return output->forward(norm->forward(h));
}

}  // namespace examples
