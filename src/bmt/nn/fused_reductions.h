// Linear and LayerNorm whose parameter gradients are reduced by our kernels (core/kernels/column_reduce): the
// bias gradient of a Linear (the sum of dy over rows) and LayerNorm's weight and bias gradients. Everything else
// (forward, input and weight gradients) stays torch's. Used by nn::Linear, nn::LayerNorm and the tensor-parallel
// linears on CUDA tensors; elsewhere, and with BMT_FUSED_REDUCTIONS=0 or set_fused_reductions_enabled(false),
// these are at::linear / at::layer_norm.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace bmt::nn {

// y = x weight^T + bias (bias may be undefined).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = at::Tensor());
// LayerNorm over the last `dim` elements, affine weight and bias (without a bias: at::layer_norm).
at::Tensor layer_norm(const at::Tensor& x, int64_t dim, const at::Tensor& weight, const at::Tensor& bias, double eps);

// The fused-gradient autograd paths on any device, whatever the switch (CPU: the reductions are at::sum in fp32):
// what the dispatchers above call; exposed for tests.
at::Tensor linear_reduced_bias_grad(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
at::Tensor layer_norm_reduced_param_grads(const at::Tensor& x, int64_t dim, const at::Tensor& weight,
                                          const at::Tensor& bias, double eps);

// The Linear's autograd node (linear_reduced_bias_grad's) without its forward GEMM: y is allocated and NaN until
// linear_fill writes it. For a value nobody reads: a checkpointed Block's recompute of a linear
// whose output only becomes the Block's output, a root of the backward (python/bmtrain/torch_ops.py). Needs a bias.
at::Tensor linear_deferred(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);
// A deferred output: `sizes` of NaN (floating dtypes), so that a read of it before linear_fill shows.
at::Tensor deferred_output(at::IntArrayRef sizes, const at::TensorOptions& options);
// y = x weight^T + bias written into y (contiguous, the linear's output shape), without autograd: what
// linear_deferred skipped, the same GEMM as the computing path.
void linear_fill(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& y);

// The sums of a 2-D tensor's rows, accumulated in fp32, returned in out_dtype (CUDA: our kernel; CPU: at::sum).
// amax_partials (may be null): on CUDA set to the partial maxima of |matrix| the same read took (uint32 bits,
// core::kernels::column_sum_amax_partials of them: an FP8 cast's amax, nn::fp8_cast_grad); elsewhere undefined.
at::Tensor column_sum(const at::Tensor& matrix, at::ScalarType out_dtype, at::Tensor* amax_partials = nullptr);

// GELU's (tanh) input gradient dpre = dy * gelu'(pre) in dy's dtype and its column sums in sum_dtype (the bias
// gradient of the linear before the GELU), from one read of dy and pre on CUDA (our kernel; amax_partials as
// column_sum's, of dpre); elsewhere at::gelu_backward then column_sum. dy and pre: 2-D, same shape and dtype.
std::pair<at::Tensor, at::Tensor> dgelu_column_sum(const at::Tensor& dy, const at::Tensor& pre,
                                                   at::ScalarType sum_dtype, at::Tensor* amax_partials = nullptr);

// Default: on unless the environment sets BMT_FUSED_REDUCTIONS=0.
bool fused_reductions_enabled();
void set_fused_reductions_enabled(bool enabled);

}  // namespace bmt::nn
