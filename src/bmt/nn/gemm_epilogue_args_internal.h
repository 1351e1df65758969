// GemmEpilogueArgs from row-major contiguous 2-D tensors (undefined bias / aux / residual: none): what
// nn/fused_linear hands the epilogue GEMMs, and what their tests build.
#pragma once

#include <ATen/ATen.h>

#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt::nn {

inline core::kernels::GemmEpilogueArgs gemm_epilogue_args(core::kernels::GemmEpilogue e, const at::Tensor& a,
                                                          const at::Tensor& b, bool b_transposed,
                                                          const at::Tensor& out, const at::Tensor& bias,
                                                          const at::Tensor& aux, const at::Tensor& residual) {
  core::kernels::GemmEpilogueArgs g;
  g.rows = a.size(0);
  g.inner = a.size(1);
  g.cols = out.size(1);
  g.a = a.data_ptr();
  g.b = b.data_ptr();
  g.b_transposed = b_transposed;
  g.out = out.data_ptr();
  // (out's: the operands' too unless they are FP8, GemmEpilogueArgs::fp8; an FP8 out: the bias's)
  const bool out_fp8 = out.scalar_type() == at::kFloat8_e4m3fn || out.scalar_type() == at::kFloat8_e5m2;
  g.dtype = to_core_dtype(out_fp8 && bias.defined() ? bias.scalar_type() : out.scalar_type());
  g.epilogue = e;
  g.bias = bias.defined() ? bias.data_ptr() : nullptr;
  g.aux = aux.defined() ? aux.data_ptr() : nullptr;
  g.residual = residual.defined() ? residual.data_ptr() : nullptr;
  return g;
}

// cuBLASLt's DGELU kernels for small problems split K and round the partial sums to bf16 (H200: 0.0625 off at a
// 128 x 768 output with K = 3072, tests/cuda/test_gemm_epilogue_cuda.cpp). The GPT shapes measured (16384 x 3072,
// 16384 x 8192) ran whole-K kernels and matched the reference; small problems cost little done separately.
constexpr int64_t kDGeluMinOutputs = int64_t{1} << 22;

// Runs g on `like`'s device: the CPU twin for CPU tensors, else cuBLASLt on the current stream (false, having done
// nothing, when it has no algorithm: the caller computes it another way).
bool run_gemm_epilogue(const core::kernels::GemmEpilogueArgs& g, const at::Tensor& like);

}  // namespace bmt::nn
