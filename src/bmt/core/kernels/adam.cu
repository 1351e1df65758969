// CUDA fused multi-tensor Adam (see adam.h for the update and its invariants). One launch covers up to
// kAdamCudaTensorsPerLaunch tensors of one (param, grad) dtype pair: the tensor table travels in the kernel
// parameters (no device allocation, no host sync), blockIdx.y selects the tensor, blockIdx.x/threadIdx.x walk its
// elements with a 64-bit grid-stride loop. All arithmetic uses the explicitly rounded intrinsics (__fmul_rn, ...)
// so that nvcc cannot contract into FMAs: results are bit-identical to the CPU twin (adam_cpu.cpp).
// The optional device-side skip flag turns the whole launch into a no-op (loss-scale overflow without a host sync).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/adam.h"
#include "bmt/core/kernels/element_access.cuh"

namespace bmt::core::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksPerTensor = 1024;

struct LaunchTable {
  AdamTensorArgs t[kAdamCudaTensorsPerLaunch];
};
static_assert(sizeof(LaunchTable) + 32 <= 4096, "kernel parameters must fit the 4 KiB limit");

using detail::load;
using detail::store;

template <DType PD, DType GD>
__global__ void __launch_bounds__(kThreads) adam_multi_kernel(LaunchTable table, float inv_scale, const int* skip) {
  if (skip != nullptr && *skip != 0) return;
  const AdamTensorArgs& t = table.t[blockIdx.y];
  const int64_t n = t.numel;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float g = __fmul_rn(load<GD>(t.grad, i), inv_scale);
    float p = t.master != nullptr ? t.master[i] : load<PD>(t.param, i);
    float m = __fadd_rn(__fmul_rn(t.exp_avg[i], t.beta1), __fmul_rn(g, t.one_minus_beta1));
    float v = __fadd_rn(__fmul_rn(t.exp_avg_sq[i], t.beta2), __fmul_rn(__fmul_rn(g, g), t.one_minus_beta2));
    float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), t.bias_correction2_sqrt), t.eps);
    p = __fsub_rn(__fmul_rn(p, t.decay), __fmul_rn(t.step_size, __fdiv_rn(m, d)));
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    if (t.master != nullptr) t.master[i] = p;
    store<PD>(t.param, i, p);
  }
}

template <DType PD, DType GD>
void launch(const LaunchTable& table, int count, int64_t max_numel, float inv_scale, const int* skip,
            cudaStream_t stream) {
  int64_t blocks_x = std::min<int64_t>(kMaxBlocksPerTensor, (max_numel + kThreads - 1) / kThreads);
  dim3 grid(static_cast<unsigned>(std::max<int64_t>(blocks_x, 1)), static_cast<unsigned>(count));
  adam_multi_kernel<PD, GD><<<grid, kThreads, 0, stream>>>(table, inv_scale, skip);
}

template <DType PD>
void launch_grad(DType gd, const LaunchTable& table, int count, int64_t max_numel, float inv_scale, const int* skip,
                 cudaStream_t stream) {
  switch (gd) {
    case DType::kFloat32: return launch<PD, DType::kFloat32>(table, count, max_numel, inv_scale, skip, stream);
    case DType::kBFloat16: return launch<PD, DType::kBFloat16>(table, count, max_numel, inv_scale, skip, stream);
    case DType::kFloat16: return launch<PD, DType::kFloat16>(table, count, max_numel, inv_scale, skip, stream);
    default: BMT_ERROR("adam_cuda: unsupported gradient dtype ", dtype_name(gd));
  }
}

void launch_any(DType pd, DType gd, const LaunchTable& table, int count, int64_t max_numel, float inv_scale,
                const int* skip, cudaStream_t stream) {
  switch (pd) {
    case DType::kFloat32: return launch_grad<DType::kFloat32>(gd, table, count, max_numel, inv_scale, skip, stream);
    case DType::kBFloat16: return launch_grad<DType::kBFloat16>(gd, table, count, max_numel, inv_scale, skip, stream);
    case DType::kFloat16: return launch_grad<DType::kFloat16>(gd, table, count, max_numel, inv_scale, skip, stream);
    default: BMT_ERROR("adam_cuda: unsupported parameter dtype ", dtype_name(pd));
  }
}

}  // namespace

void adam_cuda(const AdamTensorArgs* tensors, size_t num_tensors, float inv_scale, const int* skip_flag_device,
               void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const DType kinds[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  for (size_t k = 0; k < num_tensors; ++k) adam_check_args(tensors[k], "tensor");
  for (DType pd : kinds) {
    for (DType gd : kinds) {
      LaunchTable table;
      int count = 0;
      int64_t max_numel = 0;
      for (size_t k = 0; k < num_tensors; ++k) {
        const AdamTensorArgs& t = tensors[k];
        if (t.param_dtype != pd || t.grad_dtype != gd || t.numel == 0) continue;
        table.t[count++] = t;
        max_numel = std::max(max_numel, t.numel);
        if (count == kAdamCudaTensorsPerLaunch) {
          launch_any(pd, gd, table, count, max_numel, inv_scale, skip_flag_device, s);
          count = 0;
          max_numel = 0;
        }
      }
      if (count > 0) launch_any(pd, gd, table, count, max_numel, inv_scale, skip_flag_device, s);
    }
  }
  cudaError_t err = cudaGetLastError();
  BMT_CHECK(err == cudaSuccess, "adam_cuda: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace bmt::core::kernels
