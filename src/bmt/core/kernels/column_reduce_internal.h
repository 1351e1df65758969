// Column reductions of a row-major [rows, cols] matrix: the bias gradient of a Linear (the sum of dy over the rows)
// and LayerNorm's weight and bias gradients (the sums of dy * xhat and of dy, xhat = (x - mean) * rstd). Torch-free.
// Why ours: on a GPT block's shapes ([16384, 768..3072] bf16) torch's bias-gradient reduction and LayerNorm's
// gamma/beta backward kernel reach about half and a quarter of the HBM bandwidth (H200 profile of the 124M step,
// 2026-12-01: 3.7 ms of 33.5 ms of kernels).
//
// Invariants: the sums are fp32 (inputs widened exactly) and rounded once into the output dtype; the CUDA variant
// is deterministic (fixed partition into row slabs, a function of rows, cols and dtype only; fixed summation order;
// no atomics) and runs asynchronously on `stream`; 64-bit indexing throughout.
#pragma once

#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels {

// How the CUDA variant cuts the rows: stage 1 writes one fp32 partial sum per (slab, column) and output,
// stage 2 sums the slabs of each column in order.
struct ColumnReducePlan {
  int64_t slabs = 1;
  int64_t rows_per_slab = 0;
};
ColumnReducePlan column_reduce_plan(int64_t rows, int64_t cols, DType dtype);
// fp32 elements of scratch the CUDA variant needs per output (column_sum: 1 output; layer norm: 2).
int64_t column_reduce_workspace_numel(int64_t rows, int64_t cols, DType dtype);

// out[c] = sum_r dy[r, c]. CPU twin: fp64 sums (the test reference).
void column_sum_cpu(const void* dy, DType dtype, int64_t rows, int64_t cols, void* out, DType out_dtype);
// dgamma[c] = sum_r dy[r, c] * (x[r, c] - mean[r]) * rstd[r], dbeta[c] = sum_r dy[r, c]; either output may be null.
void layer_norm_param_grads_cpu(const void* dy, const void* x, DType dtype, const float* mean, const float* rstd,
                                int64_t rows, int64_t cols, void* dgamma, void* dbeta, DType out_dtype);

// The tanh-GELU MLP's d pre and c_fc's bias gradient from one read of the operands (instead of GELU's backward
// writing d pre and the column sum reading it back): dgrad[r, c] = dy[r, c] * gelu_tanh'(pre[r, c]) rounded into
// dtype (dy is the gradient of GELU's output), out[c] = sum_r dgrad[r, c] of the rounded values (the bias gradient of
// what the next GEMMs consume). CPU twin: gelu_tanh_grad (gemm_epilogue_internal.h), fp64 products and sums.
void dgelu_column_sum_cpu(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols, void* dgrad,
                          void* out, DType out_dtype);

// Stage-1 blocks of column_sum_cuda: the number of partial maxima it writes when asked for them.
int64_t column_sum_amax_partials(int64_t rows, int64_t cols, DType dtype);

// Device memory (builds with BMT_WITH_CUDA). `workspace`: column_reduce_workspace_numel floats per output.
// amax_partial (may be null): column_sum_amax_partials uint32 words, each the bits of the largest |dy| one stage-1
// block read (a NaN above every number), for fp8_scale_from_partials_cuda: a bias gradient and its FP8 cast's
// amax from one read of dy.
void column_sum_cuda(const void* dy, DType dtype, int64_t rows, int64_t cols, void* out, DType out_dtype,
                     float* workspace, void* stream, uint32_t* amax_partial = nullptr);
// dgelu_column_sum_cpu on the device; amax_partial as column_sum_cuda's (of the rounded dgrad: its FP8 cast's amax).
void dgelu_column_sum_cuda(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols, void* dgrad,
                           void* out, DType out_dtype, float* workspace, void* stream,
                           uint32_t* amax_partial = nullptr);
// Stage 2 alone, for a kernel that wrote its own stage-1 partials (fp8_cast_grad_delayed_cuda): out[c] = the sum over
// s < slabs of partial[s * cols + c], in the fixed order stage 2 always uses, rounded once into out_dtype.
void column_partials_sum_cuda(const float* partial, int64_t slabs, int64_t cols, void* out, DType out_dtype,
                              void* stream);
void layer_norm_param_grads_cuda(const void* dy, const void* x, DType dtype, const float* mean, const float* rstd,
                                 int64_t rows, int64_t cols, void* dgamma, void* dbeta, DType out_dtype,
                                 float* workspace, void* stream);

}  // namespace bmt::core::kernels
