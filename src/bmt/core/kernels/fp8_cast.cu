// CUDA FP8 scale and cast (fp8_cast_internal.h).
// Scale: stage 1, fp8_scale_workspace_numel blocks of 256 threads each reduce a grid-strided share of |x| to one
// maximum; stage 2, one block reduces those and writes {amax, scale, inv_scale}. Maxima are taken on the bits of
// |x| as unsigned integers: for non-negative floats the order is the same, and every NaN compares above inf, so a
// NaN propagates (fmaxf would drop it).
// Cast: without the transposed copy, 16-byte vector loads where aligned; with it, tiles through shared memory so
// that both the row-major and the transposed bytes are written by consecutive threads: 64 x 64 tiles moved 8
// elements per access (16-byte loads, 8-byte stores) when rows and columns are multiples of 8 and the buffers
// aligned (every FP8 GEMM operand: their dimensions are multiples of 16), else 32 x 32 tiles element by element.
// (The element-wise tile ran near a third of HBM bandwidth: it was most of FP8's cast cost.)
// Explicit _rn intrinsics: the bytes and scales must equal the CPU twin's whatever the compiler's contraction flags.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "bmt/core/error.h"
#include "bmt/core/kernels/element_access.cuh"
#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 32, kTileRows = 8;  // the transposing cast: 32 x 32 tiles, 32 x 8 threads

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(fabsf(v)); }

__device__ __forceinline__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t warp_max[32];
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  v = 0;
  if (warp == 0) {
    if (lane < static_cast<int>(blockDim.x / 32)) v = warp_max[lane];
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;  // valid in thread 0
}

template <DType D>
__global__ void __launch_bounds__(kThreads) amax_partial_kernel(const void* x, int64_t numel, bool vec, uint32_t* partial) {
  constexpr int V = detail::kVecElems<D>;
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (vec) {  // numel % V == 0 and an aligned base
    for (int64_t v = i; v < numel / V; v += stride) {
      float e[V];
      detail::load_vec<D>(x, v * V, e);
#pragma unroll
      for (int k = 0; k < V; ++k) m = max(m, abs_bits(e[k]));
    }
  } else {
    for (; i < numel; i += stride) m = max(m, abs_bits(detail::load<D>(x, i)));
  }
  m = block_max(m);
  if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

__global__ void __launch_bounds__(kThreads) finish_scale_kernel(const uint32_t* partial, int64_t n, float fp8_max,
                                                                float* stats, float* inv_copy) {
  uint32_t m = 0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) m = max(m, partial[i]);
  m = block_max(m);
  if (threadIdx.x != 0) return;
  const float amax = __uint_as_float(m);
  float scale = 1.0f, inv = 1.0f;
  if (!isfinite(amax)) {
    scale = inv = __int_as_float(0x7fffffff);
  } else if (amax > 0.0f) {
    scale = fminf(__fdiv_rn(fp8_max, amax), 3.402823466e38f);
    inv = __fdiv_rn(1.0f, scale);
  }
  stats[kFp8Amax] = amax;
  stats[kFp8Scale] = scale;
  stats[kFp8InvScale] = inv;
  if (inv_copy) *inv_copy = inv;
}

template <Fp8Format F>
__device__ __forceinline__ uint8_t to_fp8(float v, float scale) {
  constexpr __nv_fp8_interpretation_t kind = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, scale), __NV_SATFINITE, kind));
}

template <DType D, Fp8Format F>
__global__ void __launch_bounds__(kThreads) cast_kernel(const void* x, int64_t numel, bool vec, const float* stats,
                                                       uint8_t* q) {
  constexpr int V = detail::kVecElems<D>;
  const float scale = stats[kFp8Scale];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (vec) {  // V bytes out per thread: 8 (one 8-byte store) or 4 (one 4-byte store)
    for (int64_t v = i0; v < numel / V; v += stride) {
      float e[V];
      detail::load_vec<D>(x, v * V, e);
      uint8_t b[V];
#pragma unroll
      for (int k = 0; k < V; ++k) b[k] = to_fp8<F>(e[k], scale);
      if constexpr (V == 8) {
        *reinterpret_cast<uint2*>(q + v * V) = *reinterpret_cast<const uint2*>(b);
      } else {
        *reinterpret_cast<uint32_t*>(q + v * V) = *reinterpret_cast<const uint32_t*>(b);
      }
    }
  } else {
    for (int64_t i = i0; i < numel; i += stride) q[i] = to_fp8<F>(detail::load<D>(x, i), scale);
  }
}

