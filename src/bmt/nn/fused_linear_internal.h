// The shape checks the epilogue layers share (nn/fused_linear and its FP8 twins nn/fp8_linear, nn/fp8_mlp).
#pragma once

#include <ATen/ATen.h>

namespace bmt::nn {

// Throws, naming `op`, unless `residual` is undefined or has the output shape of a linear of `out` features on x.
void check_residual(const at::Tensor& residual, const at::Tensor& x, int64_t out, const char* op);
// A GELU MLP's shapes, x [..., in] -> w_fc [hidden, in] -> w_proj [out, hidden] (biases and residual may be
// undefined); throws naming `op` and the operand.
void check_mlp(const char* op, const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
               const at::Tensor& w_proj, const at::Tensor& b_proj, const at::Tensor& residual);

}  // namespace bmt::nn
