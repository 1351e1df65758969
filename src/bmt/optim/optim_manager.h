// OptimManager: BMTrain's bmt.optim.OptimManager — dynamic loss scaling, global inf/NaN check, gradient clipping,
// LR-scheduler stepping and checkpointing over a set of optimizers (bmtrain's own or plain torch::optim ones).
//
// Loss scaling (loss_scale > 0 enables it; 0 disables it and the scale stays 1):
//  * backward(loss) = (loss * loss_scale / grad_scale).backward().
//  * step(): ONE all_reduce(max) over bmt::config().comm decides whether any gradient of any rank is inf/NaN
//    (checked always, also with scaling disabled, so a NaN never reaches the parameters). On overflow the step is
//    skipped on every rank (no optimizer or scheduler step), gradients are zeroed, and the scale is divided by
//    loss_scale_factor, never below min_loss_scale. After loss_scale_steps consecutive good steps it is multiplied
//    by the factor, never above max_loss_scale. Scale changes are printed once (rank 0). A factor < 1 is inverted.
//    When every optimizer is a GPU AdamOptimizer (and no overlap is on), the updates are queued on the device
//    before the host reads the verdict, skipping themselves on inf/NaN (AdamOptimizer::step_unless): the GPU does
//    not wait for the host to prepare them after the read. Same results, same return value.
//  * bmtrain optimizers (BmtOptimizer) receive step(loss_scale) and unscale inside their kernel; torch optimizers
//    get their gradients divided by the scale first.
//  * grad_scale: 0 (default) = the data-parallel size, bmt::config().tp_zero_size (world / (tp * pipe)), after
//    init_distributed, 1 before it. With per-rank mean losses and gradients summed over data-parallel ranks this
//    makes the effective gradient the data-parallel mean; pass 1 to keep sums. (BMTrain divides by world / pipe,
//    which under tensor parallelism also divides by tp although the tp ranks share one loss.)
//
// clip_grad_norm(max_norm, norm_type): the global norm (2-norm or inf-norm; any p >= 1) of all gradients of all
// added optimizers' parameters across ranks (global_grad_norm: replication-aware, one all_reduce), in unscaled
// units (the gradients still carry the loss scale and are divided by it for the norm); if norm > max_norm the
// gradients are multiplied by max_norm / (norm + eps) in place. A non-finite norm leaves gradients untouched
// (step() will skip). Call it between backward() and step(). Returns the unscaled total norm.
//
// state_dict() (a StateDict, see state_dict.h):
//   loss_scale (float64), loss_scale_enabled, steps_since_last_scale, num_optimizers (int64),
//   optimizers.<k>.<key>       the BmtOptimizer's own state dict, or for a torch optimizer:
//   optimizers.<k>.torch_archive (uint8 bytes of torch::serialize), optimizers.<k>.num_params,
//   optimizers.<k>.param.<i>.shape;
//   lr_schedulers.<k>.num_iter for optimizers that have a scheduler.
// load_state_dict checks optimizer counts, scheduler presence and parameter shapes (bmt::core::Error otherwise).
#pragma once

#include <torch/optim/optimizer.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "bmt/optim/lr_scheduler.h"
#include "bmt/optim/offload_overlap.h"
#include "bmt/optim/flat_state_dict.h"

namespace bmt::optim {

struct OptimManagerOptions {
  double loss_scale = 0;  // initial scale; 0 disables loss scaling
  double loss_scale_factor = 2;
  int64_t loss_scale_steps = 1024;
  double min_loss_scale = 1;
  double max_loss_scale = std::numeric_limits<double>::infinity();
  double grad_scale = 0;  // 0: bmt::config().tp_zero_size (data-parallel size), 1 before init_distributed
};

class OptimManager {
 public:
  explicit OptimManager(const OptimManagerOptions& options = {});

  void add_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                     std::shared_ptr<lr_scheduler::WarmupLRScheduler> lr_scheduler = nullptr);

