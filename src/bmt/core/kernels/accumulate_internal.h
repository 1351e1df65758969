// accumulate: dst[i] += src[i] for an fp32 destination and an fp32 / bf16 / fp16 source. Torch-free.
// Used by a one-rank Block to add its parameters' gradients (the parameter dtype) into the fp32 gradient shard:
// a mixed-dtype at::add_ runs torch's unvectorised casting loop at about half the memory bandwidth.
//
// Invariants: 64-bit element counts; the sum is computed in fp32 (source widened exactly, one rounding); dst and
// src must not overlap; the CUDA variant runs asynchronously on `stream` (a cudaStream_t).
#pragma once

#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels {

// Host memory; the reference for the CUDA variant.
void accumulate_fp32_cpu(float* dst, const void* src, DType src_dtype, int64_t numel);

// Device memory (builds with BMT_WITH_CUDA). Vectorised when dst and src are 16-byte aligned.
void accumulate_fp32_cuda(float* dst, const void* src, DType src_dtype, int64_t numel, void* stream);

}  // namespace bmt::core::kernels
