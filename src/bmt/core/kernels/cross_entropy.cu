// CUDA fused cross-entropy (see cross_entropy.h for the formulas and invariants; the CPU twin is
// cross_entropy_cpu.cpp). One block per row (64-bit grid-stride over rows, threads stride over the columns with
// 16-byte accesses when the rows allow, else one element at a time):
//  * stats: one pass (memory-bound: the logits are read once, not once for the max and again for the sums): each
//    thread keeps a running max and the sums of exp(x - max) and (x - max), rescaled when the max grows; the block
//    merges the threads' parts (warp shuffles, then one shared-memory step), all in fp32. The max is exact; the sums differ from the
//    two-pass CPU twin by rounding only.
//  * backward: exp(x - M) / S minus the (smoothed) one-hot, times the row's incoming gradient; in place is safe
//    because each element is read and written by the same thread.
// Results agree with the CPU twin to fp32 rounding (summation order and expf differ), not bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

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

// Per-thread running statistics of part of a row: max m, s = sum exp(x - m), z = sum (x - m) over n elements.
// Plain data (it also lives in shared memory); start from empty_part().
struct RowPart {
  float m, s, z;
  long long n;
};

__device__ __forceinline__ RowPart empty_part() { return RowPart{-INFINITY, 0.0f, 0.0f, 0}; }

// Merges `o` into `p` (both relative to their own max; the result relative to the larger one). An empty part
// contributes nothing (its -inf max would otherwise make 0 * inf = NaN).
__device__ __forceinline__ void merge(RowPart& p, const RowPart& o) {
  if (o.n == 0) return;
  if (p.n == 0) {
    p = o;
    return;
  }
  const float m = fmaxf(p.m, o.m);
  p.s = p.s * expf(p.m - m) + o.s * expf(o.m - m);
  p.z = p.z + static_cast<float>(p.n) * (p.m - m) + o.z + static_cast<float>(o.n) * (o.m - m);
  p.m = m;
  p.n += o.n;
}

// Adds V values of the row to the running statistics in one step: one rescale when their max is a new maximum
// (a NaN max compares false and keeps the old one; its expf makes s NaN, as in torch).
template <int V>
__device__ __forceinline__ void add_values(RowPart& p, const float (&x)[V]) {
  float vm = x[0];
#pragma unroll
  for (int k = 1; k < V; ++k) vm = fmaxf(vm, x[k]);
  if (vm > p.m) {
    if (p.n > 0) {
      p.s *= expf(p.m - vm);
      p.z += static_cast<float>(p.n) * (p.m - vm);
    }
    p.m = vm;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float d = x[k] - p.m;
    p.s += expf(d);
    p.z += d;
  }
  p.n += V;
}

__device__ __forceinline__ RowPart block_merge(RowPart p, RowPart* scratch) {
  for (int off = 16; off > 0; off >>= 1) {
    RowPart o = empty_part();
    o.m = __shfl_xor_sync(0xffffffffu, p.m, off);
    o.s = __shfl_xor_sync(0xffffffffu, p.s, off);
    o.z = __shfl_xor_sync(0xffffffffu, p.z, off);
    o.n = __shfl_xor_sync(0xffffffffu, p.n, off);
    merge(p, o);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = p;
  __syncthreads();
  p = scratch[0];
  for (int w = 1; w < kWarps; ++w) merge(p, scratch[w]);
  __syncthreads();
  return p;
}

// One pass over the row (online max and sums: the logits are read once), V elements per access: V =
// kVecElems<D> (16-byte loads; the host checked cols % V == 0 and the alignment) or 1 (any shape).
template <DType D, int V>
__global__ void __launch_bounds__(kThreads) stats_kernel(CrossEntropyArgs a, float* stats) {
  __shared__ RowPart scratch[kWarps];
  const int64_t n = a.rows, cols = a.cols;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = a.target[i];
    if (t == a.ignore_index) {  // the same branch for the whole block
      if (threadIdx.x < kCrossEntropyNumStats) stats[threadIdx.x * n + i] = 0.0f;
      continue;
    }
    const int64_t base = i * cols;
    RowPart part = empty_part();
    for (int64_t j = threadIdx.x * V; j < cols; j += kThreads * V) {
      float x[V];
      if constexpr (V == 1) {
        x[0] = load<D>(a.logits, base + j);
      } else {
        detail::load_vec<D>(a.logits, base + j, x);
      }
      add_values<V>(part, x);
    }
    part = block_merge(part, scratch);
    if (threadIdx.x == 0) {
      const int64_t local_t = t - a.vocab_begin;
      stats[i] = part.m;
      stats[n + i] = part.s;
      stats[2 * n + i] = local_t >= 0 && local_t < cols ? load<D>(a.logits, base + local_t) : 0.0f;
      stats[3 * n + i] = part.z;
    }
  }
}

