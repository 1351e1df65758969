// AdamOptions, param groups and the per-parameter Adam state shared by AdamOptimizer and AdamOffloadOptimizer.
//
// Invariants:
//  * Every param group carries AdamOptions with lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0 (else
//    bmt::core::Error at construction, add_param_group time is checked at the next step); options of another
//    optimizer type (e.g. torch::optim::AdamWOptions) are rejected.
//  * Parameters are float32, float16 or bfloat16, contiguous, and appear in one group only.
//  * fp32 parameters are updated by torch.optim.Adam's own op sequence (torch_adam.h: bit-identical to it), half-
//    precision ones by the fused kernels (core/kernels/adam.h, decoupled weight decay).
//  * State per parameter (created at its first update): step (updates applied), exp_avg and exp_avg_sq (fp32,
//    unscaled), master (fp32 copy of a half-precision parameter; undefined for fp32 parameters, which are updated
//    in place). AdamOptimizer keeps the state on the parameter's device, AdamOffloadOptimizer in host memory.
//  * State dict layout (both optimizers use it, so their checkpoints are interchangeable):
//      num_params, num_groups                          int64
//      param.<i>.shape                                 int64[dim]    (local shard shape, checked on load)
//      group.<g>.{lr,beta1,beta2,eps,weight_decay}     float64
//      group.<g>.num_params                            int64
//    (hold_steps and decoupled_weight_decay are construction options: not saved, kept on load)
//      state.<i>.step                                  int64         (only for parameters with state)
//      state.<i>.{exp_avg,exp_avg_sq}                  float32[shape]
//      state.<i>.master                                float32[shape] (half-precision parameters)
#pragma once

#include <torch/arg.h>

#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "bmt/core/kernels/adam.h"
#include "bmt/optim/optimizer.h"

namespace bmt::optim {

struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  using betas_t = std::tuple<double, double>;
  AdamOptions(double lr = 1e-3, betas_t betas = {0.9, 0.999}, double eps = 1e-8, double weight_decay = 0.0)
      : lr_(lr), betas_(betas), eps_(eps), weight_decay_(weight_decay) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(betas_t, betas);
  TORCH_ARG(double, eps);
  TORCH_ARG(double, weight_decay);
  // BMTrain's hold_steps: updates held at lr 0 (the moments still advance): the first hold_steps updates of an
  // fp32 parameter, the first hold_steps - 1 of a half-precision one (BMTrain counts the step first there).
  TORCH_ARG(int64_t, hold_steps) = 0;
  // fp32 parameters: false (default, torch.optim.Adam's and BMTrain's) adds weight_decay * p to the gradient (L2);
  // true decays the parameter by (1 - lr * weight_decay) first, as torch's Adam(decoupled_weight_decay=True) /
  // AdamW. Half-precision parameters always use decoupled decay (BMTrain's fused kernel).
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  // Throws bmt::core::Error naming `where` and the offending value.
  void validate(const std::string& where) const;
};

// A param group with options by name, for callers that build groups from configuration files.
// Known keys: lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay (0 or 1); any other key is an error.
// Missing keys take the defaults.
struct ParamGroupSpec {
  std::vector<at::Tensor> params;
  std::map<std::string, double> options;
};
std::vector<torch::optim::OptimizerParamGroup> make_param_groups(const std::vector<ParamGroupSpec>& specs,
                                                                 const AdamOptions& defaults);

struct AdamState {
  int64_t step = 0;
  at::Tensor exp_avg, exp_avg_sq, master;
};

class AdamBase : public BmtOptimizer {
 public:
  AdamBase(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, const AdamOptions& defaults);

  StateDict state_dict() const override;
  StateDict state_dict_views() const override;
  void load_state_dict(const StateDict& sd) override;
  bool accepts_state_placeholders() const override { return true; }

  // The state of p, or nullptr before p's first update.
  const AdamState* find_state(const at::Tensor& p) const;
  const AdamOptions& group_options(size_t group) const;
  // Re-initialises every fp32 master copy from its (half-precision) parameter, e.g. after loading model weights
  // into a model whose optimizer already has state.
  void refresh_master();

 protected:
  StateDict state_dict_impl(bool copy) const;
  // A fresh state for p (zeros, master = p as fp32), on the device this optimizer keeps state on; uninitialized:
  // the same tensors left unfilled (a load writes every element).
  virtual AdamState new_state(const at::Tensor& p, bool uninitialized) const = 0;
  // The device new_state puts p's state on.
  virtual c10::Device state_device(const at::Tensor& p) const { return p.device(); }
  // Waits for updates that may still be writing the state or the parameters (AdamOffloadOptimizer); called before
  // the state is read or replaced: find_state, state_dict, load_state_dict, refresh_master.
  virtual void wait_for_running_updates() const {}
  AdamState& state_for(const at::Tensor& p);
  // Re-validates group options and parameters (param groups may have been added since construction).
  void validate_groups() const;
  // The lr of update number s.step of p: 0 while hold_steps holds it (BMTrain's count for p's dtype).
  static double effective_lr(const at::Tensor& p, const AdamState& s, const AdamOptions& o);
  // Kernel arguments for one update of a parameter (`param_data` is the buffer the kernel writes, in the
  // parameter's dtype), with the scalars of update number s.step.
  static core::kernels::AdamTensorArgs kernel_args(void* param_data, const at::Tensor& param, const at::Tensor& grad,
                                                   AdamState& s, const AdamOptions& o);
  // The gradient to use for p (bmt::main_grad), checked against p; undefined if p takes no update.
  static at::Tensor usable_grad(const at::Tensor& p);

  std::unordered_map<const void*, AdamState> states_;
};

}  // namespace bmt::optim
