// The FP8 GEMM pieces nn::fp8_linear shares with nn::fp8_gelu_mlp (defined in fp8_linear.cpp; the casts they share:
// fp8_cast_internal.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/nn/fp8_cast_internal.h"
#include "bmt/nn/fp8_format_internal.h"
#include "bmt/nn/fp8_linear.h"

namespace bmt::nn {

// a [m, k] x b [n, k]^T (both row-major FP8), dequantised by the inverse scales (0-dim: per tensor; [m] and [n]:
// per row) into out_dtype, bias added (in the GEMM's epilogue where cuBLASLt takes it). fast_accum: forward only.
at::Tensor fp8_scaled_mm(const at::Tensor& a, const at::Tensor& a_inv, const at::Tensor& b, const at::Tensor& b_inv,
                         at::ScalarType out_dtype, bool fast_accum, const std::optional<at::Tensor>& bias);

// Whether a layer's delayed scales can cast its forward GEMM's operands (given, both E4M3).
bool e4m3_scales(const Fp8LinearScales* scales);
// The layer's gradient state where its backward casts dy with it (scales given, fp8_delayed_grads_enabled(), per
// tensor, the state of grad_format), else null.
Fp8DelayedScale* delayed_grad_scale(Fp8LinearScales* scales, Fp8Format grad_format, Fp8Scaling scaling);

// One epilogue GEMM (core/kernels/gemm_epilogue) on per-tensor FP8 operands: out = epilogue((a_inv b_inv) a b^T)
// with a [rows, inner] and b [cols, inner] row-major, out / bias / aux / residual in out's dtype (undefined: none).
// CPU tensors run the fp64 twin; CUDA ones cuBLASLt, false (nothing done) when it has no algorithm.
bool fp8_gemm_epilogue(core::kernels::GemmEpilogue epilogue, const at::Tensor& a, Fp8Format a_format,
                       const at::Tensor& a_inv, const at::Tensor& b, Fp8Format b_format, const at::Tensor& b_inv,
                       bool fast_accum, const at::Tensor& out, const at::Tensor& bias, const at::Tensor& aux,
                       const at::Tensor& residual);

}  // namespace bmt::nn
