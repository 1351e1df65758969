#include "models/gpt.h"

#include "bmt/block.h"
#include "bmt/core/error.h"
#include "models/attention.h"

namespace examples {

GptAttentionImpl::GptAttentionImpl(const ModelConfig& c, at::ScalarType dtype) : num_heads(c.num_heads) {
  c_attn = register_module("c_attn", bmt::nn::Linear(c.dim, 3 * c.dim, true, dtype));
  c_proj = register_module("c_proj", bmt::nn::Linear(c.dim, c.dim, true, dtype));
}

at::Tensor GptAttentionImpl::forward(const at::Tensor& x) {
  auto qkv = c_attn->forward(x).chunk(3, -1);
  at::Tensor y = causal_attention(split_heads(qkv[0], num_heads), split_heads(qkv[1], num_heads),
                                  split_heads(qkv[2], num_heads));
  return c_proj->forward(merge_heads(y));
}

GptMlpImpl::GptMlpImpl(const ModelConfig& c, at::ScalarType dtype) {
  c_fc = register_module("c_fc", bmt::nn::Linear(c.dim, c.ffn_dim, true, dtype));
  c_proj = register_module("c_proj", bmt::nn::Linear(c.ffn_dim, c.dim, true, dtype));
}

at::Tensor GptMlpImpl::forward(const at::Tensor& x) { return c_proj->forward(at::gelu(c_fc->forward(x), "tanh")); }

GptLayerImpl::GptLayerImpl(const ModelConfig& c, at::ScalarType dtype) {
  ln_1 = register_module("ln_1", bmt::nn::LayerNorm(c.dim, c.norm_eps, dtype));
  attn = register_module("attn", GptAttention(c, dtype));
  ln_2 = register_module("ln_2", bmt::nn::LayerNorm(c.dim, c.norm_eps, dtype));
  mlp = register_module("mlp", GptMlp(c, dtype));
}

at::Tensor GptLayerImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attn->forward(ln_1->forward(x));
  return h + mlp->forward(ln_2->forward(h));
}

Gpt::Gpt(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype) : config_(config) {
  config_.validate();
  wte = register_module("wte", bmt::nn::Embedding(config_.vocab_size, config_.dim, dtype));
  wpe = register_module("wpe", bmt::nn::Embedding(config_.max_seq_len, config_.dim, dtype));
  bmt::BlockOptions block_options;
  block_options.zero_level = parallel.zero_level;
  block_options.use_checkpoint = parallel.checkpointing;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  for (int64_t i = 0; i < config_.num_layers; ++i) blocks.push_back(bmt::make_block(GptLayer(config_, dtype).ptr(), block_options));
  layers = register_module("layers", std::make_shared<bmt::TransformerBlockList>(blocks));
  ln_f = register_module("ln_f", bmt::nn::LayerNorm(config_.dim, config_.norm_eps, dtype));
}

at::Tensor Gpt::forward(const at::Tensor& ids) {
  const int64_t T = ids.size(1);
  BMT_CHECK(T <= config_.max_seq_len, "Gpt: sequence of ", T, " tokens exceeds max_seq_len ", config_.max_seq_len);
  at::Tensor E = bmt::gathered(wte->weight);  // gathered once: used by the lookup and the tied projection
  at::Tensor h = at::embedding(E, ids) + bmt::gathered(wpe->weight).narrow(0, 0, T);
  h = layers->forward(h);
  return wte->projection(ln_f->forward(h), E);
}

}  // namespace examples
