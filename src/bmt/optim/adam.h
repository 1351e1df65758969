// AdamOptimizer: Adam with bias correction over (sharded) parameter tensors, state on the parameter's device
// (BMTrain's bmt.optim.AdamOptimizer).
//
//  * fp32 parameters are updated in place by torch.optim.Adam's own op sequence (torch_adam.h): bit-identical to
//    torch.optim.Adam(lr, betas, eps, weight_decay) on the same device, L2 weight decay by default, decoupled
//    (torch's AdamW) with AdamOptions::decoupled_weight_decay. CPU: torch's single-tensor path, CUDA: its foreach
//    path on the current stream.
//  * fp16/bf16 parameters get an fp32 master copy of the local shard, updated by one fused multi-tensor kernel
//    with decoupled weight decay (core::kernels::adam_cpu on the global ThreadPool, adam_cuda on each device's
//    current stream, no host synchronisation); the value is written back rounded to nearest even. Moments are
//    fp32 and unscaled for every dtype.
//  * step(loss_scale) divides gradients by loss_scale first. Gradients come from bmt::main_grad(p); parameters
//    that do not require grad or have no gradient are skipped (their step count does not advance).
//  * hold_steps: BMTrain's count (fp32: the first hold_steps updates at lr 0, half: the first hold_steps - 1).
//  * step_params(params, loss_scale) updates some parameters now (OptimManager::overlap_step_with_backward: a
//    Block's update as soon as its gradients are reduced); step() then updates only the others, and step() or
//    zero_grad() ends the iteration. A parameter can be updated once per iteration.
#pragma once

#include <unordered_set>
#include <utility>
#include <vector>

#include "bmt/optim/adam_base.h"

namespace bmt::optim {

class AdamOptimizer : public AdamBase {
 public:
  // Queues the update of `params` (parameters of this optimizer not updated yet in this iteration) now.
  void step_params(const std::vector<at::Tensor>& params, double loss_scale = 1.0);
  // Parameters updated by step_params in the current iteration.
  size_t num_started() const { return started_.size(); }
  // step(loss_scale) whose CUDA kernel does nothing if `skip_flag` (int32, one element, on the parameters' CUDA
  // device) is non-zero when it runs: the update is queued before the host knows the verdict (fp32 parameters'
  // torch-order updates read the flag on the host first). When the verdict
  // turns out non-zero, undo_skipped_step() takes back the step counts (and states) the update advanced (the
  // kernel changed nothing). OptimManager::step uses it to queue the update ahead of its inf/NaN host read.
  void step_unless(double loss_scale, const at::Tensor& skip_flag);
  void undo_skipped_step();

  explicit AdamOptimizer(std::vector<at::Tensor> params, const AdamOptions& defaults = {});
  explicit AdamOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                         const AdamOptions& defaults = {});
  explicit AdamOptimizer(const std::vector<ParamGroupSpec>& param_groups, const AdamOptions& defaults = {});

 protected:
  void do_step(double loss_scale) override;
  AdamState new_state(const at::Tensor& p, bool uninitialized) const override;
  void before_zero_grad() override { started_.clear(); }

 private:
  struct Fp32Update {
    at::Tensor param, grad;
    AdamState* state;
    size_t group;
    double lr;  // 0 while held
  };
  // Queues the update of `params` (those with a usable gradient): half ones fused, fp32 ones torch's way.
  void launch(const std::vector<std::pair<at::Tensor, size_t>>& params, double loss_scale);
  void update_fp32(const std::vector<Fp32Update>& updates, double loss_scale);
  std::unordered_set<const void*> started_;
  const int* skip_flag_ = nullptr;        // set during step_unless only
  at::Tensor skip_tensor_;                // ... the same flag as a tensor
  std::vector<const void*> last_stepped_;  // states whose step count the last launch advanced
  std::vector<const void*> last_created_;  // ... and those it created
};

}  // namespace bmt::optim
