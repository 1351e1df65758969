// CUDA column reductions in two deterministic stages (column_reduce_internal.h).
// Stage 1: a block of 256 threads covers 32 x V columns (V = one 16-byte vector: 8 half or 4 fp32 elements) of
// one slab of rows; its 8 warps take every 8th row, each lane accumulating its V columns in fp32; the 8 row lanes
// are then added in a fixed order through shared memory into one fp32 partial per (slab, column).
// Stage 2: 32 columns x 32 slab lanes per block sum the partials (lane l takes slabs l, l + 32, ...), then the
// 32 lanes in a fixed order, and round once into the output.
// Column sums may also give each stage-1 block's largest |dy| (an FP8 cast's amax without its own read of dy), and
// may first turn dy into GELU's input gradient, writing it (the FP8 MLP's backward: one pass instead of three).
#include <cuda_runtime.h>

#include "bmt/core/error.h"
#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/core/kernels/element_access.cuh"
#include "bmt/core/kernels/fp8_cast_internal.cuh"
#include "bmt/core/kernels/gelu_internal.cuh"

namespace bmt::core::kernels {
namespace {

constexpr int kColLanes = 32, kRowLanes = 8, kStage1Threads = kColLanes * kRowLanes;
constexpr int kSlabLanes = 32, kStage2Threads = kColLanes * kSlabLanes;

using detail::gelu_tanh_grad;
using detail::rounded;

// kOutputs = 1: column sums of dy (kDGelu: of dgrad = dy * gelu'(x), written as it goes); 2: LayerNorm's
// (sum dy * xhat, sum dy).
template <DType D, int kOutputs, bool kDGelu = false>
__global__ void __launch_bounds__(kStage1Threads)
    partial_sums_kernel(const void* dy, const void* x, const float* mean, const float* rstd, int64_t rows,
                        int64_t cols, int64_t rows_per_slab, bool vec, float* partial, uint32_t* amax_partial,
                        void* dgrad) {
  static_assert(!kDGelu || kOutputs == 1, "the GELU gradient is a column sum's input");
  constexpr bool kReadX = kOutputs == 2 || kDGelu;
  constexpr int V = detail::kVecElems<D>;
  constexpr int kTileCols = kColLanes * V;
  __shared__ float lanes[kOutputs][kRowLanes][kTileCols];
  const int tx = threadIdx.x % kColLanes, ty = threadIdx.x / kColLanes;
  const int64_t tile0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int64_t col0 = tile0 + static_cast<int64_t>(tx) * V;
  const int64_t slab = blockIdx.y;
  const int64_t r_begin = slab * rows_per_slab;
  const int64_t r_end = min(rows, r_begin + rows_per_slab);
  float acc[kOutputs][V];
#pragma unroll
  for (int o = 0; o < kOutputs; ++o)
#pragma unroll
    for (int k = 0; k < V; ++k) acc[o][k] = 0.0f;
  uint32_t amax = 0;  // bits of the largest |dy| (column sums only; out-of-range elements load as 0)
  auto add_row = [&](int64_t r, const float (&g)[V], const float (&xv)[V]) {
    if constexpr (kOutputs == 2) {
      const float m = mean[r], s = rstd[r];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        acc[0][k] += g[k] * ((xv[k] - m) * s);
        acc[1][k] += g[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) acc[0][k] += g[k], amax = max(amax, fp8_device::abs_bits(g[k]));
    }
  };
  if (vec) {  // cols % V == 0 and 16-byte aligned rows: a lane's V columns are all in range or all out
    if (col0 < cols) {
      for (int64_t r = r_begin + ty; r < r_end; r += kRowLanes) {
        float g[V], xv[V];
        detail::load_vec<D>(dy, r * cols + col0, g);
        if constexpr (kReadX) detail::load_vec<D>(x, r * cols + col0, xv);
        if constexpr (kDGelu) {
#pragma unroll
          for (int k = 0; k < V; ++k) g[k] = rounded<D>(g[k] * gelu_tanh_grad(xv[k]));
          detail::store_vec<D>(dgrad, r * cols + col0, g);  // (already rounded: stored exactly)
        }
        add_row(r, g, xv);
      }
    }
  } else {
    for (int64_t r = r_begin + ty; r < r_end; r += kRowLanes) {
      float g[V], xv[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t c = col0 + k;
        g[k] = c < cols ? detail::load<D>(dy, r * cols + c) : 0.0f;
        if constexpr (kReadX) xv[k] = c < cols ? detail::load<D>(x, r * cols + c) : 0.0f;
        if constexpr (kDGelu) {
          g[k] = rounded<D>(g[k] * gelu_tanh_grad(xv[k]));  // (out of range: 0 * gelu'(0) = 0)
          if (c < cols) detail::store<D>(dgrad, r * cols + c, g[k]);
        }
      }
      add_row(r, g, xv);
    }
  }
#pragma unroll
  for (int o = 0; o < kOutputs; ++o)
#pragma unroll
    for (int k = 0; k < V; ++k) lanes[o][ty][tx * V + k] = acc[o][k];
  __syncthreads();
  const int64_t slab_stride = static_cast<int64_t>(gridDim.y) * cols;  // between the outputs' partial arrays
  for (int j = threadIdx.x; j < kTileCols; j += kStage1Threads) {
    const int64_t c = tile0 + j;
    if (c >= cols) continue;
#pragma unroll
    for (int o = 0; o < kOutputs; ++o) {
      float s = 0.0f;
#pragma unroll
      for (int l = 0; l < kRowLanes; ++l) s += lanes[o][l][j];
      partial[o * slab_stride + slab * cols + c] = s;
    }
  }
  if (kOutputs == 1 && amax_partial) {  // (uniform over the block: every thread takes part in the block maximum)
    amax = fp8_device::block_max(amax);
    if (threadIdx.x == 0) amax_partial[slab * gridDim.x + blockIdx.x] = amax;
  }
}

template <DType Out>
__global__ void __launch_bounds__(kStage2Threads)
    finish_kernel(const float* partial, int64_t slabs, int64_t cols, void* out) {
  __shared__ float lanes[kSlabLanes][kColLanes + 1];
  const int tx = threadIdx.x % kColLanes, ty = threadIdx.x / kColLanes;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColLanes + tx;
  float s = 0.0f;
  if (c < cols)
    for (int64_t k = ty; k < slabs; k += kSlabLanes) s += partial[k * cols + c];
  lanes[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int l = 0; l < kSlabLanes; ++l) total += lanes[l][tx];
    detail::store<Out>(out, c, total);
  }
}

void check_dtypes(DType dtype, DType out_dtype, const char* op) {
  auto ok = [](DType d) { return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16; };
  BMT_CHECK(ok(dtype), op, ": input dtype ", dtype_name(dtype), " is not fp32, bf16 or fp16");
  BMT_CHECK(ok(out_dtype), op, ": output dtype ", dtype_name(out_dtype), " is not fp32, bf16 or fp16");
}

void finish(const float* partial, int64_t slabs, int64_t cols, void* out, DType out_dtype, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>((cols + kColLanes - 1) / kColLanes);
  switch (out_dtype) {
    case DType::kFloat32: finish_kernel<DType::kFloat32><<<blocks, kStage2Threads, 0, s>>>(partial, slabs, cols, out); break;
    case DType::kBFloat16: finish_kernel<DType::kBFloat16><<<blocks, kStage2Threads, 0, s>>>(partial, slabs, cols, out); break;
    default: finish_kernel<DType::kFloat16><<<blocks, kStage2Threads, 0, s>>>(partial, slabs, cols, out); break;
  }
}

template <int kOutputs, bool kDGelu = false>
void launch_partials(const void* dy, const void* x, DType dtype, const float* mean, const float* rstd, int64_t rows,
                     int64_t cols, const ColumnReducePlan& plan, float* partial, uint32_t* amax_partial,
                     cudaStream_t s, void* dgrad = nullptr) {
  const int v = dtype == DType::kFloat32 ? 4 : 8;
  // Vector loads need every row start 16-byte aligned: an aligned base and a row length that is a multiple of V.
  const bool vec = cols % v == 0 && detail::vec_aligned(dy) && (!x || detail::vec_aligned(x)) &&
                   (!dgrad || detail::vec_aligned(dgrad));
  const dim3 grid(static_cast<unsigned>((cols + 32 * v - 1) / (32 * v)), static_cast<unsigned>(plan.slabs));
  BMT_CHECK(plan.slabs <= 65535, "column reductions: ", plan.slabs, " row slabs exceed the grid's y limit");
  switch (dtype) {
    case DType::kFloat32:
      partial_sums_kernel<DType::kFloat32, kOutputs, kDGelu><<<grid, kStage1Threads, 0, s>>>(
          dy, x, mean, rstd, rows, cols, plan.rows_per_slab, vec, partial, amax_partial, dgrad);
      break;
    case DType::kBFloat16:
      partial_sums_kernel<DType::kBFloat16, kOutputs, kDGelu><<<grid, kStage1Threads, 0, s>>>(
          dy, x, mean, rstd, rows, cols, plan.rows_per_slab, vec, partial, amax_partial, dgrad);
      break;
    default:
      partial_sums_kernel<DType::kFloat16, kOutputs, kDGelu><<<grid, kStage1Threads, 0, s>>>(
          dy, x, mean, rstd, rows, cols, plan.rows_per_slab, vec, partial, amax_partial, dgrad);
      break;
  }
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  BMT_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

namespace {

// column_sum_cuda, or with pre (and dgrad) dgelu_column_sum_cuda: the sums of dy or of dy * gelu'(pre).
void column_sums(const void* dy, const void* pre, void* dgrad, DType dtype, int64_t rows, int64_t cols, void* out,
                 DType out_dtype, float* workspace, cudaStream_t s, uint32_t* amax_partial, const char* op) {
  check_dtypes(dtype, out_dtype, op);
  BMT_CHECK(rows >= 0 && cols >= 0, op, ": negative shape [", rows, ", ", cols, "]");
  if (cols == 0) return;
  if (rows == 0) {
    BMT_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(cols) * dtype_nbytes(out_dtype), s) == cudaSuccess, op,
              ": cudaMemsetAsync failed");
    return;
  }
  BMT_CHECK(dy && out && workspace, op, ": null buffer");
  const ColumnReducePlan plan = column_reduce_plan(rows, cols, dtype);
  if (pre)
    launch_partials<1, true>(dy, pre, dtype, nullptr, nullptr, rows, cols, plan, workspace, amax_partial, s, dgrad);
  else
    launch_partials<1>(dy, nullptr, dtype, nullptr, nullptr, rows, cols, plan, workspace, amax_partial, s);
  finish(workspace, plan.slabs, cols, out, out_dtype, s);
  check_launch(op);
}

}  // namespace

