// Device pieces shared by the FP8 cast kernels (fp8_cast.cu: per tensor; fp8_cast_rowwise.cu: per row and per
// column): the element conversion, the block maximum, the scale of an amax and the transposing casts. CUDA
// translation units only.
// Maxima are taken on the bits of |x| as unsigned integers: for non-negative floats the order is the same, and
// every NaN compares above inf, so a NaN propagates (fmaxf would drop it).
// Explicit _rn intrinsics: the bytes and scales must equal the CPU twin's whatever the compiler's contraction flags.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "bmt/core/error.h"
#include "bmt/core/kernels/element_access.cuh"
#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels::fp8_device {

constexpr int kThreads = 256;
constexpr int kTile = 32, kTileRows = 8;                   // element-wise transposing cast: 32 x 32, 32 x 8 threads
constexpr int kVecTile = 64, kGroup = 8, kVecThreads = 256;  // 8-wide transposing cast: 64 x 64 tiles

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// The maximum over the block (blockDim.x * blockDim.y threads, a multiple of 32, x fastest); valid in thread 0.
// One call per kernel.
__device__ __forceinline__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t warp_max[32];
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  const int lane = tid % 32, warp = tid / 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  v = 0;
  if (warp == 0) {
    if (lane < static_cast<int>(blockDim.x * blockDim.y / 32)) v = warp_max[lane];
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// scale and inv_scale of an amax given by its bits (fp8_scale_of on the CPU)
__device__ __forceinline__ void scale_of(uint32_t amax_bits, float fp8_max, float& scale, float& inv) {
  const float amax = __uint_as_float(amax_bits);
  scale = inv = 1.0f;
  if (!isfinite(amax)) {
    scale = inv = __int_as_float(0x7fffffff);
  } else if (amax > 0.0f) {
    scale = fminf(__fdiv_rn(fp8_max, amax), FLT_MAX);  // (a subnormal amax would give inf)
    inv = __fdiv_rn(1.0f, scale);
  }
}

template <Fp8Format F>
__device__ __forceinline__ uint8_t to_fp8(float v, float scale) {
  constexpr __nv_fp8_interpretation_t kind = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, scale), __NV_SATFINITE, kind));
}

// The kVecElems<D> elements of x at element i (a multiple of it, aligned) cast into q[i..]: one 8- or 4-byte store.
// Returns their max |x| (bits).
template <DType D, Fp8Format F>
__device__ __forceinline__ uint32_t cast_vec(const void* x, int64_t i, float scale, uint8_t* q) {
  constexpr int V = detail::kVecElems<D>;
  float e[V];
  detail::load_vec<D>(x, i, e);
  uint8_t b[V];
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) b[k] = to_fp8<F>(e[k], scale), m = max(m, abs_bits(e[k]));
  if constexpr (V == 8) {
    *reinterpret_cast<uint2*>(q + i) = *reinterpret_cast<const uint2*>(b);
  } else {
    *reinterpret_cast<uint32_t*>(q + i) = *reinterpret_cast<const uint32_t*>(b);
  }
  return m;
}

template <DType D>
__device__ __forceinline__ void load8(const void* x, int64_t i, float (&e)[kGroup]) {
  if constexpr (D == DType::kFloat32) {  // two 16-byte loads
    float a[4], b[4];
    detail::load_vec<D>(x, i, a);
    detail::load_vec<D>(x, i + 4, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) e[k] = a[k], e[k + 4] = b[k];
  } else {
    detail::load_vec<D>(x, i, e);
  }
}

// How a transposing cast scales: by the tensor's statistics (per tensor), or each column by its own maximum
// (col_max, bits of |x|), the column's inverse scale then written to col_inv by the tiles of the first tile row.
// Delayed scaling (per tensor only): the scale at `scale` instead of stats[kFp8Scale], and each block's max |x|
// folded into amax_fold (bits of a non-negative float, so an unsigned atomicMax orders them; a NaN wins).
struct CastScale {
  const float* stats = nullptr;
  const uint32_t* col_max = nullptr;
  float fp8_max = 0.0f;
  float* col_inv = nullptr;
  const float* scale = nullptr;
  uint32_t* amax_fold = nullptr;
};

__device__ __forceinline__ float tensor_scale(const CastScale& cs) { return cs.scale ? *cs.scale : cs.stats[kFp8Scale]; }

// The block's maximum into cs.amax_fold (every thread of the block calls it, after its last use of shared tiles).
__device__ __forceinline__ void fold_amax(const CastScale& cs, uint32_t m) {
  if (!cs.amax_fold) return;  // (uniform over the block)
  m = block_max(m);
  if ((threadIdx.x | threadIdx.y) == 0 && m) atomicMax(cs.amax_fold, m);
}

// The tile's column scales in shared memory (per-column mode); the first tile row also publishes the inverses.
template <int kWidth>
__device__ __forceinline__ void load_column_scales(const CastScale& cs, int64_t c0, int64_t cols, int tid,
                                                   int threads, float (&col_scale)[kWidth]) {
  for (int i = tid; i < kWidth; i += threads) {
    const int64_t c = c0 + i;
    if (c < cols) {
      float scale, inv;
      scale_of(cs.col_max[c], cs.fp8_max, scale, inv);
      col_scale[i] = scale;
      if (blockIdx.y == 0) cs.col_inv[c] = inv;
    }
  }
  __syncthreads();
}

// Any shape: 32 x 32 tiles, one element per thread and step.
template <DType D, Fp8Format F, bool kPerColumn>
__global__ void __launch_bounds__(kTile * kTileRows) cast_transpose_kernel(const void* x, int64_t rows, int64_t cols,
                                                                          CastScale cs, uint8_t* q, uint8_t* qt) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  __shared__ float col_scale[kTile];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
  float scale = 0.0f;
  uint32_t m = 0;
  if constexpr (kPerColumn) load_column_scales<kTile>(cs, c0, cols, ty * kTile + tx, kTile * kTileRows, col_scale);
  else scale = tensor_scale(cs);
