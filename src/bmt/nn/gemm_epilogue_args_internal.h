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
  g.dtype = to_core_dtype(a.scalar_type());
  g.epilogue = e;
  g.bias = bias.defined() ? bias.data_ptr() : nullptr;
  g.aux = aux.defined() ? aux.data_ptr() : nullptr;
  g.residual = residual.defined() ? residual.data_ptr() : nullptr;
  return g;
}

}  // namespace bmt::nn
