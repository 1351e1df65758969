// Basic layers over DistributedParameters (ZeRO-sharded, not tensor-parallel): Linear, LayerNorm, RMSNorm,
// Embedding. Parameters are gathered with bmt::gathered() once per forward (a no-op inside a running Block).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/params/parameter.h"

namespace bmt::nn {

class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true, at::ScalarType dtype = at::kFloat,
             InitMethod weight_init = init::normal(0.0, 0.02));
  at::Tensor forward(const at::Tensor& x);
  // forward(x).chunk(parts, -1) as one node: with fp8 the pieces' gradients are read in place (nn::fp8_linear_parts)
  std::vector<at::Tensor> forward_parts(const at::Tensor& x, int64_t parts);
  int64_t in_features, out_features;
  at::Tensor weight, bias;  // weight (out, in)
  // FP8 GEMMs (nn::fp8_linear: gradients in fp8_grad_format(), scaling fp8_scaling()); off: nn::linear. Not
  // state: set it before training.
  bool fp8 = false;
  // The delayed scales of the FP8 GEMM's input and weight (used under BMT_FP8_DELAYED_INPUTS=1: nn::fp8_cast_delayed;
  // not in checkpoints). A model that calls the FP8 ops on this layer's weight itself passes them along (the example
  // GPT's MLP and attention projection).
  Fp8LinearScales fp8_scales;
};
TORCH_MODULE(Linear);

class LayerNormImpl : public torch::nn::Module {
 public:
  explicit LayerNormImpl(int64_t dim, double eps = 1e-5, at::ScalarType dtype = at::kFloat, bool bias = true);
  at::Tensor forward(const at::Tensor& x);
  int64_t dim;
  double eps;
  at::Tensor weight, bias;
};
TORCH_MODULE(LayerNorm);

class RMSNormImpl : public torch::nn::Module {
 public:
  explicit RMSNormImpl(int64_t dim, double eps = 1e-6, at::ScalarType dtype = at::kFloat);
  at::Tensor forward(const at::Tensor& x);
  int64_t dim;
  double eps;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, at::ScalarType dtype = at::kFloat,
                InitMethod weight_init = init::normal(0.0, 0.02));
  // Reuses an already gathered weight when given (one gather for the lookup and the tied projection).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& gathered_weight = {});
  // logits = x · weightᵀ (tied output projection), reusing an already gathered weight when given.
  at::Tensor projection(const at::Tensor& x, const at::Tensor& gathered_weight = {});
  int64_t num_embeddings, dim;
  // The tied projection's GEMMs in FP8 (nn::linear_or_fp8: the process's gradient format and scaling; bf16 when a
  // dimension is not a multiple of 16). The lookup is unaffected. Off by default: a language model's head.
  bool fp8 = false;
  // The projection's delayed scales (its input, the table, the logits' gradient: BMT_FP8_DELAYED_INPUTS /
  // BMT_FP8_DELAYED_GRADS, as LinearImpl::fp8_scales; not in checkpoints).
  Fp8LinearScales fp8_scales;
  at::Tensor weight;  // (num_embeddings, dim)
};
TORCH_MODULE(Embedding);

}  // namespace bmt::nn
