// Helpers shared by the optimizer tests: parameter sets of awkward sizes, clones, relative errors.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bmt/core/kernels/adam.h"
#include "bmt/core/kernels/thread_pool.h"

namespace bmt::optim::testing {

// Sizes around vector widths (8, 16) and the CPU chunk size (32768), plus an empty shard.
inline const std::vector<std::vector<int64_t>> kShapes = {{1}, {7}, {3, 11}, {0}, {1000}, {70001}};

inline std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& shapes, at::ScalarType dt,
                                           uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  std::vector<at::Tensor> out;
  for (const auto& s : shapes) out.push_back(at::randn(s, gen).to(dt).requires_grad_(true));
  return out;
}

inline std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& ps, at::ScalarType dt) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().to(dt).clone().requires_grad_(true));
  return out;
}

// max_i |a_i - b_i| / max(|b_i|, floor): relative error with a floor for elements near zero.
inline double max_rel_err(const at::Tensor& a, const at::Tensor& b, double floor = 1e-2) {
  if (a.numel() == 0) return 0.0;
  at::Tensor af = a.detach().to(at::kDouble), bf = b.detach().to(at::kDouble);
  return ((af - bf).abs() / bf.abs().clamp_min(floor)).max().item<double>();
}

// The fused kernel (core/kernels/adam.h, decoupled weight decay) run on fp32 tensors: the trajectory a half-
// precision parameter's fp32 master follows. (AdamOptimizer runs fp32 parameters through torch's op sequence.)
class FusedAdamRef {
 public:
  FusedAdamRef(std::vector<at::Tensor> params, double lr, double beta1, double beta2, double eps, double wd)
      : params_(std::move(params)), lr_(lr), beta1_(beta1), beta2_(beta2), eps_(eps), wd_(wd) {
    for (const auto& p : params_) {
      m_.push_back(at::zeros_like(p.detach()));
      v_.push_back(at::zeros_like(p.detach()));
    }
  }
  // One update from each parameter's .grad() (fp32), divided by loss_scale.
  void step(double loss_scale = 1.0) {
    ++step_;
    std::vector<core::kernels::AdamTensorArgs> args;
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < params_.size(); ++i) {
      grads.push_back(params_[i].grad().contiguous());
      core::kernels::AdamTensorArgs a;
      a.param = params_[i].data_ptr();
      a.grad = grads.back().data_ptr();
      a.exp_avg = m_[i].data_ptr<float>();
      a.exp_avg_sq = v_[i].data_ptr<float>();
      a.numel = params_[i].numel();
      core::kernels::adam_step_scalars(a, lr_, beta1_, beta2_, eps_, wd_, step_);
      args.push_back(a);
    }
    core::kernels::adam_cpu(args.data(), args.size(), static_cast<float>(1.0 / loss_scale),
                            core::kernels::ThreadPool::global());
  }

 private:
  std::vector<at::Tensor> params_, m_, v_;
  double lr_, beta1_, beta2_, eps_, wd_;
  int64_t step_ = 0;
};

}  // namespace bmt::optim::testing
