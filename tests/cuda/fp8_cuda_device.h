// What the FP8 CUDA tests share: the current stream as the kernels take it, and whether this GPU has FP8 tensor
// cores (compute capability 8.9+), which the FP8 GEMMs need.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/cuda.h>

namespace fp8_cuda_test {

inline void* stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline bool fp8_gemm_device() {
  if (!torch::cuda::is_available()) return false;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major * 10 + minor >= 89;
}

}  // namespace fp8_cuda_test
