// has_inf_nan: does a buffer of floating-point numbers contain an infinity or a NaN? Torch-free.
// Used by the loss scaler (one flag over every gradient, then one all_reduce(max) across ranks).
//
// Invariants: 64-bit element counts; fp32, fp16, bf16 and fp64 are inspected by their exponent bits (all ones =
// inf or NaN); integer dtypes never contain inf/NaN. The CUDA variant only ever sets the flag (to 1), never clears
// it, so one zero-initialised flag can collect many tensors; it runs asynchronously on `stream`.
#pragma once

#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels {

// True if any of the numel elements at data is +-inf or NaN. Host memory.
bool has_inf_nan_cpu(const void* data, int64_t numel, DType dtype);

// CUDA (builds with BMT_WITH_CUDA): sets *flag_device = 1 if any element of the device buffer is inf/NaN.
// stream is a cudaStream_t. Nothing is launched for numel == 0 or integer dtypes.
void has_inf_nan_cuda(const void* data, int64_t numel, DType dtype, int* flag_device, void* stream);

}  // namespace bmt::core::kernels
