#include "bmt/optim/optim_manager.h"

#include <ATen/core/grad_mode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <iostream>
#include <sstream>
#include <unordered_set>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/grad_utils.h"
#include "bmt/optim/offload_overlap_internal.h"
#include "bmt/optim/optimizer.h"
#include "bmt/params/param_meta.h"
#include "bmt/runtime/stream_sync.h"

namespace bmt::optim {
namespace {

core::Communicator* world_comm() { return is_initialized() ? config().comm.get() : nullptr; }

void print_once(const std::string& msg) {
  if (!is_initialized() || rank() == 0) std::cout << msg << std::endl;
}

std::vector<at::Tensor> params_of(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& group : opt.param_groups())
    for (const auto& p : group.params()) out.push_back(p);
  return out;
}

}  // namespace

OptimManager::OptimManager(const OptimManagerOptions& options) : options_(options) {
  auto& o = options_;
  BMT_CHECK(std::isfinite(o.loss_scale) && o.loss_scale >= 0, "OptimManager: loss_scale must be >= 0 (0 disables ",
            "loss scaling), got ", o.loss_scale);
  BMT_CHECK(std::isfinite(o.loss_scale_factor) && o.loss_scale_factor > 0,
            "OptimManager: loss_scale_factor must be > 0, got ", o.loss_scale_factor);
  if (o.loss_scale_factor < 1) o.loss_scale_factor = 1.0 / o.loss_scale_factor;  // BMTrain inverts it
  BMT_CHECK(o.loss_scale_steps >= 1, "OptimManager: loss_scale_steps must be >= 1, got ", o.loss_scale_steps);
  BMT_CHECK(std::isfinite(o.min_loss_scale) && o.min_loss_scale > 0, "OptimManager: min_loss_scale must be > 0, got ",
            o.min_loss_scale);
  BMT_CHECK(o.max_loss_scale >= o.min_loss_scale, "OptimManager: max_loss_scale (", o.max_loss_scale,
            ") must be >= min_loss_scale (", o.min_loss_scale, ")");
  BMT_CHECK(std::isfinite(o.grad_scale) && o.grad_scale >= 0, "OptimManager: grad_scale must be > 0 (or 0 for the ",
            "default), got ", o.grad_scale);
  loss_scale_enabled_ = o.loss_scale > 0;
  if (loss_scale_enabled_) {
    BMT_CHECK(o.loss_scale >= o.min_loss_scale && o.loss_scale <= o.max_loss_scale, "OptimManager: loss_scale ",
              o.loss_scale, " is outside [min_loss_scale, max_loss_scale] = [", o.min_loss_scale, ", ",
              o.max_loss_scale, "]");
    loss_scale_ = o.loss_scale;
  }
  grad_scale_ = o.grad_scale > 0 ? o.grad_scale : (is_initialized() ? static_cast<double>(config().tp_zero_size) : 1.0);
}

void OptimManager::add_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                 std::shared_ptr<lr_scheduler::WarmupLRScheduler> lr_scheduler) {
  BMT_CHECK(optimizer != nullptr, "OptimManager::add_optimizer: the optimizer is null");
  for (const auto& o : optimizers_)
    BMT_CHECK(o.get() != optimizer.get(), "OptimManager::add_optimizer: this optimizer was already added");
  if (lr_scheduler)
    BMT_CHECK(&lr_scheduler->optimizer() == optimizer.get(),
              "OptimManager::add_optimizer: the LR scheduler drives a different optimizer");
  optimizers_.push_back(std::move(optimizer));
  schedulers_.push_back(std::move(lr_scheduler));
}

std::vector<at::Tensor> OptimManager::all_params() const {
  std::vector<at::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& opt : optimizers_)
    for (const auto& p : params_of(*opt))
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

std::shared_ptr<detail::OffloadOverlapState> OptimManager::active_overlap() const {
  auto state = overlap_.lock();
  return state && state->installed() ? state : nullptr;
}

