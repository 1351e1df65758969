// Fused multi-tensor Adam with decoupled weight decay (AdamW), torch-free: raw pointers + numel + DType.
//
// Per element i of one tensor (all arithmetic in fp32, in exactly this order, no fused multiply-add):
//   g  = grad[i] * grad_inv_scale                  (un-does the loss scale)
//   p  = master ? master[i] : param[i]             (fp32 source of truth)
//   m  = m * beta1 + g * one_minus_beta1
//   v  = v * beta2 + (g * g) * one_minus_beta2
//   d  = sqrt(v) / bias_correction2_sqrt + eps
//   p  = p * decay - step_size * (m / d)           decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^step)
//   master[i] = p (if master);  param[i] = round_to_nearest_even(p, param_dtype)
// This is torch::optim::AdamW's update. Because it uses only correctly rounded IEEE operations, the scalar, AVX2
// and AVX-512 CPU paths and the CUDA kernel produce bit-identical results (NaN payloads aside); the CPU twin is
// the reference of the CUDA kernel's tests.
//
// Invariants: param is fp32 (then master == nullptr and param is updated in place) or fp16/bf16 (then master
// points to the fp32 master copy of the same numel); grad is fp32, fp16 or bf16; exp_avg / exp_avg_sq are fp32
// and kept unscaled. Element counts and indices are 64-bit.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels {

class ThreadPool;

struct AdamTensorArgs {
  void* param = nullptr;        // param_dtype, numel elements, updated in place
  float* master = nullptr;      // fp32 master copy (half params) or nullptr (fp32 params)
  const void* grad = nullptr;   // grad_dtype
  float* exp_avg = nullptr;     // fp32
  float* exp_avg_sq = nullptr;  // fp32
  int64_t numel = 0;
  DType param_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  // Per-tensor scalars (param groups may differ), see adam_step_scalars.
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float decay = 1.0f;                  // 1 - lr * weight_decay
  float step_size = 0.0f;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt = 1.0f;  // sqrt(1 - beta2^step)
};

// Fills the per-tensor scalars for update number `step` (1-based), computed in double like torch.
inline void adam_step_scalars(AdamTensorArgs& a, double lr, double beta1, double beta2, double eps,
                              double weight_decay, int64_t step) {
  a.beta1 = static_cast<float>(beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
}

// Instruction-set levels of the CPU kernel.
enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
const char* cpu_isa_name(CpuIsa isa);
// Best level this CPU supports (__builtin_cpu_supports); env BMT_CPU_ISA=scalar|avx2|avx512 lowers it.
CpuIsa adam_cpu_best_isa();
bool adam_cpu_isa_supported(CpuIsa isa);

// Validates one tensor's arguments (dtypes, pointers); throws bmt::core::Error naming `what`.
void adam_check_args(const AdamTensorArgs& t, const char* what);

// Updates elements [begin, end) of one tensor on the calling thread with the given ISA (default: best).
void adam_cpu_range(const AdamTensorArgs& t, float grad_inv_scale, int64_t begin, int64_t end);
void adam_cpu_range_isa(const AdamTensorArgs& t, float grad_inv_scale, int64_t begin, int64_t end, CpuIsa isa);

// Elements per task when adam_cpu splits tensors (a multiple of every vector width).
constexpr int64_t kAdamCpuChunkElems = 1 << 15;

// Updates all tensors, split into chunks of kAdamCpuChunkElems run on `pool` (and the caller). Blocks.
void adam_cpu(const AdamTensorArgs* tensors, size_t num_tensors, float grad_inv_scale, ThreadPool& pool);

// CUDA (only in builds with BMT_WITH_CUDA): one kernel launch per group of up to kAdamCudaTensorsPerLaunch
// tensors of the same (param, grad) dtype pair, enqueued on `stream` (a cudaStream_t). All pointers are device
// pointers. If skip_flag_device is non-null and *skip_flag_device != 0 when the kernel runs, nothing is updated
// (an overflowed step costs no host synchronisation). `tensors` is read on the host before the call returns.
constexpr int kAdamCudaTensorsPerLaunch = 36;
void adam_cuda(const AdamTensorArgs* tensors, size_t num_tensors, float grad_inv_scale, const int* skip_flag_device,
               void* stream);

}  // namespace bmt::core::kernels