void column_sum_cuda(const void* dy, DType dtype, int64_t rows, int64_t cols, void* out, DType out_dtype,
                     float* workspace, void* stream, uint32_t* amax_partial) {
  column_sums(dy, nullptr, nullptr, dtype, rows, cols, out, out_dtype, workspace, static_cast<cudaStream_t>(stream),
              amax_partial, "column_sum_cuda");
}

void dgelu_column_sum_cuda(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols, void* dgrad,
                           void* out, DType out_dtype, float* workspace, void* stream, uint32_t* amax_partial) {
  BMT_CHECK(pre && dgrad, "dgelu_column_sum_cuda: null pre or dgrad");
  column_sums(dy, pre, dgrad, dtype, rows, cols, out, out_dtype, workspace, static_cast<cudaStream_t>(stream),
              amax_partial, "dgelu_column_sum_cuda");
}

void column_partials_sum_cuda(const float* partial, int64_t slabs, int64_t cols, void* out, DType out_dtype,
                              void* stream) {
  check_dtypes(DType::kFloat32, out_dtype, "column_partials_sum_cuda");
  BMT_CHECK(slabs >= 1 && cols >= 0 && (cols == 0 || (partial && out)), "column_partials_sum_cuda: bad arguments (",
            slabs, " slabs, ", cols, " columns)");
  if (cols == 0) return;
  finish(partial, slabs, cols, out, out_dtype, static_cast<cudaStream_t>(stream));
  check_launch("column_partials_sum_cuda");
}

