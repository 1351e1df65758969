// CUDA: a gradient's delayed FP8 cast with its column sums in one pass (fp8_cast_grad_internal.h).
// 64 x 64 tiles as the 8-wide transposing cast (fp8_cast_internal.cuh): each of 256 threads reads 8 consecutive
// elements of two rows of dy (and of pre), forms g, writes its bytes row-major and, through shared memory,
// transposed, keeps its largest |g| and adds g into 8 column sums. The 32 row lanes of each column are then added in
// a fixed order into one fp32 partial per (tile row, column), which column_partials_sum_cuda sums in order: the sums
// are deterministic (no atomics); only the amax uses one atomicMax per block (a max: order-free).
#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/core/kernels/fp8_cast_grad_internal.h"
#include "bmt/core/kernels/fp8_cast_internal.cuh"
#include "bmt/core/kernels/gelu_internal.cuh"

namespace bmt::core::kernels {
namespace {

using namespace fp8_device;

constexpr int kPerRow = kVecTile / kGroup;           // groups of 8 in a tile row
constexpr int kRowLanes = kVecThreads / kPerRow;     // threads sharing a column group
constexpr int kTileGroups = kVecTile * kVecTile / kGroup;

// dy as up to three pieces side by side, each `cols` columns wide (one piece: the whole of dy)
struct Pieces {
  const void* p0 = nullptr;
  const void* p1 = nullptr;
  const void* p2 = nullptr;
  int64_t cols = 0;
};

// The piece holding column c and c's element offset in it, for row r (a group of 8 never straddles two pieces:
// their widths are multiples of 8).
__device__ __forceinline__ const void* piece_at(const Pieces& d, int64_t r, int64_t c, int64_t& offset) {
  const int64_t k = c / d.cols;
  offset = r * d.cols + (c - k * d.cols);
  return k == 0 ? d.p0 : (k == 1 ? d.p1 : d.p2);
}

template <DType D, Fp8Format F, bool kDGelu>
__global__ void __launch_bounds__(kVecThreads)
    cast_grad_kernel(Pieces dy, const void* pre, int64_t rows, int64_t cols, CastScale cs, uint8_t* q,
                     uint8_t* qt, float* partial) {
  __shared__ __align__(8) uint8_t tile[kVecTile][kVecTile + 4];
  __shared__ float lanes[kRowLanes][kVecTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kVecTile, c0 = static_cast<int64_t>(blockIdx.x) * kVecTile;
  const float scale = tensor_scale(cs);
  const int lc = (threadIdx.x % kPerRow) * kGroup;  // this thread's 8 columns (the same in each of its rows)
  float acc[kGroup];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) acc[k] = 0.0f;
  uint32_t m = 0;
#pragma unroll
  for (int g = threadIdx.x; g < kTileGroups; g += kVecThreads) {
    const int lr = g / kPerRow;
    const int64_t r = r0 + lr, c = c0 + lc;
    if (r < rows && c < cols) {
      float e[kGroup];
      int64_t at = 0;
      const void* src = piece_at(dy, r, c, at);
      load8<D>(src, at, e);
      if constexpr (kDGelu) {
        float p[kGroup];
        load8<D>(pre, r * cols + c, p);
#pragma unroll
        for (int k = 0; k < kGroup; ++k) e[k] = detail::rounded<D>(e[k] * detail::gelu_tanh_grad(p[k]));
      }
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        m = max(m, abs_bits(e[k]));
        acc[k] += e[k];
        w[k / 4] |= static_cast<uint32_t>(to_fp8<F>(e[k], scale)) << (8 * (k % 4));
      }
      if (q) *reinterpret_cast<uint2*>(q + r * cols + c) = make_uint2(w[0], w[1]);
      *reinterpret_cast<uint32_t*>(&tile[lr][lc]) = w[0];
      *reinterpret_cast<uint32_t*>(&tile[lr][lc + 4]) = w[1];
    }
  }
  if (partial) {  // (uniform over the block)
#pragma unroll
    for (int k = 0; k < kGroup; ++k) lanes[threadIdx.x / kPerRow][lc + k] = acc[k];
  }
  __syncthreads();
  if (partial && threadIdx.x < kVecTile) {
    const int64_t c = c0 + threadIdx.x;
    if (c < cols) {
      float s = 0.0f;
#pragma unroll
      for (int l = 0; l < kRowLanes; ++l) s += lanes[l][threadIdx.x];
      partial[static_cast<int64_t>(blockIdx.y) * cols + c] = s;
    }
  }
  if (qt) {
#pragma unroll
    for (int g = threadIdx.x; g < kTileGroups; g += kVecThreads) {
      const int tc = g / kPerRow, tr = (g % kPerRow) * kGroup;
      const int64_t c = c0 + tc, r = r0 + tr;
      if (r < rows && c < cols) {
        uint32_t w[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < kGroup; ++k) w[k / 4] |= static_cast<uint32_t>(tile[tr + k][tc]) << (8 * (k % 4));
        *reinterpret_cast<uint2*>(qt + c * rows + r) = make_uint2(w[0], w[1]);
      }
    }
  }
  fold_amax(cs, m);
}

template <DType D, bool kDGelu>
void launch(const Pieces& dy, const void* pre, int64_t rows, int64_t cols, const CastScale& cs, Fp8Format f,
            uint8_t* q, uint8_t* qt, float* partial, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((cols + kVecTile - 1) / kVecTile),
                  static_cast<unsigned>((rows + kVecTile - 1) / kVecTile));
  if (f == Fp8Format::kE4M3)
    cast_grad_kernel<D, Fp8Format::kE4M3, kDGelu><<<grid, kVecThreads, 0, s>>>(dy, pre, rows, cols, cs, q, qt, partial);
  else
    cast_grad_kernel<D, Fp8Format::kE5M2, kDGelu><<<grid, kVecThreads, 0, s>>>(dy, pre, rows, cols, cs, q, qt, partial);
}