OffloadOverlap OptimManager::overlap_offload_with_backward() {
  BMT_CHECK(!loss_scale_enabled_, "OptimManager::overlap_offload_with_backward: dynamic loss scaling is on (loss "
            "scale ", loss_scale_, "); it skips steps on overflow, but a Block updated early cannot be un-updated. "
            "Train without the overlap, or without loss scaling (bf16 / fp32: OptimManagerOptions::loss_scale = 0)");
  BMT_CHECK(active_overlap() == nullptr, "OptimManager::overlap_offload_with_backward: the overlap is already on "
            "for this manager; remove() the first handle before asking again");
  std::vector<std::shared_ptr<AdamOffloadOptimizer>> offload;
  for (const auto& opt : optimizers_)
    if (auto o = std::dynamic_pointer_cast<AdamOffloadOptimizer>(opt)) offload.push_back(std::move(o));
  BMT_CHECK(!offload.empty(), "OptimManager::overlap_offload_with_backward: no AdamOffloadOptimizer was added to "
            "this manager (add_optimizer it first); other optimizers update in step()");
  auto state = std::make_shared<detail::OffloadOverlapState>(std::move(offload));
  state->install();
  overlap_ = state;
  return OffloadOverlap(std::move(state));
}

OffloadOverlap OptimManager::overlap_step_with_backward(bool release_gradients) {
  BMT_CHECK(!loss_scale_enabled_, "OptimManager::overlap_step_with_backward: dynamic loss scaling is on (loss scale ",
            loss_scale_, "); it skips steps on overflow, but a Block updated early cannot be un-updated. Train "
            "without the overlap, or without loss scaling (bf16 / fp32: OptimManagerOptions::loss_scale = 0)");
  BMT_CHECK(active_overlap() == nullptr, "OptimManager::overlap_step_with_backward: an overlap is already on for "
            "this manager; remove() the first handle before asking again");
  std::vector<std::shared_ptr<AdamOffloadOptimizer>> offload;
  std::vector<std::shared_ptr<AdamOptimizer>> device;
  for (const auto& opt : optimizers_) {
    if (auto o = std::dynamic_pointer_cast<AdamOffloadOptimizer>(opt)) offload.push_back(std::move(o));
    else if (auto d = std::dynamic_pointer_cast<AdamOptimizer>(opt)) device.push_back(std::move(d));
  }
  BMT_CHECK(!offload.empty() || !device.empty(), "OptimManager::overlap_step_with_backward: no AdamOptimizer or "
            "AdamOffloadOptimizer was added to this manager (add_optimizer it first); other optimizers update in step()");
  auto state = std::make_shared<detail::OffloadOverlapState>(std::move(offload), std::move(device), release_gradients);
  state->install();
  overlap_ = state;
  return OffloadOverlap(std::move(state));
}

void OptimManager::zero_grad() {
  if (is_initialized()) wait_for_gradient_reduction();
  if (auto overlap = overlap_.lock()) overlap->end_iteration();
  for (const auto& opt : optimizers_) {
    if (auto* bmt_opt = dynamic_cast<BmtOptimizer*>(opt.get())) {
      bmt_opt->zero_grad(/*set_to_none=*/false);
    } else {
      // In place, as Python's Optimizer.zero_grad(set_to_none=False): a Block's gradients are views of its shard
      // buffer, which torch::optim::Optimizer::zero_grad would detach_() (refused for views).
      at::NoGradGuard no_grad;
      for (const auto& p : params_of(*opt)) {
        if (!p.grad().defined()) continue;
        if (p.grad().requires_grad()) p.mutable_grad() = p.grad().detach();
        p.mutable_grad().zero_();
      }
    }
  }
}

at::Tensor OptimManager::scale_loss(const at::Tensor& loss) const { return loss * (loss_scale_ / grad_scale_); }

void OptimManager::backward(const at::Tensor& loss) {
  scale_loss(loss).backward();
  wait_for_gradient_reduction();  // the last Blocks' reductions are still on the comm stream
}

