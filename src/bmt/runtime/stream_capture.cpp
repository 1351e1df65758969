#include "bmt/runtime/stream_capture.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bmt {

bool current_stream_capturing(const c10::Device& device) {
#ifdef BMT_WITH_CUDA
  if (!device.is_cuda()) return false;
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(index).stream(), &status);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
#else
  (void)device;
  return false;
#endif
}

}  // namespace bmt
