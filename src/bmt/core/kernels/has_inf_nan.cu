// CUDA has_inf_nan: grid-stride exponent-mask test, one block-wide OR (__syncthreads_or), thread 0 of a block that
// saw an inf/NaN stores 1 into the flag (a benign race: every writer stores the same value; the flag is never
// cleared here). 64-bit indexing; nothing is launched for empty buffers or integer dtypes.
#include <cuda_runtime.h>

#include <algorithm>

#include "bmt/core/error.h"
#include "bmt/core/kernels/has_inf_nan_internal.h"

namespace bmt::core::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 2048;

template <typename Bits, Bits kExpMask>
__global__ void __launch_bounds__(kThreads) has_inf_nan_kernel(const Bits* x, int64_t n, int* flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int found = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    found |= (x[i] & kExpMask) == kExpMask;
  if (__syncthreads_or(found) && threadIdx.x == 0) *flag = 1;
}

template <typename Bits, Bits kExpMask>
void launch(const void* data, int64_t n, int* flag, cudaStream_t stream) {
  int64_t blocks = std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads);
  has_inf_nan_kernel<Bits, kExpMask>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const Bits*>(data), n, flag);
}

}  // namespace

void has_inf_nan_cuda(const void* data, int64_t numel, DType dtype, int* flag_device, void* stream) {
  BMT_CHECK(numel >= 0, "has_inf_nan_cuda: negative element count ", numel);
  if (numel == 0) return;
  BMT_CHECK(data != nullptr && flag_device != nullptr, "has_inf_nan_cuda: null buffer or flag");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: launch<uint32_t, 0x7f800000u>(data, numel, flag_device, s); break;
    case DType::kFloat16: launch<uint16_t, 0x7c00u>(data, numel, flag_device, s); break;
    case DType::kBFloat16: launch<uint16_t, 0x7f80u>(data, numel, flag_device, s); break;
    case DType::kFloat64: launch<uint64_t, 0x7ff0000000000000ull>(data, numel, flag_device, s); break;
    default: return;
  }
  cudaError_t err = cudaGetLastError();
  BMT_CHECK(err == cudaSuccess, "has_inf_nan_cuda: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace bmt::core::kernels
