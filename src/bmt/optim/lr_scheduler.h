// bmt::optim::lr_scheduler: BMTrain's warm-up learning-rate schedules (WarmupLRScheduler and its subclasses),
// with BMTrain's edge bugs fixed. t = num_iter (updates done so far), W = warmup_iter, E = end_iter, S = start_lr:
//
//   warm-up (t < W), all but Noam:   S * (t + 1) / W          (the first update already uses S / W, never 0)
//   NoDecay      t >= W:  S
//   Noam         t <  W:  S / sqrt(W) * (t + 1) / W;  t >= W:  S / sqrt(max(t, 1))   (no division by zero at W = 0)
//   Linear       t >= W:  S * (E - t) / (E - W) for t < E, 0 from E on                 (requires E >= W)
//   Cosine       t >= W:  S * 0.5 * (1 + cos(pi * min(1, (t - W) / (E - W)))), 0 from E on (requires E >= W)
//   Exponential  t >= W:  S * gamma^(t - W)
//
// Invariants: the constructor applies lr(num_iter) to the optimizer at once; step() advances num_iter by one and
// applies lr(num_iter); the lr is written into every param group of the optimizer (or, with
// keep_group_ratios(true), group k gets lr * initial_lr_k / initial_lr_0). state_dict() holds only num_iter
// ("num_iter"); load_state_dict re-applies the lr. Bad arguments throw bmt::core::Error.
//
// Custom schedules: derive from WarmupLRScheduler, override get_lr_decay (and optionally get_lr_warmup), and call
// step(num_iter) at the end of the derived constructor (virtual calls do not reach the derived class from the base
// constructor).
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "bmt/optim/flat_state_dict.h"

namespace bmt::optim::lr_scheduler {

class WarmupLRScheduler {
 public:
  WarmupLRScheduler(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter,
                    int64_t end_iter, int64_t num_iter = 0);
  virtual ~WarmupLRScheduler() = default;

  // The learning rate of update number t (0-based): get_lr_warmup(t) for t < warmup_iter, else get_lr_decay(t).
  double lr_at(int64_t t) const;
  double get_lr() const { return lr_at(num_iter_); }
  double current_lr() const { return current_lr_; }
  int64_t num_iter() const { return num_iter_; }
  double start_lr() const { return start_lr_; }
  int64_t warmup_iter() const { return warmup_iter_; }
  int64_t end_iter() const { return end_iter_; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }

  void step();                  // num_iter + 1
  void step(int64_t num_iter);  // jump to num_iter (>= 0)

  // Group k's lr = lr * (its lr at construction) / (group 0's lr at construction). Off by default (BMTrain).
  WarmupLRScheduler& keep_group_ratios(bool on);
  // BMTrain's warm-up, S * t / W (the first update uses lr 0), instead of S * (t + 1) / W. Off by default; the
  // Python package turns it on to behave as BMTrain does. Not saved in state_dict.
  WarmupLRScheduler& warmup_from_zero(bool on);
  bool warmup_from_zero() const { return warmup_offset_ == 0; }

  StateDict state_dict() const;
  void load_state_dict(const StateDict& sd);

 protected:
  virtual double get_lr_warmup(int64_t t) const;
  virtual double get_lr_decay(int64_t t) const = 0;
  void require_end_after_warmup(const char* cls) const;

  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  double start_lr_;
  int64_t warmup_iter_, end_iter_;
  int64_t num_iter_ = 0;
  double current_lr_ = 0.0;
  int64_t warmup_offset_ = 1;  // t + warmup_offset_ in the warm-up formulas (0: BMTrain's)

 private:
  void apply_lr();
  bool keep_group_ratios_ = false;
  std::vector<double> initial_group_lrs_;
};

class NoDecay : public WarmupLRScheduler {
 public:
  NoDecay(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter, int64_t end_iter,
          int64_t num_iter = 0);

 protected:
  double get_lr_decay(int64_t t) const override;
};

class Noam : public WarmupLRScheduler {
 public:
  Noam(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter, int64_t end_iter,
       int64_t num_iter = 0);

 protected:
  double get_lr_warmup(int64_t t) const override;
  double get_lr_decay(int64_t t) const override;
};

class Linear : public WarmupLRScheduler {
 public:
  Linear(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter, int64_t end_iter,
         int64_t num_iter = 0);

 protected:
  double get_lr_decay(int64_t t) const override;
};

class Cosine : public WarmupLRScheduler {
 public:
  Cosine(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter, int64_t end_iter,
         int64_t num_iter = 0);

 protected:
  double get_lr_decay(int64_t t) const override;
};

class Exponential : public WarmupLRScheduler {
 public:
  Exponential(std::shared_ptr<torch::optim::Optimizer> optimizer, double start_lr, int64_t warmup_iter,
              int64_t end_iter, int64_t num_iter = 0, double gamma = 0.95);
  double gamma() const { return gamma_; }

 protected:
  double get_lr_decay(int64_t t) const override;

 private:
  double gamma_;
};

}  // namespace bmt::optim::lr_scheduler
