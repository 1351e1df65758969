// Delayed scaling's record on the device (fp8_delayed_scale_internal.h): one block, the history shifted and its
// maximum taken by one thread (len is a few dozen), so there is no order to make the twin's bits differ.
#include <cuda_runtime.h>

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_internal.cuh"
#include "bmt/core/kernels/fp8_delayed_scale_internal.h"

namespace bmt::core::kernels {
namespace {

__global__ void record_kernel(float* history, int64_t len, float* scale, float* inv, float* amax_io, float fp8_max,
                              float* call_inv) {
  if (threadIdx.x != 0) return;
  const float amax = *amax_io;
  const bool finite = isfinite(amax);
  *call_inv = finite ? *inv : __int_as_float(0x7fffffff);
  float m = finite ? amax : 0.0f;
  for (int64_t i = len - 1; i > 0; --i) {
    history[i] = history[i - 1];
    m = fmaxf(m, history[i]);
  }
  history[0] = finite ? amax : 0.0f;
  fp8_device::scale_of(__float_as_uint(m), fp8_max, *scale, *inv);
  *amax_io = 0.0f;
}

}  // namespace

void fp8_delayed_record_cuda(const Fp8DelayedState& s, float* call_inv, void* stream) {
  BMT_CHECK(s.history && s.len > 0 && s.scale && s.inv && s.amax && call_inv,
            "fp8_delayed_record_cuda: null state or a history of length ", s.len);
  record_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(s.history, s.len, s.scale, s.inv, s.amax,
                                                                  fp8_max(s.format), call_inv);
  const cudaError_t e = cudaGetLastError();
  BMT_CHECK(e == cudaSuccess, "fp8_delayed_record_cuda: launch failed: ", cudaGetErrorString(e));
}

}  // namespace bmt::core::kernels
