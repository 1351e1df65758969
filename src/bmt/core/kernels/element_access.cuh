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

namespace bmt::core::kernels::detail {

// 16-byte vector accesses: kVecElems<D> elements at element index i (a multiple of kVecElems<D>, the address
// 16-byte aligned: callers check `vec_aligned` on the host and fall back to the scalar accesses otherwise).
template <DType D>
constexpr int kVecElems = D == DType::kFloat32 ? 4 : 8;

inline bool vec_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <DType D>
__device__ __forceinline__ void load_vec(const void* base, int64_t i, float (&out)[kVecElems<D>]) {
  constexpr int kBytes = D == DType::kFloat32 ? 4 : 2;
  const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const char*>(base) + i * kBytes);
  if constexpr (D == DType::kFloat32) {
    out[0] = __uint_as_float(raw.x), out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z), out[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float2 f;
      if constexpr (D == DType::kBFloat16) {
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[k]));
      } else {
        f = __half22float2(*reinterpret_cast<const __half2*>(&words[k]));
      }
      out[2 * k] = f.x, out[2 * k + 1] = f.y;
    }
  }
}

template <DType D>
__device__ __forceinline__ void store_vec(void* base, int64_t i, const float (&in)[kVecElems<D>]) {
  constexpr int kBytes = D == DType::kFloat32 ? 4 : 2;
  uint4 raw;
  if constexpr (D == DType::kFloat32) {
    raw.x = __float_as_uint(in[0]), raw.y = __float_as_uint(in[1]);
    raw.z = __float_as_uint(in[2]), raw.w = __float_as_uint(in[3]);
  } else {
    uint32_t words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (D == DType::kBFloat16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
        words[k] = *reinterpret_cast<const uint32_t*>(&h);
      } else {
        const __half2 h = __floats2half2_rn(in[2 * k], in[2 * k + 1]);
        words[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    raw = make_uint4(words[0], words[1], words[2], words[3]);
  }
  *reinterpret_cast<uint4*>(static_cast<char*>(base) + i * kBytes) = raw;
}

}  // namespace bmt::core::kernels::detail
