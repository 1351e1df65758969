// BmtOptimizer: the base of bmtrain's own optimizers (BMTrain's `_bmtrain_optimizer = True`).
//
// It is a torch::optim::Optimizer (param groups, OptimizerOptions::get_lr/set_lr, so LR schedulers and
// OptimManager treat it like any torch optimizer) that additionally
//  * takes the loss scale in step(loss_scale): gradients are divided by it inside the update (no extra pass);
//  * reads each parameter's gradient with bmt::main_grad(p) (e.g. an fp32 gradient of a bf16 ZeRO shard) and
//    skips parameters that do not require grad or have no gradient;
//  * has a flat StateDict checkpoint format (state_dict.h) instead of torch's archive format; save()/load() wrap
//    it so torch::save(optimizer, path) also works.
// Parameters are addressed by their flat index: the position in param_groups() order (group 0's params, then
// group 1's, ...), see flat_params().
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <vector>

#include "bmt/optim/flat_state_dict.h"

namespace bmt::optim {

class BmtOptimizer : public torch::optim::Optimizer {
 public:
  BmtOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
               std::unique_ptr<torch::optim::OptimizerOptions> defaults);

  // torch::optim interface: evaluates the closure (if any) with grad mode on, then step(1.0). Returns its loss.
  at::Tensor step(LossClosure closure = nullptr) override;
  // One update with gradients divided by loss_scale (> 0, finite).
  void step(double loss_scale);

  // Zeros (or drops, set_to_none) every parameter's .grad() and zeros registered main gradients (bmt::main_grad)
  // in place. BMTrain's default: set_to_none = false (gradient buffers are reused for accumulation).
  void zero_grad(bool set_to_none = false);

  // All parameters in flat-index order.
  std::vector<at::Tensor> flat_params() const;

  virtual StateDict state_dict() const = 0;
  // The same entries, but tensors may alias the live state (no copy): for a caller that copies or writes them
  // before the state changes again (checkpoint::save). Default: state_dict().
  virtual StateDict state_dict_views() const { return state_dict(); }
  // Throws bmt::core::Error if sd belongs to a different model (parameter count or shapes differ).
  virtual void load_state_dict(const StateDict& sd) = 0;
  // True when load_state_dict takes meta tensors (placeholders) for per-parameter state tensors: it allocates
  // that state without filling it, and the caller then writes the values into state_dict_views()'s tensors of
  // the same keys (checkpoint::load reads them straight from the files into place).
  virtual bool accepts_state_placeholders() const { return false; }

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  virtual void do_step(double loss_scale) = 0;
  // Called by zero_grad before gradients are touched (e.g. to wait for asynchronous readers).
  virtual void before_zero_grad() {}
};

}  // namespace bmt::optim