#pragma unroll
  for (int j = ty; j < kTile; j += kTileRows) {
    const int64_t r = r0 + j, c = c0 + tx;
    if (r < rows && c < cols) {
      const float v = detail::load<D>(x, r * cols + c);
      m = max(m, abs_bits(v));
      const uint8_t b = to_fp8<F>(v, kPerColumn ? col_scale[tx] : scale);
      if (q) q[r * cols + c] = b;
      tile[j][tx] = b;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = ty; j < kTile; j += kTileRows) {
    const int64_t c = c0 + j, r = r0 + tx;
    if (r < rows && c < cols) qt[c * rows + r] = tile[tx][j];
  }
  fold_amax(cs, m);  // (per column: amax_fold is null)
}

// Rows and columns multiples of 8, buffers aligned: 64 x 64 tiles, 8 consecutive elements of a row per access
// (16-byte loads, 8-byte stores); a group of 8 is wholly inside the matrix or wholly outside.
template <DType D, Fp8Format F, bool kPerColumn>
__global__ void __launch_bounds__(kVecThreads) cast_transpose_vec_kernel(const void* x, int64_t rows, int64_t cols,
                                                                        CastScale cs, uint8_t* q, uint8_t* qt) {
  // row stride 68: 4-byte aligned rows for the word writes, and at most 2-way bank conflicts either way
  __shared__ __align__(8) uint8_t tile[kVecTile][kVecTile + 4];
  __shared__ float col_scale[kVecTile];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kVecTile, c0 = static_cast<int64_t>(blockIdx.x) * kVecTile;
  float scale = 0.0f;
  uint32_t m = 0;
  if constexpr (kPerColumn) load_column_scales<kVecTile>(cs, c0, cols, threadIdx.x, kVecThreads, col_scale);
  else scale = tensor_scale(cs);
  constexpr int kGroups = kVecTile * kVecTile / kGroup, kPerRow = kVecTile / kGroup;
#pragma unroll
  for (int g = threadIdx.x; g < kGroups; g += kVecThreads) {
    const int lr = g / kPerRow, lc = (g % kPerRow) * kGroup;
    const int64_t r = r0 + lr, c = c0 + lc;
    if (r < rows && c < cols) {
      float e[kGroup];
      load8<D>(x, r * cols + c, e);
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int k = 0; k < kGroup; ++k) m = max(m, abs_bits(e[k]));
#pragma unroll
      for (int k = 0; k < kGroup; ++k)
        w[k / 4] |= static_cast<uint32_t>(to_fp8<F>(e[k], kPerColumn ? col_scale[lc + k] : scale)) << (8 * (k % 4));
      if (q) *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(w[0], w[1]);
      *reinterpret_cast<uint32_t*>(&tile[lr][lc]) = w[0];
      *reinterpret_cast<uint32_t*>(&tile[lr][lc + 4]) = w[1];
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = threadIdx.x; g < kGroups; g += kVecThreads) {
    const int lc = g / kPerRow, lr = (g % kPerRow) * kGroup;
    const int64_t c = c0 + lc, r = r0 + lr;
    if (r < rows && c < cols) {
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int k = 0; k < kGroup; ++k) w[k / 4] |= static_cast<uint32_t>(tile[lr + k][lc]) << (8 * (k % 4));
      *reinterpret_cast<uint2*>(qt + c * rows + r) = make_uint2(w[0], w[1]);
    }
  }
  fold_amax(cs, m);  // (per column: amax_fold is null)
}

// The transposed copy qt (and q, per tensor only) in one pass over x; the 8-wide kernel where it applies.
template <DType D, bool kPerColumn>
void launch_cast_transpose(const void* x, int64_t rows, int64_t cols, const CastScale& cs, Fp8Format f, uint8_t* q,
                           uint8_t* qt, cudaStream_t s) {
  const auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
  const bool wide = rows % kGroup == 0 && cols % kGroup == 0 && detail::vec_aligned(x) && aligned8(q) && aligned8(qt);
  const int tile = wide ? kVecTile : kTile;
  BMT_CHECK((rows + tile - 1) / tile <= 65535, "fp8 cast: ", rows, " rows exceed the grid's y limit");
  const dim3 grid(static_cast<unsigned>((cols + tile - 1) / tile), static_cast<unsigned>((rows + tile - 1) / tile));
  constexpr Fp8Format e4 = Fp8Format::kE4M3, e5 = Fp8Format::kE5M2;
  if (wide) {
    if (f == e4) cast_transpose_vec_kernel<D, e4, kPerColumn><<<grid, kVecThreads, 0, s>>>(x, rows, cols, cs, q, qt);
    else cast_transpose_vec_kernel<D, e5, kPerColumn><<<grid, kVecThreads, 0, s>>>(x, rows, cols, cs, q, qt);
  } else {
    const dim3 block(kTile, kTileRows);
    if (f == e4) cast_transpose_kernel<D, e4, kPerColumn><<<grid, block, 0, s>>>(x, rows, cols, cs, q, qt);
    else cast_transpose_kernel<D, e5, kPerColumn><<<grid, block, 0, s>>>(x, rows, cols, cs, q, qt);
  }
}

inline void check_dtype(DType dtype, const char* op) {
  BMT_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16, op, ": dtype ",
            dtype_name(dtype), " is not fp32, bf16 or fp16");
}

inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  BMT_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace bmt::core::kernels::fp8_device
