// LanguageModel: what the trainer needs from a decoder-only model, and the shape/size configuration shared by
// the GPT-2 and Llama architectures (models/gpt.h, models/llama.h).
//
// A model is a torch::nn::Module whose parameters are bmt::DistributedParameters (ZeRO-sharded); every
// transformer layer is wrapped in a bmt::Block inside a bmt::TransformerBlockList registered as "layers".
// forward() is collective: every rank of the ZeRO group must call it (with its own batch).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>

namespace examples {

struct ModelConfig {
  std::string arch = "gpt";  // "gpt" (GPT-2: LayerNorm, learned positions, GELU, tied) or "llama"
  int64_t vocab_size = 50304;
  int64_t max_seq_len = 1024;  // learned positions (gpt) / longest sequence (llama)
  int64_t num_layers = 12;
  int64_t dim = 768;
  int64_t num_heads = 12;
  int64_t num_kv_heads = 0;  // llama grouped-query attention; 0 = num_heads
  int64_t ffn_dim = 3072;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;

  int64_t head_dim() const { return dim / num_heads; }
  int64_t kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
  // Throws bmt::core::Error naming the inconsistent field (dim % heads, heads % kv_heads, positive sizes).
  void validate() const;
  std::string describe() const;  // "gpt L2 d64 h4 ff256 vocab13 seq64"
};

struct ParallelOptions {
  int zero_level = 3;          // 2 or 3, for every Block
  bool checkpointing = false;  // recompute each layer's forward in backward
};

class LanguageModel : public torch::nn::Module {
 public:
  // ids (B, T) int64 with T <= max_seq_len -> logits (B, T, vocab) in the parameter dtype.
  virtual at::Tensor forward(const at::Tensor& ids) = 0;
  virtual const ModelConfig& config() const = 0;

  // Total parameters (full, unsharded) and the parameters whose matmuls run per token (all but positions).
  int64_t num_params();
  // Training FLOPs per token at sequence length seq: 6·N_matmul + 12·L·d·seq (attention scores and mixing).
  double train_flops_per_token(int64_t seq);
};

// Builds the model of config.arch with parameters of `dtype` on bmt::config().device (uninitialised: call
// bmt::init_parameters(*model) afterwards).
std::shared_ptr<LanguageModel> make_model(const ModelConfig& config, const ParallelOptions& parallel,
                                          at::ScalarType dtype);

// The parameter dtype for the configured device: bf16 on GPUs, fp32 on CPUs.
at::ScalarType default_param_dtype();

// Mean next-token cross-entropy in fp32: logits (B, T, V) any dtype, targets (B, T) int64.
at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace examples
