#include "bmt/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>

#include "bmt/core/error.h"

namespace bmt::optim::lr_scheduler {

WarmupLRScheduler::WarmupLRScheduler(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr,
                                     int64_t warmup_iter, int64_t end_iter, int64_t num_iter)
    : optimizer_(std::move(optimizer)),
      start_lr_(start_lr),
      warmup_iter_(warmup_iter),
      end_iter_(end_iter),
      num_iter_(num_iter) {
  BMT_CHECK(optimizer_ != nullptr, "lr_scheduler: the optimizer is null");
  BMT_CHECK(std::isfinite(start_lr) && start_lr >= 0, "lr_scheduler: start_lr must be a finite number >= 0, got ",
            start_lr);
  BMT_CHECK(warmup_iter >= 0, "lr_scheduler: warmup_iter must be >= 0, got ", warmup_iter);
  BMT_CHECK(end_iter >= 0, "lr_scheduler: end_iter must be >= 0, got ", end_iter);
  BMT_CHECK(num_iter >= 0, "lr_scheduler: num_iter must be >= 0, got ", num_iter);
  for (const auto& group : optimizer_->param_groups())
    initial_group_lrs_.push_back(group.has_options() ? group.options().get_lr() : optimizer_->defaults().get_lr());
}

void WarmupLRScheduler::require_end_after_warmup(const char* cls) const {
  BMT_CHECK(end_iter_ >= warmup_iter_, "lr_scheduler::", cls, ": end_iter (", end_iter_,
            ") must be >= warmup_iter (", warmup_iter_, ")");
}

double WarmupLRScheduler::lr_at(int64_t t) const {
  BMT_CHECK(t >= 0, "lr_scheduler: iteration must be >= 0, got ", t);
  return t < warmup_iter_ ? get_lr_warmup(t) : get_lr_decay(t);
}

double WarmupLRScheduler::get_lr_warmup(int64_t t) const {
  return start_lr_ * static_cast<double>(t + warmup_offset_) / static_cast<double>(warmup_iter_);
}

void WarmupLRScheduler::step() { step(num_iter_ + 1); }

WarmupLRScheduler& WarmupLRScheduler::warmup_from_zero(bool on) {
  warmup_offset_ = on ? 0 : 1;
  step(num_iter_);  // re-apply the lr of the current iteration
  return *this;
}

void WarmupLRScheduler::step(int64_t num_iter) {
  BMT_CHECK(num_iter >= 0, "lr_scheduler: num_iter must be >= 0, got ", num_iter);
  num_iter_ = num_iter;
  apply_lr();
}

WarmupLRScheduler& WarmupLRScheduler::keep_group_ratios(bool on) {
  if (on) {
    BMT_CHECK(!initial_group_lrs_.empty() && initial_group_lrs_[0] > 0,
              "lr_scheduler: keep_group_ratios needs a first param group with lr > 0");
  }
  keep_group_ratios_ = on;
  apply_lr();
  return *this;
}

void WarmupLRScheduler::apply_lr() {
  current_lr_ = lr_at(num_iter_);
  auto& groups = optimizer_->param_groups();
  for (size_t k = 0; k < groups.size(); ++k) {
    double lr = current_lr_;
    if (keep_group_ratios_ && k < initial_group_lrs_.size()) lr *= initial_group_lrs_[k] / initial_group_lrs_[0];
    if (groups[k].has_options()) groups[k].options().set_lr(lr);
  }
}

StateDict WarmupLRScheduler::state_dict() const { return {{"num_iter", int_entry(num_iter_)}}; }

void WarmupLRScheduler::load_state_dict(const StateDict& sd) { step(get_int(sd, "num_iter", "lr_scheduler")); }

NoDecay::NoDecay(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter,
                 int64_t end_iter, int64_t num_iter)
    : WarmupLRScheduler(std::move(optimizer), start_lr, warmup_iter, end_iter, num_iter) {
  step(num_iter_);
}
double NoDecay::get_lr_decay(int64_t) const { return start_lr_; }

Noam::Noam(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter, int64_t end_iter,
           int64_t num_iter)
    : WarmupLRScheduler(std::move(optimizer), start_lr, warmup_iter, end_iter, num_iter) {
  step(num_iter_);
}
double Noam::get_lr_warmup(int64_t t) const {
  double w = static_cast<double>(warmup_iter_);
  return start_lr_ / std::sqrt(w) * static_cast<double>(t + warmup_offset_) / w;
}
double Noam::get_lr_decay(int64_t t) const {
  return start_lr_ / std::sqrt(static_cast<double>(std::max<int64_t>(t, 1)));
}

Linear::Linear(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter,
               int64_t end_iter, int64_t num_iter)
    : WarmupLRScheduler(std::move(optimizer), start_lr, warmup_iter, end_iter, num_iter) {
  require_end_after_warmup("Linear");
  step(num_iter_);
}
double Linear::get_lr_decay(int64_t t) const {
  if (t >= end_iter_) return 0.0;
  return start_lr_ * static_cast<double>(end_iter_ - t) / static_cast<double>(end_iter_ - warmup_iter_);
}

Cosine::Cosine(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter,
               int64_t end_iter, int64_t num_iter)
    : WarmupLRScheduler(std::move(optimizer), start_lr, warmup_iter, end_iter, num_iter) {
  require_end_after_warmup("Cosine");
  step(num_iter_);
}
double Cosine::get_lr_decay(int64_t t) const {
  if (t >= end_iter_) return 0.0;
  double progress = static_cast<double>(t - warmup_iter_) / static_cast<double>(end_iter_ - warmup_iter_);
  return start_lr_ * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

Exponential::Exponential(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter,
                         int64_t end_iter, int64_t num_iter, double gamma)
    : WarmupLRScheduler(std::move(optimizer), start_lr, warmup_iter, end_iter, num_iter), gamma_(gamma) {
  BMT_CHECK(std::isfinite(gamma) && gamma > 0, "lr_scheduler::Exponential: gamma must be > 0, got ", gamma);
  step(num_iter_);
}
double Exponential::get_lr_decay(int64_t t) const {
  return start_lr_ * std::pow(gamma_, static_cast<double>(t - warmup_iter_));
}

}  // namespace bmt::optim::lr_scheduler