template <DType D, Fp8Format F>
__global__ void __launch_bounds__(kTile * kTileRows) cast_transpose_kernel(const void* x, int64_t rows, int64_t cols,
                                                                          const float* stats, uint8_t* q, uint8_t* qt) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const float scale = stats[kFp8Scale];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
  for (int j = ty; j < kTile; j += kTileRows) {
    const int64_t r = r0 + j, c = c0 + tx;
    if (r < rows && c < cols) {
      const uint8_t b = to_fp8<F>(detail::load<D>(x, r * cols + c), scale);
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
}

// The vector path of the transposing cast: 8 consecutive elements of a row per access.
constexpr int kVecTile = 64, kGroup = 8, kVecThreads = 256;

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

template <DType D, Fp8Format F>
__global__ void __launch_bounds__(kVecThreads) cast_transpose_vec_kernel(const void* x, int64_t rows, int64_t cols,
                                                                        const float* stats, uint8_t* q, uint8_t* qt) {
  // row stride 68: 4-byte aligned rows for the word writes, and at most 2-way bank conflicts either way
  __shared__ __align__(8) uint8_t tile[kVecTile][kVecTile + 4];
  const float scale = stats[kFp8Scale];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kVecTile, c0 = static_cast<int64_t>(blockIdx.x) * kVecTile;
  constexpr int kGroups = kVecTile * kVecTile / kGroup;
  // rows and cols are multiples of 8, so a group of 8 is wholly inside the matrix or wholly outside
#pragma unroll
  for (int g = threadIdx.x; g < kGroups; g += kVecThreads) {
    const int lr = g / (kVecTile / kGroup), lc = (g % (kVecTile / kGroup)) * kGroup;
    const int64_t r = r0 + lr, c = c0 + lc;
    if (r < rows && c < cols) {
      float e[kGroup];
      load8<D>(x, r * cols + c, e);
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int k = 0; k < kGroup; ++k) w[k / 4] |= static_cast<uint32_t>(to_fp8<F>(e[k], scale)) << (8 * (k % 4));
      if (q) *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(w[0], w[1]);
      *reinterpret_cast<uint32_t*>(&tile[lr][lc]) = w[0];
      *reinterpret_cast<uint32_t*>(&tile[lr][lc + 4]) = w[1];
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = threadIdx.x; g < kGroups; g += kVecThreads) {
    const int lc = g / (kVecTile / kGroup), lr = (g % (kVecTile / kGroup)) * kGroup;
    const int64_t c = c0 + lc, r = r0 + lr;
    if (r < rows && c < cols) {
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int k = 0; k < kGroup; ++k) w[k / 4] |= static_cast<uint32_t>(tile[lr + k][lc]) << (8 * (k % 4));
      *reinterpret_cast<uint2*>(qt + c * rows + r) = make_uint2(w[0], w[1]);
    }
  }
}

void check_dtype(DType dtype, const char* op) {
  BMT_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16, op, ": dtype ",
            dtype_name(dtype), " is not fp32, bf16 or fp16");
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  BMT_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

unsigned grid_for(int64_t work) {
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>((work + kThreads - 1) / kThreads, 1), 4096));
}

