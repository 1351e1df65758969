#include "models/gpt.h"

#include "bmt/block.h"
#include "bmt/core/error.h"
#include "bmt/init.h"
#include "models/attention.h"

namespace examples {

namespace {
int tp_size() { return bmt::config().tp_size; }
bool sequence_parallel() { return bmt::config().sequence_parallel; }
}  // namespace

GptAttentionImpl::GptAttentionImpl(const ModelConfig& c, at::ScalarType dtype) : num_heads(c.num_heads) {
  if (tp_size() == 1) {
    c_attn = register_module("c_attn", bmt::nn::Linear(c.dim, 3 * c.dim, true, dtype));
    c_proj = register_module("c_proj", bmt::nn::Linear(c.dim, c.dim, true, dtype));
    return;
  }
  const bool sp = sequence_parallel();
  num_heads = c.num_heads / tp_size();
  // Q, K and V are three blocks of c_attn's output features, each split over tp: this rank's heads of each.
  c_attn_tp = register_module("c_attn", bmt::nn::ColumnParallelLinear(c.dim, 3 * c.dim, true, dtype, false, sp,
                                                                       bmt::init::normal(0.0, 0.02), 3));
  c_proj_tp = register_module("c_proj", bmt::nn::RowParallelLinear(c.dim, c.dim, true, dtype, false, !sp));
}

at::Tensor GptAttentionImpl::forward(const at::Tensor& x, const at::Tensor& shape) {
  if (c_attn) {
    auto qkv = c_attn->forward(x).chunk(3, -1);
    at::Tensor y = causal_attention(split_heads(qkv[0], num_heads), split_heads(qkv[1], num_heads),
                                    split_heads(qkv[2], num_heads));
    return c_proj->forward(merge_heads(y));
  }
  // Rows in (this rank's under sequence parallelism), every row out with this rank's heads, back to rows.
  auto qkv = rows_to_batch(c_attn_tp->forward(x), shape).chunk(3, -1);
  at::Tensor y = causal_attention(split_heads(qkv[0], num_heads), split_heads(qkv[1], num_heads),
                                  split_heads(qkv[2], num_heads));
  return c_proj_tp->forward(batch_to_rows(merge_heads(y), shape));
}

GptMlpImpl::GptMlpImpl(const ModelConfig& c, at::ScalarType dtype) {
  if (tp_size() == 1) {
    c_fc = register_module("c_fc", bmt::nn::Linear(c.dim, c.ffn_dim, true, dtype));
    c_proj = register_module("c_proj", bmt::nn::Linear(c.ffn_dim, c.dim, true, dtype));
    return;
  }
  const bool sp = sequence_parallel();
  c_fc_tp = register_module("c_fc", bmt::nn::ColumnParallelLinear(c.dim, c.ffn_dim, true, dtype, false, sp));
  c_proj_tp = register_module("c_proj", bmt::nn::RowParallelLinear(c.ffn_dim, c.dim, true, dtype, false, !sp));
}

at::Tensor GptMlpImpl::forward(const at::Tensor& x) {
  if (c_fc) return c_proj->forward(at::gelu(c_fc->forward(x), "tanh"));
  return c_proj_tp->forward(at::gelu(c_fc_tp->forward(x), "tanh"));
}

GptLayerImpl::GptLayerImpl(const ModelConfig& c, at::ScalarType dtype) {
  ln_1 = register_module("ln_1", bmt::nn::LayerNorm(c.dim, c.norm_eps, dtype));
  attn = register_module("attn", GptAttention(c, dtype));
  ln_2 = register_module("ln_2", bmt::nn::LayerNorm(c.dim, c.norm_eps, dtype));
  mlp = register_module("mlp", GptMlp(c, dtype));
}

std::vector<at::Tensor> GptLayerImpl::forward(const std::vector<at::Tensor>& in) {
  const at::Tensor& x = in.at(0);
  const at::Tensor shape = in.size() > 1 ? in[1] : at::Tensor();
  at::Tensor h = x + attn->forward(ln_1->forward(x), shape);
  return {h + mlp->forward(ln_2->forward(h))};
}

Gpt::Gpt(const ModelConfig& config, const ParallelOptions& parallel, at::ScalarType dtype) : config_(config) {
  config_.validate();
  config_.validate_tensor_parallel(tp_size());
  if (tp_size() == 1) {
    wte = register_module("wte", bmt::nn::Embedding(config_.vocab_size, config_.dim, dtype));
  } else {
    wte_tp = register_module("wte", bmt::nn::VPEmbedding(config_.vocab_size, config_.dim, dtype,
                                                         bmt::init::normal(0.0, 0.02), sequence_parallel()));
  }
  wpe = register_module("wpe", bmt::nn::Embedding(config_.max_seq_len, config_.dim, dtype));
  bmt::BlockOptions block_options;
  block_options.zero_level = parallel.zero_level;
  block_options.use_checkpoint = parallel.checkpointing;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    GptLayer layer(config_, dtype);
    set_replicated_grad_reduce(*layer);  // LayerNorms and row-parallel biases, before the Block packs them
    blocks.push_back(bmt::make_block(layer.ptr(), block_options));
  }
  layers = register_module("layers", std::make_shared<bmt::TransformerBlockList>(blocks));
  ln_f = register_module("ln_f", bmt::nn::LayerNorm(config_.dim, config_.norm_eps, dtype));
  set_replicated_grad_reduce(*wpe);
  set_replicated_grad_reduce(*ln_f);
}

at::Tensor Gpt::forward(const at::Tensor& ids) {
  if (tp_size() > 1) return tp_forward(ids);
  const int64_t T = ids.size(1);
  BMT_CHECK(T <= config_.max_seq_len, "Gpt: sequence of ", T, " tokens exceeds max_seq_len ", config_.max_seq_len);
  at::Tensor E = bmt::gathered(wte->weight);  // gathered once: used by the lookup and the tied projection
  at::Tensor h = at::embedding(E, ids) + bmt::gathered(wpe->weight).narrow(0, 0, T);
  h = layers->forward(h);
  return wte->projection(ln_f->forward(h), E);
}

at::Tensor Gpt::logit_rows(const TokenRows& rows) {
  BMT_CHECK(rows.seq <= config_.max_seq_len, "Gpt: sequence of ", rows.seq, " tokens exceeds max_seq_len ",
            config_.max_seq_len);
  at::Tensor E = bmt::gathered(wte_tp->weight);  // this rank's vocabulary slice, gathered once
  at::Tensor h = wte_tp->forward(rows.ids, E) + bmt::gathered(wpe->weight).index_select(0, rows.positions);
  h = layers->forward({h, rows.shape})[0];
  return wte_tp->projection(ln_f->forward(h), E);
}

}  // namespace examples
