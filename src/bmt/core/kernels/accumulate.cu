// CUDA accumulate_fp32: grid-stride loop; 8 elements per thread and iteration (16-byte source loads for half
// dtypes, two 16-byte fp32 loads/stores) when both pointers are 16-byte aligned, otherwise one element at a time.
#include <cuda_runtime.h>

#include <algorithm>

#include "bmt/core/error.h"
#include "bmt/core/kernels/accumulate_internal.h"
#include "bmt/core/kernels/element_access.cuh"

namespace bmt::core::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;
constexpr int kVec = 8;

template <DType D>
__global__ void __launch_bounds__(kThreads) accumulate_kernel(float* dst, const void* src, int64_t n, bool aligned) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail_begin = 0;
  if (aligned) {
    const int64_t groups = n / kVec;
    for (int64_t g = first; g < groups; g += stride) {
      float4* d = reinterpret_cast<float4*>(dst + g * kVec);
      float4 a = d[0], b = d[1];
      float s[kVec];
      if constexpr (D == DType::kFloat32) {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(src) + g * kVec);
        float4 x = p[0], y = p[1];
        s[0] = x.x; s[1] = x.y; s[2] = x.z; s[3] = x.w; s[4] = y.x; s[5] = y.y; s[6] = y.z; s[7] = y.w;
      } else {
        uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(src) + g * kVec);
        const void* h = &raw;
#pragma unroll
        for (int k = 0; k < kVec; ++k) s[k] = detail::load<D>(h, k);
      }
      a.x += s[0]; a.y += s[1]; a.z += s[2]; a.w += s[3];
      b.x += s[4]; b.y += s[5]; b.z += s[6]; b.w += s[7];
      d[0] = a;
      d[1] = b;
    }
    tail_begin = groups * kVec;
  }
  for (int64_t i = tail_begin + first; i < n; i += stride) dst[i] += detail::load<D>(src, i);
}

}  // namespace

void accumulate_fp32_cuda(float* dst, const void* src, DType src_dtype, int64_t numel, void* stream) {
  BMT_CHECK(src_dtype == DType::kFloat32 || src_dtype == DType::kBFloat16 || src_dtype == DType::kFloat16,
            "accumulate_fp32_cuda: source dtype ", dtype_name(src_dtype), " is not fp32, bf16 or fp16");
  BMT_CHECK(numel >= 0, "accumulate_fp32_cuda: negative numel ", numel);
  if (numel == 0) return;
  BMT_CHECK(dst != nullptr && src != nullptr, "accumulate_fp32_cuda: null buffer");
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
  const int64_t work = aligned ? std::max<int64_t>(numel / kVec, 1) : numel;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (work + kThreads - 1) / kThreads));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (src_dtype) {
    case DType::kFloat32: accumulate_kernel<DType::kFloat32><<<blocks, kThreads, 0, s>>>(dst, src, numel, aligned); break;
    case DType::kBFloat16: accumulate_kernel<DType::kBFloat16><<<blocks, kThreads, 0, s>>>(dst, src, numel, aligned); break;
    default: accumulate_kernel<DType::kFloat16><<<blocks, kThreads, 0, s>>>(dst, src, numel, aligned); break;
  }
  cudaError_t err = cudaGetLastError();
  BMT_CHECK(err == cudaSuccess, "accumulate_fp32_cuda: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace bmt::core::kernels