void OptimManager::set_scale(double new_scale, const char* why) {
  if (new_scale == loss_scale_) return;
  print_once(core::concat(why, ", change scale from ", loss_scale_, " to ", new_scale));
  loss_scale_ = new_scale;
}

bool OptimManager::step() {
  if (is_initialized()) wait_for_gradient_reduction();
  std::vector<at::Tensor> params = all_params();
  std::shared_ptr<detail::OffloadOverlapState> overlap = overlap_.lock();
  BMT_CHECK(!(overlap && overlap->installed() && loss_scale_enabled_), "OptimManager::step: dynamic loss scaling "
            "was turned on (load_state_dict?) while the offload overlap is on; remove the OffloadOverlap handle or "
            "load a state without loss scaling");
  const bool early_nonfinite = overlap != nullptr && overlap->take_local_nonfinite();
  const at::Tensor flag = inf_nan_flag(params, std::vector<core::Communicator*>{world_comm()}, early_nonfinite);
  // Every optimizer a GPU AdamOptimizer (no overlap): queue the updates behind the verdict on the device before the
  // host reads it, so the GPU does not idle while the host prepares them after the read (the kernels skip
  // themselves on inf/NaN; the host takes the step counts back below). Same results as updating after the read.
  std::vector<AdamOptimizer*> queued;
  bool queue_first = overlap == nullptr && flag.is_cuda() && !optimizers_.empty();
  for (const auto& p : params) queue_first = queue_first && p.is_cuda();
  for (const auto& opt : optimizers_) {
    auto* adam = dynamic_cast<AdamOptimizer*>(opt.get());
    queue_first = queue_first && adam != nullptr;
    if (adam) queued.push_back(adam);
  }
  if (queue_first) {
    const at::Tensor skip = flag.to(at::kInt);
    for (AdamOptimizer* adam : queued) adam->step_unless(loss_scale_, skip);
  }
  if (flag.item<float>() != 0.0f) {
    if (queue_first)
      for (AdamOptimizer* adam : queued) adam->undo_skipped_step();
    if (overlap && !overlap->early_blocks().empty()) {
      const std::vector<std::string> early = overlap->early_blocks();
      const std::vector<std::string> held = overlap->nonfinite_blocks();
      ++num_skipped_steps_;
      zero_grad();  // ends the optimizers' iteration (waits for the early updates) and the overlap's record
      std::string early_list, held_list;
      for (const auto& b : early) early_list += " " + b;
      for (const auto& b : held) held_list += " " + b;
      BMT_ERROR("OptimManager::step: gradients contain inf/NaN, but ", early.size(), " Block(s) were already "
                "updated during the backward by overlap_offload_with_backward() (Blocks in backward order:",
                early_list, ")", held.empty() ? std::string() : core::concat("; withheld for inf/NaN:", held_list),
                ". An Adam update cannot be undone, so the model now holds half a step: the run has diverged. "
                "Restart from the last checkpoint (lower the learning rate, check the data), or train without the "
                "overlap (remove the OffloadOverlap handle) to have such steps skipped");
    }
    ++num_skipped_steps_;
    steps_since_last_scale_ = 0;
    if (loss_scale_enabled_ && loss_scale_ > options_.min_loss_scale) {
      set_scale(std::max(options_.min_loss_scale, loss_scale_ / options_.loss_scale_factor), "Gradient overflow");
    } else {
      print_once(loss_scale_enabled_ ? core::concat("Gradient overflow at the minimum loss scale ", loss_scale_,
                                                    "; step skipped")
                                     : std::string("Gradient contains inf/NaN (loss scaling disabled); step skipped"));
    }
    zero_grad();
    return false;
  }
  for (const auto& opt : optimizers_) {
    if (queue_first) break;  // already queued
    if (auto* bmt_opt = dynamic_cast<BmtOptimizer*>(opt.get())) {
      bmt_opt->step(loss_scale_);
    } else {
      if (loss_scale_ != 1.0) {
        at::NoGradGuard no_grad;
        for (const auto& p : params_of(*opt))
          if (p.grad().defined()) p.mutable_grad().div_(loss_scale_);
      }
      opt->step();
    }
  }
  if (overlap) overlap->end_iteration();
  for (const auto& sched : schedulers_)
    if (sched) sched->step();
  if (loss_scale_enabled_) {
    ++steps_since_last_scale_;
    if (steps_since_last_scale_ >= options_.loss_scale_steps && loss_scale_ < options_.max_loss_scale) {
      set_scale(std::min(options_.max_loss_scale, loss_scale_ * options_.loss_scale_factor),
                core::concat(options_.loss_scale_steps, " steps without overflow").c_str());
      steps_since_last_scale_ = 0;
    }
  }
  return true;
}