  void zero_grad();
  at::Tensor scale_loss(const at::Tensor& loss) const;
  void backward(const at::Tensor& loss);
  // Returns false when the step was skipped because a gradient was inf/NaN on some rank. With the offload overlap
  // on, an inf/NaN after some Blocks were already updated early throws bmt::core::Error instead (see below).
  bool step();
  // Starts each Block's update by this manager's AdamOffloadOptimizers as soon as the Block's gradients are
  // reduced, during the rest of the backward (offload_overlap.h), for the Blocks whose parameters they hold. Each
  // early start first checks the Block's gradients for inf/NaN (agreed over the Block's communicators) and leaves a
  // non-finite Block to step(). Refused (bmt::core::Error) with dynamic loss scaling, whose skipped steps would
  // follow early updates that cannot be undone, when no AdamOffloadOptimizer was added, or while another handle of
  // this manager is active. The returned handle undoes it (remove() or its destructor).
  OffloadOverlap overlap_offload_with_backward();
  // The same for every Adam of this manager: AdamOffloadOptimizers as above, and AdamOptimizers (state on the GPU)
  // whose Block updates are queued right after the Block's gradient reduction, without a host wait (the inf/NaN
  // check of those Blocks is folded into step()'s one check; an inf/NaN found there after early updates throws,
  // as above). With release_gradients, a Block updated wholly early frees its gradient shards until its next
  // backward: the gradients of the whole model are never held at once (the fp32 gradient bytes of a step drop to
  // those of the Blocks in flight plus the parameters outside Blocks). Gradient clipping needs every gradient
  // before any update, so clip_grad_norm() is refused after early updates. Refused with dynamic loss scaling,
  // when no Adam optimizer was added, or while another handle is active.
  OffloadOverlap overlap_step_with_backward(bool release_gradients = true);
  double clip_grad_norm(double max_norm, double norm_type = 2.0, double eps = 1e-6);
  // The same over an explicit parameter list (BMTrain's clip_grad_norm(param_groups, ...)).
  double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double norm_type = 2.0,
                        double eps = 1e-6);

  StateDict state_dict() const;
  // state_dict() whose optimizer tensors may alias the live state (BmtOptimizer::state_dict_views).
  StateDict state_dict_views() const;
  void load_state_dict(const StateDict& sd);
  // Sets the loss-scale state alone (BMTrain's OptimManager.load_state_dict format keeps the optimizers' states
  // apart): scale > 0 and within [min_loss_scale, max_loss_scale] when enabled; disabled means scale 1.
  void set_loss_scale_state(double loss_scale, bool enabled, int64_t steps_since_last_scale);

  double loss_scale() const { return loss_scale_; }
  bool loss_scale_enabled() const { return loss_scale_enabled_; }
  int64_t steps_since_last_scale() const { return steps_since_last_scale_; }
  double loss_scale_factor() const { return options_.loss_scale_factor; }
  int64_t loss_scale_steps() const { return options_.loss_scale_steps; }
  double min_loss_scale() const { return options_.min_loss_scale; }
  double max_loss_scale() const { return options_.max_loss_scale; }
  double grad_scale() const { return grad_scale_; }
  int64_t num_skipped_steps() const { return num_skipped_steps_; }
  const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers() const { return optimizers_; }
  const std::vector<std::shared_ptr<lr_scheduler::WarmupLRScheduler>>& lr_schedulers() const { return schedulers_; }

 private:
  StateDict state_dict_impl(bool views) const;
  std::vector<at::Tensor> all_params() const;
  void set_scale(double new_scale, const char* why);
  // The active overlap's state, or nullptr.
  std::shared_ptr<detail::OffloadOverlapState> active_overlap() const;

  OptimManagerOptions options_;
  double loss_scale_ = 1;
  bool loss_scale_enabled_ = false;
  int64_t steps_since_last_scale_ = 0;
  int64_t num_skipped_steps_ = 0;
  double grad_scale_ = 1;
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers_;
  std::vector<std::shared_ptr<lr_scheduler::WarmupLRScheduler>> schedulers_;
  std::weak_ptr<detail::OffloadOverlapState> overlap_;  // owned by the OffloadOverlap handle
};

}  // namespace bmt::optim
