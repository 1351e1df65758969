#include "bmt/optim/adam.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <map>
#include <tuple>
#include <unordered_map>

#include "bmt/core/error.h"
#include "bmt/core/kernels/thread_pool.h"
#include "bmt/optim/torch_adam.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/runtime/tensor_adapter_internal.h"

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

AdamState AdamOptimizer::new_state(const at::Tensor& p, bool uninitialized) const {
  AdamState s;
  auto f32 = p.options().dtype(at::kFloat).requires_grad(false);
  s.exp_avg = uninitialized ? at::empty(p.sizes(), f32) : at::zeros(p.sizes(), f32);
  s.exp_avg_sq = uninitialized ? at::empty(p.sizes(), f32) : at::zeros(p.sizes(), f32);
  if (p.scalar_type() != at::kFloat)
    s.master = uninitialized ? at::empty(p.sizes(), f32) : p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  return s;
}

void AdamOptimizer::do_step(double loss_scale) {
  validate_groups();
  std::vector<std::pair<at::Tensor, size_t>> rest;  // (parameter, group)
  for (size_t g = 0; g < param_groups_.size(); ++g)
    for (const at::Tensor& p : param_groups_[g].params())
      if (!started_.count(p.unsafeGetTensorImpl())) rest.emplace_back(p, g);
  launch(rest, loss_scale);
  started_.clear();
}

void AdamOptimizer::step_params(const std::vector<at::Tensor>& params, double loss_scale) {
  BMT_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "AdamOptimizer::step_params: loss_scale must be finite and "
            "> 0, got ", loss_scale);
  validate_groups();
  std::unordered_map<const void*, size_t> group_of;
  for (size_t g = 0; g < param_groups_.size(); ++g)
    for (const at::Tensor& p : param_groups_[g].params()) group_of.emplace(p.unsafeGetTensorImpl(), g);
  std::vector<std::pair<at::Tensor, size_t>> chosen;
  for (const at::Tensor& p : params) {
    auto it = group_of.find(p.unsafeGetTensorImpl());
    BMT_CHECK(it != group_of.end(), "AdamOptimizer::step_params: a tensor of shape ", p.sizes(),
              " is not a parameter of this optimizer");
    BMT_CHECK(started_.insert(p.unsafeGetTensorImpl()).second, "AdamOptimizer::step_params: a parameter of shape ",
              p.sizes(), " was already updated in this iteration; call step() or zero_grad() to end it first");
    chosen.emplace_back(p, it->second);
  }
  wait_for_gradient_reduction();
  at::NoGradGuard no_grad;
  launch(chosen, loss_scale);
}

void AdamOptimizer::step_unless(double loss_scale, const at::Tensor& skip_flag) {
  BMT_CHECK(skip_flag.defined() && skip_flag.is_cuda() && skip_flag.scalar_type() == at::kInt && skip_flag.numel() == 1,
            "AdamOptimizer::step_unless: the skip flag must be a one-element int32 CUDA tensor");
  skip_flag_ = skip_flag.data_ptr<int>();
  skip_tensor_ = skip_flag;
  try {
    step(loss_scale);
  } catch (...) {
    skip_flag_ = nullptr;
    skip_tensor_ = at::Tensor();
    throw;
  }
  skip_flag_ = nullptr;
  skip_tensor_ = at::Tensor();
}

void AdamOptimizer::undo_skipped_step() {
  for (const void* key : last_stepped_) {
    auto it = states_.find(key);
    if (it != states_.end()) it->second.step -= 1;
  }
  for (const void* key : last_created_) states_.erase(key);  // as if never updated (the kernel wrote nothing)
  last_stepped_.clear();
  last_created_.clear();
}

