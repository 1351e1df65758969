// Device-side loads and stores of fp32 / bf16 / fp16 elements as fp32, picked at compile time by core::DType
// (round-to-nearest-even on store). Shared by the CUDA kernels; CUDA translation units only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels::detail {

template <DType D>
__device__ __forceinline__ float load(const void* base, int64_t i) {
  if constexpr (D == DType::kFloat32) return static_cast<const float*>(base)[i];
  if constexpr (D == DType::kBFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  if constexpr (D == DType::kFloat16) return __half2float(static_cast<const __half*>(base)[i]);
  return 0.0f;
}

template <DType D>
__device__ __forceinline__ void store(void* base, int64_t i, float x) {
  if constexpr (D == DType::kFloat32) static_cast<float*>(base)[i] = x;
  if constexpr (D == DType::kBFloat16) static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
  if constexpr (D == DType::kFloat16) static_cast<__half*>(base)[i] = __float2half_rn(x);
}

}  // namespace bmt::core::kernels::detail