template <DType D>
void launch_any(const Pieces& dy, const void* pre, int64_t rows, int64_t cols, const CastScale& cs, Fp8Format f,
                uint8_t* q, uint8_t* qt, float* partial, cudaStream_t s) {
  if (pre) launch<D, true>(dy, pre, rows, cols, cs, f, q, qt, partial, s);
  else launch<D, false>(dy, pre, rows, cols, cs, f, q, qt, partial, s);
}

void launch_pieces(const Pieces& dy, const void* pre, DType dtype, int64_t rows, int64_t cols, const float* scale,
                   float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt, void* col_sum, DType sum_dtype,
                   float* workspace, void* stream) {
  BMT_CHECK(scale && amax_io && (!col_sum || workspace), "fp8_cast_grad_delayed_cuda: null scale, amax or workspace");
  BMT_CHECK(q || qt || col_sum, "fp8_cast_grad_delayed_cuda: nothing to write");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  CastScale cs;
  cs.scale = scale;
  cs.amax_fold = reinterpret_cast<uint32_t*>(amax_io);  // (a non-negative float's bits order as the float)
  float* partial = col_sum ? workspace : nullptr;
  switch (dtype) {
    case DType::kFloat32: launch_any<DType::kFloat32>(dy, pre, rows, cols, cs, format, q, qt, partial, s); break;
    case DType::kBFloat16: launch_any<DType::kBFloat16>(dy, pre, rows, cols, cs, format, q, qt, partial, s); break;
    default: launch_any<DType::kFloat16>(dy, pre, rows, cols, cs, format, q, qt, partial, s); break;
  }
  check_launch("fp8_cast_grad_delayed_cuda");
  if (col_sum) column_partials_sum_cuda(partial, (rows + kVecTile - 1) / kVecTile, cols, col_sum, sum_dtype, s);
}

}  // namespace

void fp8_cast_grad_parts_delayed_cuda(const void* const* dy_parts, int parts, DType dtype, int64_t rows, int64_t cols,
                                      const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                                      void* col_sum, DType sum_dtype, float* workspace, void* stream) {
  check_dtype(dtype, "fp8_cast_grad_parts_delayed_cuda");
  BMT_CHECK(dy_parts && fp8_cast_grad_parts_cuda_applies(rows, cols, dy_parts, parts, q, qt),
            "fp8_cast_grad_parts_delayed_cuda: needs rows and pieces' columns that are multiples of 8 (got [", rows,
            ", ", cols, "] in ", parts, " pieces) and aligned buffers; check fp8_cast_grad_parts_cuda_applies and run "
            "the separate ops otherwise");
  Pieces d;
  d.p0 = dy_parts[0], d.p1 = parts > 1 ? dy_parts[1] : nullptr, d.p2 = parts > 2 ? dy_parts[2] : nullptr;
  d.cols = cols / parts;
  launch_pieces(d, nullptr, dtype, rows, cols, scale, amax_io, format, q, qt, col_sum, sum_dtype, workspace, stream);
}

void fp8_cast_grad_delayed_cuda(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols,
                                const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                                void* col_sum, DType sum_dtype, float* workspace, void* stream) {
  check_dtype(dtype, "fp8_cast_grad_delayed_cuda");
  BMT_CHECK(fp8_cast_grad_cuda_applies(rows, cols, dy, pre, q, qt),
            "fp8_cast_grad_delayed_cuda: needs rows and columns that are multiples of 8 (got [", rows, ", ", cols,
            "]) and aligned buffers; check fp8_cast_grad_cuda_applies and run the separate ops otherwise");
  Pieces d;
  d.p0 = dy, d.cols = cols;
  launch_pieces(d, pre, dtype, rows, cols, scale, amax_io, format, q, qt, col_sum, sum_dtype, workspace, stream);
}

}  // namespace bmt::core::kernels
