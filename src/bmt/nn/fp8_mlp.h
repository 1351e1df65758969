// A GPT block's MLP with FP8 GEMMs and the epilogues the bf16 MLP has (nn::gelu_mlp): c_fc's bias and GELU in c_fc's
// FP8 GEMM (keeping the pre-activation), GELU's gradient in c_proj's FP8 input-gradient GEMM, the bias and the
// residual add in c_proj's FP8 GEMM. Without them the FP8 MLP writes and reads its hidden activations (4x the
// model width per token) in separate passes: GELU, GELU's backward, the residual add.
//
// The FP8 numerics are nn::fp8_linear's with per-tensor scales: x, h = gelu(pre) and both weights in E4M3, dy and
// d pre in grad_format; GELU and its gradient read the GEMMs' fp32 sums (the separate ops read their bf16 copies).
// Each epilogue GEMM falls back to _scaled_mm and the separate op where cuBLASLt has no algorithm for it, and the
// whole MLP to fp8_linear + at::gelu + fp8_linear where this path does not apply (see fp8_gelu_mlp).
#pragma once

#include <ATen/ATen.h>

#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_linear.h"

namespace bmt::nn {

// y = [residual +] gelu_tanh(x w_fc^T + b_fc) w_proj^T + b_proj with FP8 GEMMs (residual may be undefined).
// The fused path needs per-tensor scaling (fp8_scaling() == kTensor), both biases, CUDA tensors of one dtype,
// shapes fp8_linear takes, and gemm_epilogues_enabled(); elsewhere the separate composition (same FP8 casts).
// compute_output = false (a checkpointed Block's recompute whose output only roots the backward): y is left
// uncomputed, no c_proj GEMM and no c_proj weight cast; node and gradients are the same.
// gelu_scale (the caller's, kept across steps; used on the fused path when fp8_delayed_gelu_enabled()): c_fc's GEMM
// writes h in E4M3 itself with gelu_scale's delayed scale (cuBLASLt's FP8 output, h's amax folded in), and h's
// transposed copy for wgrad is a byte transpose: no cast reads a bf16 h. Until gelu_scale is ready(), and where
// cuBLASLt has no such algorithm, h is cast dynamically and its amax recorded.
// fc_scales / proj_scales (the caller's, c_fc's and c_proj's; used when fp8_delayed_inputs_enabled()): x and the
// weights cast by nn::fp8_cast_delayed, each weight's transposed copy in the same pass and kept for the backward;
// their grad states when fp8_delayed_grads_enabled(): c_proj's dy and c_fc's d pre by nn::fp8_cast_grad_delayed (d pre
// from dmid and pre, with c_fc's bias gradient, in one pass that writes only its FP8 copies).
at::Tensor fp8_gelu_mlp(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc, const at::Tensor& w_proj,
                        const at::Tensor& b_proj, const at::Tensor& residual, Fp8Format grad_format,
                        bool compute_output = true, Fp8DelayedScale* gelu_scale = nullptr,
                        Fp8LinearScales* fc_scales = nullptr, Fp8LinearScales* proj_scales = nullptr);
// The fused autograd function on any device (CPU: the epilogue GEMMs' fp64 twin, slow; for tests). Needs biases.
// gelu_scale, fc_scales and proj_scales: as fp8_gelu_mlp's, used whatever the switches say (their grad states: under
// fp8_delayed_grads_enabled(), as fp8_gelu_mlp's).
at::Tensor fp8_gelu_mlp_fused(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
                              const at::Tensor& w_proj, const at::Tensor& b_proj, const at::Tensor& residual,
                              Fp8Format grad_format, bool compute_output = true,
                              Fp8DelayedScale* gelu_scale = nullptr, Fp8LinearScales* fc_scales = nullptr,
                              Fp8LinearScales* proj_scales = nullptr);

}  // namespace bmt::nn
