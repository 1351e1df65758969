// Device pieces of the tanh-GELU gradient shared by the kernels that fuse it (column_reduce.cu: d pre with its
// column sums; fp8_cast_grad.cu: d pre cast to FP8 with its column sums). CUDA translation units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels::detail {

// d gelu_tanh(x) / dx in fp32 (the CPU twin's gelu_tanh_grad, torch's gelu_backward formula).
__device__ __forceinline__ float gelu_tanh_grad(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
  const float x2 = x * x;
  const float t = tanhf(kSqrt2OverPi * (x + kCubic * x2 * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * x2);
}

// x rounded into D and back (the value a store then a load gives).
template <DType D>
__device__ __forceinline__ float rounded(float x) {
  if constexpr (D == DType::kBFloat16) return __bfloat162float(__float2bfloat16_rn(x));
  if constexpr (D == DType::kFloat16) return __half2float(__float2half_rn(x));
  return x;
}

}  // namespace bmt::core::kernels::detail
