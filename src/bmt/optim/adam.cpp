#include "bmt/optim/adam.h"

#include <map>

#include "bmt/core/error.h"
#include "bmt/core/kernels/thread_pool.h"
#include "bmt/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace bmt::optim {

AdamOptimizer::AdamOptimizer(std::vector<at::Tensor> params, const AdamOptions& defaults)
    : AdamBase({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

AdamOptimizer::AdamOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             const AdamOptions& defaults)
    : AdamBase(param_groups, defaults) {}

AdamOptimizer::AdamOptimizer(const std::vector<ParamGroupSpec>& param_groups, const AdamOptions& defaults)
    : AdamBase(make_param_groups(param_groups, defaults), defaults) {}

AdamState AdamOptimizer::new_state(const at::Tensor& p) const {
  AdamState s;
  auto f32 = p.options().dtype(at::kFloat).requires_grad(false);
  s.exp_avg = at::zeros(p.sizes(), f32);
  s.exp_avg_sq = at::zeros(p.sizes(), f32);
  if (p.scalar_type() != at::kFloat) s.master = p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  return s;
}

void AdamOptimizer::do_step(double loss_scale) {
  validate_groups();
  const float inv_scale = static_cast<float>(1.0 / loss_scale);
  std::vector<core::kernels::AdamTensorArgs> cpu_args;
  std::map<int, std::vector<core::kernels::AdamTensorArgs>> cuda_args;  // by device index
  std::vector<at::Tensor> grads;  // keeps contiguous copies alive until the kernels ran / were enqueued
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const AdamOptions& o = group_options(g);
    for (const at::Tensor& p : param_groups_[g].params()) {
      at::Tensor grad = usable_grad(p);
      if (!grad.defined()) continue;
      grads.push_back(grad);
      AdamState& s = state_for(p);
      s.step += 1;
      core::kernels::AdamTensorArgs a = kernel_args(p.data_ptr(), p, grad, s, o);
      if (p.is_cpu()) {
        cpu_args.push_back(a);
      } else {
        BMT_CHECK(p.is_cuda(), "AdamOptimizer: parameters on ", p.device(), " are not supported (CPU or CUDA only)");
        cuda_args[p.device().index()].push_back(a);
      }
    }
  }
  if (!cpu_args.empty())
    core::kernels::adam_cpu(cpu_args.data(), cpu_args.size(), inv_scale, core::kernels::ThreadPool::global());
#ifdef BMT_WITH_CUDA
  for (auto& [device, args] : cuda_args) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    core::kernels::adam_cuda(args.data(), args.size(), inv_scale, /*skip_flag_device=*/nullptr,
                             c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  }
#else
  BMT_CHECK(cuda_args.empty(), "AdamOptimizer: CUDA parameters need a bmtrain build with CUDA (BMT_WITH_CUDA)");
#endif
}

}  // namespace bmt::optim