void OptimManager::set_loss_scale_state(double loss_scale, bool enabled, int64_t steps_since_last_scale) {
  BMT_CHECK(steps_since_last_scale >= 0, "OptimManager: steps_since_last_scale must be >= 0, got ",
            steps_since_last_scale);
  if (enabled) {
    BMT_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "OptimManager: loss_scale must be a finite number > 0, got ",
              loss_scale);
    BMT_CHECK(loss_scale >= options_.min_loss_scale && loss_scale <= options_.max_loss_scale, "OptimManager: loss_scale ",
              loss_scale, " is outside [min_loss_scale, max_loss_scale] = [", options_.min_loss_scale, ", ",
              options_.max_loss_scale, "]");
    BMT_CHECK(!active_overlap(), "OptimManager: cannot turn dynamic loss scaling on while an overlap handle is "
              "active (its early updates cannot be skipped); remove the handle first");
  }
  loss_scale_enabled_ = enabled;
  loss_scale_ = enabled ? loss_scale : 1.0;
  steps_since_last_scale_ = steps_since_last_scale;
}

double OptimManager::clip_grad_norm(double max_norm, double norm_type, double eps) {
  return clip_grad_norm(all_params(), max_norm, norm_type, eps);
}

double OptimManager::clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                                    double eps) {
  BMT_CHECK(std::isfinite(max_norm) && max_norm > 0, "clip_grad_norm: max_norm must be > 0, got ", max_norm);
  BMT_CHECK(std::isfinite(eps) && eps >= 0, "clip_grad_norm: eps must be >= 0, got ", eps);
  if (auto overlap = overlap_.lock())
    BMT_CHECK(overlap->early_blocks().empty(), "clip_grad_norm: ", overlap->early_blocks().size(), " Block(s) were "
              "already updated during this backward (overlap_step_with_backward / overlap_offload_with_backward), "
              "but clipping needs the norm of every gradient before any update. Remove the overlap handle to clip");
  // Gradients carry loss_scale / grad_scale relative to d(loss)/d(p) * (1 / grad_scale); the optimizer divides by
  // loss_scale only, so the unscaled norm is norm / loss_scale.
  double total = global_grad_norm(params, norm_type, world_comm()) / loss_scale_;
  if (!std::isfinite(total)) return total;
  double clip_coef = max_norm / (total + eps);
  if (clip_coef < 1.0) scale_grads(params, clip_coef);
  return total;
}

StateDict OptimManager::state_dict() const { return state_dict_impl(/*views=*/false); }
StateDict OptimManager::state_dict_views() const { return state_dict_impl(/*views=*/true); }

