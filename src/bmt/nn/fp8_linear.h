// FP8 linear layer: y = x W^T + b with its three GEMMs in FP8 through at::_scaled_mm (Hopper's FP8 tensor cores;
// torch's CPU kernel on CPUs, so CI runs the same code path).
//
//   forward  y  = x8 W8^T           x, W in E4M3
//   dgrad    dx = dy8 W8            dy in the gradient format (E5M2 by default: its range suits gradients, the
//   wgrad    dW = dy8^T x8                                    recipe of TransformerEngine and torchao), W in E4M3
// Scaling is dynamic: scale = fp8_max / amax, computed on the device (core/kernels/fp8_cast: no host sync, nothing
// kept across steps: a recompute under checkpointing repeats the casts), with amax either
//   per tensor (Fp8Scaling::kTensor, the default)
//   per row (kRow): each GEMM operand scaled per row of its K-major layout, i.e. along the dimension the GEMM
//       contracts: x and dy per token in their row-major copies, W per output row in the forward and per input
//       column in dgrad, x and dy per feature in their transposed copies (wgrad). One outlier then costs only its
//       own row's precision. Every operand is E4M3 (grad_format applies to per-tensor scaling only): the rowwise
//       GEMMs of _scaled_mm take E4M3 operands and bf16 output on GPUs; other output dtypes and CPUs take a GEMM
//       with unit scales and fp32 output, scaled after. Outputs have the input's dtype (bf16 in training), scales are fp32, the bias gradient is summed in fp32
// (nn::column_sum). The forward saves x's transposed E4M3 copy for wgrad (half the bytes of the bf16 x) and the
// weight itself; the backward casts W again (transposed), so under ZeRO-3 the weight is the re-gathered one (per
// tensor with the forward cast's statistics: the same values, so no second amax pass).
// Falls back to nn::linear (today's bf16 path) when a GEMM dimension (rows, in or out features) is not a multiple
// of 16, which _scaled_mm refuses on GPUs, or the dtypes are not fp32 / bf16 / fp16.
// A non-finite amax makes that tensor's scales NaN: the outputs are NaN and the step's inf/NaN check skips it.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "bmt/nn/fp8_cast.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_format.h"

namespace bmt::nn {

// y = x weight^T + bias (bias may be undefined) with FP8 GEMMs; grad_format: the gradient dy's format.
// compute_output = false (a checkpointed Block's recompute whose output only roots the backward,
// skip_block_outputs_now()): y is left uncomputed (NaN), no forward GEMM and no weight cast; node and gradients
// are the same. scales (optional, per-tensor scaling): the delayed scales of x and the weight (nn/fp8_delayed_scale.h),
// used when fp8_delayed_inputs_enabled(), and of dy (scales->grad, E5M2 gradients) when fp8_delayed_grads_enabled();
// the caller keeps them across steps, one per layer. scales->backward_only (whatever the recipe): y by nn::linear in
// x's dtype, only dgrad and wgrad in FP8 (x's transposed bytes still cast in the forward, W cast in the backward).
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = at::Tensor(),
                      Fp8Format grad_format = Fp8Format::kE5M2, Fp8Scaling scaling = Fp8Scaling::kTensor,
                      bool compute_output = true, Fp8LinearScales* scales = nullptr);
// residual + x weight^T + bias with fp8_linear's numerics, the residual added by the FP8 GEMM's epilogue on CUDA with
// per-tensor scales (one rounding of the sum, no separate pass), else after the GEMM. residual: the output's shape.
at::Tensor fp8_linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& residual, Fp8Format grad_format = Fp8Format::kE5M2,
                               Fp8Scaling scaling = Fp8Scaling::kTensor, Fp8LinearScales* scales = nullptr);
// fp8_linear(x, weight, bias, ...).chunk(parts, -1) as one autograd node: the output in `parts` equal pieces of its
// last dimension (GPT's q, k and v from c_attn), whose gradients the backward reads in place. Under
// fp8_delayed_grads_enabled() with the layer's scales (and CUDA, per tensor, E5M2) one pass casts the pieces'
// gradients with dy's delayed scale (core's fp8_cast_grad_parts_delayed_cuda): autograd's concatenation of them, a
// write and a read of dy, is gone; elsewhere they are concatenated first. 1 <= parts <= 3, dividing out_features.
std::vector<at::Tensor> fp8_linear_parts(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                         int64_t parts, Fp8Format grad_format = Fp8Format::kE5M2,
                                         Fp8Scaling scaling = Fp8Scaling::kTensor, bool compute_output = true,
                                         Fp8LinearScales* scales = nullptr);
// The GEMM of a layer with an FP8 switch (nn::Linear, the tensor-parallel layers): fp8_linear with the process's
// settings (fp8_grad_format(), fp8_scaling()) when `fp8`, else nn::linear (nn::linear_deferred without the output).
at::Tensor linear_or_fp8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool fp8,
                         bool compute_output = true, Fp8LinearScales* scales = nullptr);
// linear_or_fp8's output in `parts` pieces of its last dimension: fp8_linear_parts when `fp8`, else the pieces of
// nn::linear's output (views).
std::vector<at::Tensor> linear_or_fp8_parts(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                            bool fp8, int64_t parts, Fp8LinearScales* scales = nullptr);
// Whether fp8_linear takes the FP8 path for these operands (else it is nn::linear).
bool fp8_linear_applies(const at::Tensor& x, const at::Tensor& weight);

// The default gradient format of nn::Linear's FP8 path: BMT_FP8_GRAD=e5m2 (default) | e4m3, or set here.
Fp8Format fp8_grad_format();
void set_fp8_grad_format(Fp8Format format);
// The default scaling of nn::Linear's FP8 path: BMT_FP8_SCALING=tensor (default) | row, or set here.
Fp8Scaling fp8_scaling();
void set_fp8_scaling(Fp8Scaling scaling);

}  // namespace bmt::nn
