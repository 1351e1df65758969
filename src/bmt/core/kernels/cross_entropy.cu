// CUDA fused cross-entropy (see cross_entropy.h for the formulas and invariants; the CPU twin is
// cross_entropy_cpu.cpp). One block per row (64-bit grid-stride over rows, threads stride over the columns):
//  * stats: block max of the row, then block sums of exp(x - max) and (x - max), in fp32 (warp shuffles, then one
//    shared-memory step).
//  * backward: exp(x - M) / S minus the (smoothed) one-hot, times the row's incoming gradient; in place is safe
//    because each element is read and written by the same thread.
// Results agree with the CPU twin to fp32 rounding (summation order and expf differ), not bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "bmt/core/error.h"
#include "bmt/core/kernels/cross_entropy_internal.h"
#include "bmt/core/kernels/element_access.cuh"

namespace bmt::core::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = 1 << 16;

using detail::load;
using detail::store;

// Block-wide reductions (every thread gets the result). `scratch` holds kWarps floats; the trailing barrier lets
// the caller reuse it at once.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kWarps; ++w) v = fmaxf(v, scratch[w]);
  __syncthreads();
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < kWarps; ++w) v += scratch[w];
  __syncthreads();
  return v;
}

// Two passes over the row, like the CPU twin: the max, then the sums against it (the second read mostly hits L2).
// fmaxf ignores NaN; a NaN logit still makes the sums NaN, as in torch.
template <DType D>
__global__ void __launch_bounds__(kThreads) stats_kernel(CrossEntropyArgs a, float* stats) {
  __shared__ float scratch[kWarps];
  const int64_t n = a.rows, cols = a.cols;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = a.target[i];
    if (t == a.ignore_index) {  // the same branch for the whole block
      if (threadIdx.x < kCrossEntropyNumStats) stats[threadIdx.x * n + i] = 0.0f;
      continue;
    }
    const int64_t base = i * cols;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) m = fmaxf(m, load<D>(a.logits, base + j));
    m = block_max(m, scratch);
    float se = 0.0f, sz = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
      float z = load<D>(a.logits, base + j) - m;
      se += expf(z);
      sz += z;
    }
    se = block_sum(se, scratch);
    sz = block_sum(sz, scratch);
    if (threadIdx.x == 0) {
      const int64_t local_t = t - a.vocab_begin;
      stats[i] = m;
      stats[n + i] = se;
      stats[2 * n + i] = local_t >= 0 && local_t < cols ? load<D>(a.logits, base + local_t) : 0.0f;
      stats[3 * n + i] = sz;
    }
  }
}

template <DType D>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(CrossEntropyArgs a, const float* row_max, const float* row_sumexp, const float* grad_row,
                    float eps, void* grad_logits) {
  const int64_t n = a.rows, cols = a.cols;
  const float smooth = eps / static_cast<float>(a.vocab_total), hit = 1.0f - eps;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = a.target[i];
    const int64_t base = i * cols;
    if (t == a.ignore_index) {
      for (int64_t j = threadIdx.x; j < cols; j += kThreads) store<D>(grad_logits, base + j, 0.0f);
      continue;
    }
    const float m = row_max[i], inv_s = 1.0f / row_sumexp[i], g = grad_row[i];
    const int64_t local_t = t - a.vocab_begin;
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
      float p = expf(load<D>(a.logits, base + j) - m) * inv_s;
      float d = p - smooth - (j == local_t ? hit : 0.0f);
      store<D>(grad_logits, base + j, d * g);
    }
  }
}

unsigned grid_for(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, kMaxBlocks)); }

void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  BMT_CHECK(err == cudaSuccess, what, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

void cross_entropy_stats_cuda(const CrossEntropyArgs& a, float* stats, void* stream) {
  cross_entropy_check_args(a, "cross_entropy_stats_cuda");
  if (a.rows == 0) return;
  BMT_CHECK(stats != nullptr, "cross_entropy_stats_cuda: null statistics buffer");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::kFloat32: stats_kernel<DType::kFloat32><<<grid_for(a.rows), kThreads, 0, s>>>(a, stats); break;
    case DType::kBFloat16: stats_kernel<DType::kBFloat16><<<grid_for(a.rows), kThreads, 0, s>>>(a, stats); break;
    case DType::kFloat16: stats_kernel<DType::kFloat16><<<grid_for(a.rows), kThreads, 0, s>>>(a, stats); break;
    default: BMT_ASSERT(false, "dtype checked above");
  }
  check_launch("cross_entropy_stats_cuda");
}

void cross_entropy_backward_cuda(const CrossEntropyArgs& a, const float* row_max, const float* row_sumexp,
                                 const float* grad_row, float label_smoothing, void* grad_logits, void* stream) {
  cross_entropy_check_args(a, "cross_entropy_backward_cuda");
  if (a.rows == 0) return;
  BMT_CHECK(row_max && row_sumexp && grad_row && grad_logits, "cross_entropy_backward_cuda: null buffer pointer");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned grid = grid_for(a.rows);
  switch (a.dtype) {
    case DType::kFloat32:
      backward_kernel<DType::kFloat32>
          <<<grid, kThreads, 0, s>>>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits);
      break;
    case DType::kBFloat16:
      backward_kernel<DType::kBFloat16>
          <<<grid, kThreads, 0, s>>>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits);
      break;
    case DType::kFloat16:
      backward_kernel<DType::kFloat16>
          <<<grid, kThreads, 0, s>>>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits);
      break;
    default: BMT_ASSERT(false, "dtype checked above");
  }
  check_launch("cross_entropy_backward_cuda");
}

}  // namespace bmt::core::kernels
