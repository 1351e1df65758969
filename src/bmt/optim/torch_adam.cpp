#include "bmt/optim/torch_adam.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

#include "bmt/core/error.h"

namespace bmt::optim::detail {
namespace {

// The gradient torch's Adam sees: fp32, divided by the loss scale (a new tensor: the caller's stays untouched).
at::Tensor unscaled_grad(const at::Tensor& grad, const at::Tensor& param, double loss_scale) {
  BMT_CHECK(param.scalar_type() == at::kFloat, "torch-order Adam: fp32 parameters only, got ", param.scalar_type());
  BMT_CHECK(grad.numel() == param.numel(), "torch-order Adam: the gradient has ", grad.numel(),
            " elements, its parameter ", param.numel());
  at::Tensor g = grad.scalar_type() == at::kFloat ? grad : grad.to(at::kFloat);
  g = g.view(param.sizes());
  if (loss_scale != 1.0) g = g / loss_scale;  // x / 1 == x: no copy needed then
  return g;
}

// Python's `1 - beta ** step` with step a float (torch keeps the step count in a float tensor).
double bias_correction(double beta, int64_t step) { return 1.0 - std::pow(beta, static_cast<double>(step)); }

}  // namespace

void torch_adam_single(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq, int64_t step, const TorchAdamScalars& s) {
  at::NoGradGuard no_grad;
  at::Tensor p = param, m = exp_avg.view(param.sizes()), v = exp_avg_sq.view(param.sizes());
  at::Tensor g = unscaled_grad(grad, param, s.loss_scale);
  if (s.weight_decay != 0) {
    if (s.decoupled_weight_decay) p.mul_(1 - s.lr * s.weight_decay);
    else g = g.add(p, s.weight_decay);
  }
  m.lerp_(g, 1 - s.beta1);
  v.mul_(s.beta2).addcmul_(g, g, 1 - s.beta2);
  const double step_size = s.lr / bias_correction(s.beta1, step);
  const double bc2_sqrt = std::pow(bias_correction(s.beta2, step), 0.5);  // Python's `** 0.5`
  at::Tensor denom = (v.sqrt() / bc2_sqrt).add_(s.eps);
  p.addcdiv_(m, denom, -step_size);
}

void torch_adam_foreach(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<int64_t>& steps, const TorchAdamScalars& s) {
  const size_t n = params.size();
  BMT_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
            "torch-order Adam: ", n, " parameters but ", grads.size(), " gradients, ", exp_avgs.size(), " / ",
            exp_avg_sqs.size(), " moments and ", steps.size(), " step counts");
  if (n == 0) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> g(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = unscaled_grad(grads[i], params[i], s.loss_scale);
    m[i] = exp_avgs[i].view(params[i].sizes());
    v[i] = exp_avg_sqs[i].view(params[i].sizes());
  }
  if (s.weight_decay != 0) {
    if (s.decoupled_weight_decay) at::_foreach_mul_(params, 1 - s.lr * s.weight_decay);
    else g = at::_foreach_add(g, params, s.weight_decay);
  }
  at::_foreach_lerp_(m, g, 1 - s.beta1);
  at::_foreach_mul_(v, s.beta2);
  at::_foreach_addcmul_(v, g, g, 1 - s.beta2);
  g.clear();  // torch frees its gradient intermediates here too (peak memory)
  std::vector<at::Scalar> step_size(n), bc2_sqrt(n);
  for (size_t i = 0; i < n; ++i) {
    step_size[i] = -(s.lr / bias_correction(s.beta1, steps[i]));
    bc2_sqrt[i] = std::pow(bias_correction(s.beta2, steps[i]), 0.5);
  }
  std::vector<at::Tensor> denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, bc2_sqrt);
  at::_foreach_add_(denom, s.eps);
  at::_foreach_addcdiv_(params, m, denom, step_size);
}

}  // namespace bmt::optim::detail
