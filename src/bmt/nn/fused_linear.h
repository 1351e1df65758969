// A GPT block's MLP and its residual projections with the elementwise work done by the GEMMs' epilogues
// (core/kernels/gemm_epilogue): c_fc's bias + GELU in its GEMM (keeping the pre-activation), GELU's gradient and
// c_fc's bias gradient in c_proj's input-gradient GEMM, the residual add in c_proj's GEMM. Numerically these are
// the unfused ops with fewer roundings (GELU reads the fp32 sum, not its bf16 copy).
//
// On CUDA bf16/fp16 tensors that need gradients, with BMT_GEMM_EPILOGUES unset or 1; elsewhere (CPU, fp32, no
// gradients, BMT_GEMM_EPILOGUES=0 or set_gemm_epilogues_enabled(false)) the same results from separate ops
// (nn::linear, at::gelu). A GEMM cuBLASLt has no fused algorithm for falls back to separate ops by itself.
#pragma once

#include <ATen/ATen.h>

namespace bmt::nn {

// y = [residual +] gelu_tanh(x w_fc^T + b_fc) w_proj^T + b_proj. residual may be undefined.
// compute_output = false (a checkpointed Block's recompute whose output y is the Block's, skip_block_outputs_now()):
// on the fused path y is left uncomputed (NaN; its node and gradients are the same), saving c_proj's GEMM.
at::Tensor gelu_mlp(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc, const at::Tensor& w_proj,
                    const at::Tensor& b_proj, const at::Tensor& residual = at::Tensor(), bool compute_output = true);
// y = residual + x w^T + b.
at::Tensor linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& residual);

// y = h w^T + b for h = gelu_tanh(pre) that the caller already computed from pre (a user's F.gelu(approximate=
// "tanh") then F.linear): the same forward as linear(h, w, b); in the backward the gradient goes to pre, GELU's
// gradient done by the GEMM's DGELU epilogue (no separate pass over the hidden activations). The caller
// guarantees h == gelu_tanh(pre). Off the fused path (see above), linear(h, w, b). compute = false: the node
// without its forward GEMM, as nn::linear_deferred (the output's values undefined until nn::linear_fill).
at::Tensor linear_after_gelu(const at::Tensor& h, const at::Tensor& pre, const at::Tensor& weight,
                             const at::Tensor& bias, bool compute = true);

// The fused autograd functions on any device, whatever the switch (CPU: the epilogue GEMMs' CPU twin, slow; for
// tests). gelu_mlp_fused needs a residual; pass at::Tensor() for none.
at::Tensor gelu_mlp_fused(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
                          const at::Tensor& w_proj, const at::Tensor& b_proj, const at::Tensor& residual,
                          bool compute_output = true);
at::Tensor linear_residual_fused(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const at::Tensor& residual);
at::Tensor linear_after_gelu_fused(const at::Tensor& h, const at::Tensor& pre, const at::Tensor& weight,
                                   const at::Tensor& bias, bool compute = true);

// Default: on unless the environment sets BMT_GEMM_EPILOGUES=0.
bool gemm_epilogues_enabled();
void set_gemm_epilogues_enabled(bool enabled);

// The epilogue GEMMs' algorithm autotuning on CUDA: on each GEMM shape's first use, time cuBLASLt's candidate
// algorithms (up to kGemmAutotuneCandidates) and keep the fastest; with it on, the per-tensor FP8 GEMMs that
// otherwise go through at::_scaled_mm (the FP8 linears' backward GEMMs and plain forward) take the same tuned
// path. Default: off unless the environment sets BMT_GEMM_AUTOTUNE=1.
constexpr int kGemmAutotuneCandidates = 8;
bool gemm_autotune_enabled();
void set_gemm_autotune_enabled(bool enabled);

// How the fused MLP's backward gets d pre = (dy w_proj) * gelu'(pre) and c_fc's bias gradient:
//   kDGelu       cuBLASLt's DGELU epilogue, then our column sums (default)
//   kDGeluBGrad  cuBLASLt's DGELU_BGRAD (both in the GEMM's epilogue)
//   kSeparate    torch's GEMM, torch's GELU backward, our column sums
// BMT_GELU_MLP_BACKWARD=dgelu|dgelu_bgrad|separate. (On the H200, DGELU_BGRAD runs as a GEMM plus a separate
// epilogue kernel slower than torch's GELU backward: bench/run_epilogue_bench.sh.)
enum class GeluMlpBackward { kDGelu, kDGeluBGrad, kSeparate };
GeluMlpBackward gelu_mlp_backward();
void set_gelu_mlp_backward(GeluMlpBackward mode);

}  // namespace bmt::nn
