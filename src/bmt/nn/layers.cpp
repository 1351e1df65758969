#include "bmt/nn/layers.h"

#include "bmt/core/error.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fused_reductions.h"

namespace bmt::nn {

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias, at::ScalarType dtype, InitMethod weight_init)
    : in_features(in), out_features(out) {
  BMT_CHECK(in > 0 && out > 0, "nn::Linear: features must be positive, got in=", in, " out=", out);
  weight = register_parameter("weight", DistributedParameter({out, in}, dtype, std::move(weight_init)));
  if (with_bias) bias = register_parameter("bias", DistributedParameter({out}, dtype, init::zeros()));
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  const at::Tensor b = bias.defined() ? gathered(bias) : at::Tensor();
  return linear_or_fp8(x, gathered(weight), b, fp8, true, &fp8_scales);
}

std::vector<at::Tensor> LinearImpl::forward_parts(const at::Tensor& x, int64_t parts) {
  const at::Tensor b = bias.defined() ? gathered(bias) : at::Tensor();
  return linear_or_fp8_parts(x, gathered(weight), b, fp8, parts, &fp8_scales);
}

LayerNormImpl::LayerNormImpl(int64_t d, double e, at::ScalarType dtype, bool with_bias) : dim(d), eps(e) {
  weight = register_parameter("weight", DistributedParameter({d}, dtype, init::ones()));
  if (with_bias) bias = register_parameter("bias", DistributedParameter({d}, dtype, init::zeros()));
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  return nn::layer_norm(x, dim, gathered(weight), bias.defined() ? gathered(bias) : at::Tensor(), eps);
}

RMSNormImpl::RMSNormImpl(int64_t d, double e, at::ScalarType dtype) : dim(d), eps(e) {
  weight = register_parameter("weight", DistributedParameter({d}, dtype, init::ones()));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return normed.to(x.scalar_type()) * gathered(weight);
}

EmbeddingImpl::EmbeddingImpl(int64_t n, int64_t d, at::ScalarType dtype, InitMethod weight_init)
    : num_embeddings(n), dim(d) {
  weight = register_parameter("weight", DistributedParameter({n, d}, dtype, std::move(weight_init)));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& ids, const at::Tensor& w) {
  return at::embedding(w.defined() ? w : gathered(weight), ids);
}

at::Tensor EmbeddingImpl::projection(const at::Tensor& x, const at::Tensor& w) {
  return linear_or_fp8(x, w.defined() ? w : gathered(weight), at::Tensor(), fp8, true, &fp8_scales);
}

}  // namespace bmt::nn