void layer_norm_param_grads_cuda(const void* dy, const void* x, DType dtype, const float* mean, const float* rstd,
                                 int64_t rows, int64_t cols, void* dgamma, void* dbeta, DType out_dtype,
                                 float* workspace, void* stream) {
  check_dtypes(dtype, out_dtype, "layer_norm_param_grads_cuda");
  BMT_CHECK(rows >= 0 && cols >= 0, "layer_norm_param_grads_cuda: negative shape [", rows, ", ", cols, "]");
  if (cols == 0 || (!dgamma && !dbeta)) return;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (rows == 0) {
    for (void* o : {dgamma, dbeta})
      if (o)
        BMT_CHECK(cudaMemsetAsync(o, 0, static_cast<size_t>(cols) * dtype_nbytes(out_dtype), s) == cudaSuccess,
                  "layer_norm_param_grads_cuda: cudaMemsetAsync failed");
    return;
  }
  BMT_CHECK(dy && x && mean && rstd && workspace, "layer_norm_param_grads_cuda: null buffer");
  const ColumnReducePlan plan = column_reduce_plan(rows, cols, dtype);
  launch_partials<2>(dy, x, dtype, mean, rstd, rows, cols, plan, workspace, nullptr, s);
  const int64_t per_output = plan.slabs * cols;
  if (dgamma) finish(workspace, plan.slabs, cols, dgamma, out_dtype, s);
  if (dbeta) finish(workspace + per_output, plan.slabs, cols, dbeta, out_dtype, s);
  check_launch("layer_norm_param_grads_cuda");
}

}  // namespace bmt::core::kernels