void AdamOptimizer::launch(const std::vector<std::pair<at::Tensor, size_t>>& params, double loss_scale) {
  const float inv_scale = static_cast<float>(1.0 / loss_scale);
  at::NoGradGuard no_grad;
  last_stepped_.clear();
  last_created_.clear();
  // The torch-order fp32 updates cannot wait for a device flag: their host scalars are fixed when queued. Under
  // step_unless they read the verdict on the host instead (a synchronisation; the fused half updates are queued
  // before it).
  int fp32_skip = -1;  // -1: not read yet
  auto skip_fp32 = [&] {
    if (skip_tensor_.defined() && fp32_skip < 0) fp32_skip = skip_tensor_.item<int>() != 0 ? 1 : 0;
    return fp32_skip == 1;
  };
  std::vector<core::kernels::AdamTensorArgs> cpu_args;
  std::map<int, std::vector<core::kernels::AdamTensorArgs>> cuda_args;  // by device index
  std::vector<Fp32Update> fp32;
  std::vector<at::Tensor> grads;  // keeps contiguous copies alive until the kernels ran / were enqueued
  for (const auto& [p, g] : params) {
    const AdamOptions& o = group_options(g);
    at::Tensor grad = usable_grad(p);
    if (!grad.defined()) continue;
    BMT_CHECK(p.is_cpu() || p.is_cuda(), "AdamOptimizer: parameters on ", p.device(),
              " are not supported (CPU or CUDA only)");
    const bool is_fp32 = p.scalar_type() == at::kFloat;
    BMT_CHECK(skip_flag_ == nullptr || !p.is_cpu(), "AdamOptimizer::step_unless: parameters on the CPU cannot wait "
              "for a device flag; use step()");
    if (is_fp32 && skip_fp32()) continue;  // the whole step is skipped: no state, no count
    grads.push_back(grad);
    const void* key = p.unsafeGetTensorImpl();
    if (!states_.count(key)) last_created_.push_back(key);
    AdamState& s = state_for(p);
    s.step += 1;
    last_stepped_.push_back(key);
    if (is_fp32) {
      fp32.push_back({p, grad, &s, g, effective_lr(p, s, o)});
      continue;
    }
    core::kernels::AdamTensorArgs a = kernel_args(p.data_ptr(), p, grad, s, o);
    if (p.is_cpu()) cpu_args.push_back(a);
    else cuda_args[p.device().index()].push_back(a);
  }
  if (!cpu_args.empty())
    core::kernels::adam_cpu(cpu_args.data(), cpu_args.size(), inv_scale, core::kernels::ThreadPool::global());
#ifdef BMT_WITH_CUDA
  for (auto& [device, args] : cuda_args) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    core::kernels::adam_cuda(args.data(), args.size(), inv_scale, skip_flag_,
                             c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
  }
#else
  BMT_CHECK(cuda_args.empty(), "AdamOptimizer: CUDA parameters need a bmtrain build with CUDA (BMT_WITH_CUDA)");
#endif
  update_fp32(fp32, loss_scale);
}

void AdamOptimizer::update_fp32(const std::vector<Fp32Update>& updates, double loss_scale) {
  // As torch.optim.Adam picks by default: one parameter at a time on the CPU, foreach ops per (group, device) on
  // CUDA (torch runs a param group at once; held and unheld parameters differ in lr, so they go apart).
  std::map<std::tuple<size_t, int, double>, std::vector<const Fp32Update*>> batches;
  for (const Fp32Update& u : updates) {
    const AdamOptions& o = group_options(u.group);
    detail::TorchAdamScalars sc{u.lr, std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                                o.decoupled_weight_decay(), loss_scale};
    if (u.param.is_cpu()) {
      detail::torch_adam_single(u.param, u.grad, u.state->exp_avg, u.state->exp_avg_sq, u.state->step, sc);
    } else {
#ifdef BMT_WITH_CUDA
      batches[{u.group, u.param.device().index(), u.lr}].push_back(&u);
#else
      BMT_ERROR("AdamOptimizer: CUDA parameters need a bmtrain build with CUDA (BMT_WITH_CUDA)");
#endif
    }
  }
  for (const auto& [key, batch] : batches) {
    const AdamOptions& o = group_options(std::get<0>(key));
    detail::TorchAdamScalars sc{std::get<2>(key), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                                o.weight_decay(), o.decoupled_weight_decay(), loss_scale};
    std::vector<at::Tensor> p, g, m, v;
    std::vector<int64_t> steps;
    for (const Fp32Update* u : batch) {
      p.push_back(u->param);
      g.push_back(u->grad);
      m.push_back(u->state->exp_avg);
      v.push_back(u->state->exp_avg_sq);
      steps.push_back(u->state->step);
    }
    detail::torch_adam_foreach(p, g, m, v, steps, sc);
  }
}

}  // namespace bmt::optim