template <DType D, int V>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(CrossEntropyArgs a, const float* row_max, const float* row_sumexp, const float* grad_row,
                    float eps, void* grad_logits) {
  const int64_t n = a.rows, cols = a.cols;
  const float smooth = eps / static_cast<float>(a.vocab_total), hit = 1.0f - eps;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t t = a.target[i];
    const int64_t base = i * cols;
    const bool ignored = t == a.ignore_index;
    const float m = ignored ? 0.0f : row_max[i], inv_s = ignored ? 0.0f : 1.0f / row_sumexp[i];
    const float g = ignored ? 0.0f : grad_row[i];
    const int64_t local_t = t - a.vocab_begin;
    for (int64_t j = threadIdx.x * V; j < cols; j += kThreads * V) {
      float x[V];
      if (ignored) {
#pragma unroll
        for (int k = 0; k < V; ++k) x[k] = 0.0f;
      } else {
        if constexpr (V == 1) {
          x[0] = load<D>(a.logits, base + j);
        } else {
          detail::load_vec<D>(a.logits, base + j, x);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float p = expf(x[k] - m) * inv_s;
          x[k] = (p - smooth - (j + k == local_t ? hit : 0.0f)) * g;
        }
      }
      if constexpr (V == 1) {
        store<D>(grad_logits, base + j, x[0]);
      } else {
        detail::store_vec<D>(grad_logits, base + j, x);
      }
    }
  }
}

// 16-byte accesses when every row starts 16-byte aligned.
template <DType D>
bool use_vec(const CrossEntropyArgs& a, const void* out) {
  return a.cols % detail::kVecElems<D> == 0 && detail::vec_aligned(a.logits) && (!out || detail::vec_aligned(out));
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
  const unsigned grid = grid_for(a.rows);
  auto launch = [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (use_vec<D>(a, nullptr)) {
      stats_kernel<D, detail::kVecElems<D>><<<grid, kThreads, 0, s>>>(a, stats);
    } else {
      stats_kernel<D, 1><<<grid, kThreads, 0, s>>>(a, stats);
    }
  };
  switch (a.dtype) {
    case DType::kFloat32: launch(std::integral_constant<DType, DType::kFloat32>{}); break;
    case DType::kBFloat16: launch(std::integral_constant<DType, DType::kBFloat16>{}); break;
    case DType::kFloat16: launch(std::integral_constant<DType, DType::kFloat16>{}); break;
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
  auto launch = [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (use_vec<D>(a, grad_logits)) {
      backward_kernel<D, detail::kVecElems<D>>
          <<<grid, kThreads, 0, s>>>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits);
    } else {
      backward_kernel<D, 1><<<grid, kThreads, 0, s>>>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits);
    }
  };
  switch (a.dtype) {
    case DType::kFloat32: launch(std::integral_constant<DType, DType::kFloat32>{}); break;
    case DType::kBFloat16: launch(std::integral_constant<DType, DType::kBFloat16>{}); break;
    case DType::kFloat16: launch(std::integral_constant<DType, DType::kFloat16>{}); break;
    default: BMT_ASSERT(false, "dtype checked above");
  }
  check_launch("cross_entropy_backward_cuda");
}

}  // namespace bmt::core::kernels