StateDict OptimManager::state_dict_impl(bool views) const {
  StateDict sd;
  sd["loss_scale"] = scalar_entry(loss_scale_);
  sd["loss_scale_enabled"] = int_entry(loss_scale_enabled_ ? 1 : 0);
  sd["steps_since_last_scale"] = int_entry(steps_since_last_scale_);
  sd["num_optimizers"] = int_entry(static_cast<int64_t>(optimizers_.size()));
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    std::string prefix = core::concat("optimizers.", k, ".");
    if (auto* bmt_opt = dynamic_cast<const BmtOptimizer*>(optimizers_[k].get())) {
      put_prefixed(sd, prefix, views ? bmt_opt->state_dict_views() : bmt_opt->state_dict());
    } else {
      torch::serialize::OutputArchive archive;
      optimizers_[k]->save(archive);
      std::ostringstream os;
      archive.save_to(os);
      sd[prefix + "torch_archive"] = bytes_to_tensor(os.str());
      std::vector<at::Tensor> params = params_of(*optimizers_[k]);
      sd[prefix + "num_params"] = int_entry(static_cast<int64_t>(params.size()));
      for (size_t i = 0; i < params.size(); ++i)
        sd[core::concat(prefix, "param.", i, ".shape")] = at::tensor(params[i].sizes().vec(), at::kLong);
    }
    if (schedulers_[k]) put_prefixed(sd, core::concat("lr_schedulers.", k, "."), schedulers_[k]->state_dict());
  }
  return sd;
}

void OptimManager::load_state_dict(const StateDict& sd) {
  const char* what = "OptimManager";
  int64_t n = get_int(sd, "num_optimizers", what);
  BMT_CHECK(n == static_cast<int64_t>(optimizers_.size()), "load_state_dict of OptimManager: the state dict has ", n,
            " optimizers but this manager has ", optimizers_.size());
  // Check everything that can be checked before changing anything.
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    std::string prefix = core::concat("optimizers.", k, ".");
    bool has_sched = !get_prefixed(sd, core::concat("lr_schedulers.", k, ".")).empty();
    BMT_CHECK(has_sched == (schedulers_[k] != nullptr), "load_state_dict of OptimManager: optimizer ", k,
              has_sched ? " has no LR scheduler but the state dict has one" : " has an LR scheduler but the state dict has none");
    if (dynamic_cast<BmtOptimizer*>(optimizers_[k].get()) == nullptr) {
      std::vector<at::Tensor> params = params_of(*optimizers_[k]);
      BMT_CHECK(get_int(sd, prefix + "num_params", what) == static_cast<int64_t>(params.size()),
                "load_state_dict of OptimManager: optimizer ", k, " has ", params.size(),
                " parameters but the state dict a different number (a different model?)");
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor shape = get_entry(sd, core::concat(prefix, "param.", i, ".shape"), what).to(at::kLong).contiguous();
        at::IntArrayRef saved(shape.data_ptr<int64_t>(), static_cast<size_t>(shape.numel()));
        BMT_CHECK(saved == params[i].sizes(), "load_state_dict of OptimManager: optimizer ", k, " parameter ", i,
                  " has shape ", params[i].sizes(), " but the state dict has ", saved, " (a different model?)");
      }
      get_entry(sd, prefix + "torch_archive", what);
    }
  }
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    std::string prefix = core::concat("optimizers.", k, ".");
    if (auto* bmt_opt = dynamic_cast<BmtOptimizer*>(optimizers_[k].get())) {
      bmt_opt->load_state_dict(get_prefixed(sd, prefix));
    } else {
      std::istringstream is(tensor_to_bytes(get_entry(sd, prefix + "torch_archive", what)));
      torch::serialize::InputArchive archive;
      archive.load_from(is);
      optimizers_[k]->load(archive);
    }
    if (schedulers_[k]) schedulers_[k]->load_state_dict(get_prefixed(sd, core::concat("lr_schedulers.", k, ".")));
  }
  loss_scale_enabled_ = get_int(sd, "loss_scale_enabled", what) != 0;
  loss_scale_ = get_double(sd, "loss_scale", what);
  steps_since_last_scale_ = get_int(sd, "steps_since_last_scale", what);
  BMT_CHECK(std::isfinite(loss_scale_) && loss_scale_ > 0, "load_state_dict of OptimManager: bad loss_scale ",
            loss_scale_);
}

}  // namespace bmt::optim