template <DType D>
void launch_cast(const void* x, int64_t rows, int64_t cols, const float* stats, Fp8Format f, uint8_t* q, uint8_t* qt,
                 cudaStream_t s) {
  const int64_t numel = rows * cols;
  if (!qt) {
    constexpr int V = detail::kVecElems<D>;
    const bool vec = numel % V == 0 && detail::vec_aligned(x) && reinterpret_cast<uintptr_t>(q) % V == 0;
    const unsigned g = grid_for(vec ? numel / V : numel);
    if (f == Fp8Format::kE4M3) cast_kernel<D, Fp8Format::kE4M3><<<g, kThreads, 0, s>>>(x, numel, vec, stats, q);
    else cast_kernel<D, Fp8Format::kE5M2><<<g, kThreads, 0, s>>>(x, numel, vec, stats, q);
    return;
  }
  const auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
  if (rows % kGroup == 0 && cols % kGroup == 0 && detail::vec_aligned(x) && aligned8(q) && aligned8(qt)) {
    BMT_CHECK((rows + kVecTile - 1) / kVecTile <= 65535, "fp8_cast_cuda: ", rows, " rows exceed the grid's y limit");
    const dim3 grid(static_cast<unsigned>((cols + kVecTile - 1) / kVecTile),
                    static_cast<unsigned>((rows + kVecTile - 1) / kVecTile));
    if (f == Fp8Format::kE4M3) cast_transpose_vec_kernel<D, Fp8Format::kE4M3><<<grid, kVecThreads, 0, s>>>(x, rows, cols, stats, q, qt);
    else cast_transpose_vec_kernel<D, Fp8Format::kE5M2><<<grid, kVecThreads, 0, s>>>(x, rows, cols, stats, q, qt);
    return;
  }
  BMT_CHECK((rows + kTile - 1) / kTile <= 65535, "fp8_cast_cuda: ", rows, " rows exceed the grid's y limit");
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  const dim3 block(kTile, kTileRows);
  if (f == Fp8Format::kE4M3) cast_transpose_kernel<D, Fp8Format::kE4M3><<<grid, block, 0, s>>>(x, rows, cols, stats, q, qt);
  else cast_transpose_kernel<D, Fp8Format::kE5M2><<<grid, block, 0, s>>>(x, rows, cols, stats, q, qt);
}

}  // namespace

void fp8_scale_cuda(const void* x, DType dtype, int64_t numel, Fp8Format format, float* stats, uint32_t* workspace,
                    void* stream, float* inv_scale_copy) {
  check_dtype(dtype, "fp8_scale_cuda");
  BMT_CHECK(numel >= 0 && stats && workspace && (numel == 0 || x), "fp8_scale_cuda: bad arguments (numel ", numel, ")");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t blocks = fp8_scale_workspace_numel(numel);
  const int v = dtype == DType::kFloat32 ? 4 : 8;
  const bool vec = numel % v == 0 && detail::vec_aligned(x);
  const unsigned g = static_cast<unsigned>(blocks);
  switch (dtype) {
    case DType::kFloat32: amax_partial_kernel<DType::kFloat32><<<g, kThreads, 0, s>>>(x, numel, vec, workspace); break;
    case DType::kBFloat16: amax_partial_kernel<DType::kBFloat16><<<g, kThreads, 0, s>>>(x, numel, vec, workspace); break;
    default: amax_partial_kernel<DType::kFloat16><<<g, kThreads, 0, s>>>(x, numel, vec, workspace); break;
  }
  finish_scale_kernel<<<1, kThreads, 0, s>>>(workspace, blocks, fp8_max(format), stats, inv_scale_copy);
  check_launch("fp8_scale_cuda");
}

void fp8_cast_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, const float* stats, Fp8Format format,
                   uint8_t* q, uint8_t* qt, void* stream) {
  check_dtype(dtype, "fp8_cast_cuda");
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_cuda: negative shape [", rows, ", ", cols, "]");
  if (rows == 0 || cols == 0 || (!q && !qt)) return;
  BMT_CHECK(x && stats, "fp8_cast_cuda: null buffer");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: launch_cast<DType::kFloat32>(x, rows, cols, stats, format, q, qt, s); break;
    case DType::kBFloat16: launch_cast<DType::kBFloat16>(x, rows, cols, stats, format, q, qt, s); break;
    default: launch_cast<DType::kFloat16>(x, rows, cols, stats, format, q, qt, s); break;
  }
  check_launch("fp8_cast_cuda");
}

}  // namespace bmt::core::kernels
