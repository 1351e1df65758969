// A linear's output gradient cast to FP8 with delayed scaling, its bias gradient from the same read. Torch-free.
//
//   g       = dy                                   (pre null)
//           = dtype(dy * gelu_tanh'(pre))          (pre given: the tanh-GELU MLP's d pre, rounded as
//                                                   dgelu_column_sum_* round it)
//   q / qt  = g cast as fp8_cast_delayed_* casts it: with *scale, max |g| folded into *amax_io (a NaN wins)
//   col_sum[c] = sum_r g[r, c]                     (null: none) the bias gradient, fp32 sums rounded once
// With a dynamic scale the cast needs g's amax before its first byte, so g is read twice (or, d pre, written in
// dtype by one kernel and read back by the cast); with the scale known beforehand one pass reads dy (and pre) and
// writes only the FP8 bytes and the sums. The CPU twin is the composition of the separate twins (column_sum_cpu or
// dgelu_column_sum_cpu, then fp8_cast_delayed_cpu): the CUDA variant's reference.
#pragma once

#include <cstdint>

#include "bmt/core/dtype.h"
#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels {

void fp8_cast_grad_delayed_cpu(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols,
                               const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                               void* col_sum, DType sum_dtype);

// Whether the CUDA variant takes these operands: rows and columns multiples of 8, dy and pre 16-byte aligned, q and
// qt 8-byte aligned (every FP8 GEMM operand qualifies: its dimensions are multiples of 16). Elsewhere the caller
// runs the separate ops.
bool fp8_cast_grad_cuda_applies(int64_t rows, int64_t cols, const void* dy, const void* pre, const uint8_t* q,
                                const uint8_t* qt);
// dy given as `parts` pieces side by side, dy = [dy_parts[0] | ... | dy_parts[parts - 1]], each rows x (cols / parts)
// row-major: the gradients autograd hands back for a linear's output split in parts (GPT's q, k and v from c_attn),
// read where they are instead of concatenated first (a write and a read of dy fewer). 1 <= parts <= 3; pre only
// with parts = 1. The single-piece functions above are parts = 1.
constexpr int kFp8CastGradMaxParts = 3;
void fp8_cast_grad_parts_delayed_cpu(const void* const* dy_parts, int parts, DType dtype, int64_t rows, int64_t cols,
                                     const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                                     void* col_sum, DType sum_dtype);
bool fp8_cast_grad_parts_cuda_applies(int64_t rows, int64_t cols, const void* const* dy_parts, int parts,
                                      const uint8_t* q, const uint8_t* qt);
void fp8_cast_grad_parts_delayed_cuda(const void* const* dy_parts, int parts, DType dtype, int64_t rows, int64_t cols,
                                      const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                                      void* col_sum, DType sum_dtype, float* workspace, void* stream);
// floats of `workspace` the CUDA variant needs for the column sums (one partial per 64-row tile and column).
int64_t fp8_cast_grad_workspace_numel(int64_t rows, int64_t cols);
// Device memory, asynchronous on `stream`; the column sums are deterministic (fixed tiles, fixed order, no atomics).
void fp8_cast_grad_delayed_cuda(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols,
                                const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                                void* col_sum, DType sum_dtype, float* workspace, void* stream);

}  // namespace bmt::core::kernels
