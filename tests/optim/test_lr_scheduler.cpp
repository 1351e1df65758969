// LR schedulers against closed forms, including warmup 0, step 0 and steps after end_iter.
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cmath>

#include "bmt/core/error.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/lr_scheduler.h"

namespace ls = bmt::optim::lr_scheduler;
using bmt::optim::AdamOptimizer;
using bmt::optim::AdamOptions;

namespace {

std::shared_ptr<AdamOptimizer> make_opt() {
  std::vector<bmt::optim::ParamGroupSpec> groups = {{{at::zeros({2}).requires_grad_(true)}, {{"lr", 1.0}}},
                                                    {{at::zeros({3}).requires_grad_(true)}, {{"lr", 0.1}}}};
  return std::make_shared<AdamOptimizer>(groups, AdamOptions(123.0));
}

double group_lr(const torch::optim::Optimizer& opt, size_t g) { return opt.param_groups()[g].options().get_lr(); }

}  // namespace

TEST(LRScheduler, NoDecayWarmsUpFromTheFirstStep) {
  auto opt = make_opt();
  ls::NoDecay s(opt, 1.0, 10, 100);
  EXPECT_DOUBLE_EQ(s.current_lr(), 0.1);  // update 0 uses lr * 1 / 10, not 0
  EXPECT_DOUBLE_EQ(group_lr(*opt, 0), 0.1);
  EXPECT_DOUBLE_EQ(group_lr(*opt, 1), 0.1);  // BMTrain: one lr for every group
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(100000), 1.0);
  ls::NoDecay no_warmup(opt, 2.0, 0, 100);
  EXPECT_DOUBLE_EQ(no_warmup.current_lr(), 2.0);
}

TEST(LRScheduler, NoamHasNoDivisionByZero) {
  auto opt = make_opt();
  ls::Noam s0(opt, 1.0, 0, 0);
  EXPECT_DOUBLE_EQ(s0.lr_at(0), 1.0);
  EXPECT_DOUBLE_EQ(s0.lr_at(1), 1.0);
  EXPECT_DOUBLE_EQ(s0.lr_at(4), 0.5);
  ls::Noam s(opt, 1.0, 4, 100);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.5 * 0.25);
  EXPECT_DOUBLE_EQ(s.lr_at(3), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(16), 0.25);
}

TEST(LRScheduler, LinearDecaysToZeroAndStaysThere) {
  auto opt = make_opt();
  ls::Linear s(opt, 1.0, 10, 110);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(60), 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(109), 0.01);
  EXPECT_DOUBLE_EQ(s.lr_at(110), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(1000), 0.0);
  ls::Linear w0(opt, 2.0, 0, 4);
  EXPECT_DOUBLE_EQ(w0.lr_at(0), 2.0);
  EXPECT_DOUBLE_EQ(w0.lr_at(3), 0.5);
}

TEST(LRScheduler, CosineIsClampedAfterEndIter) {
  auto opt = make_opt();
  ls::Cosine s(opt, 1.0, 10, 110);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);
  EXPECT_NEAR(s.lr_at(35), 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-15);
  EXPECT_NEAR(s.lr_at(60), 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(s.lr_at(110), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(200), 0.0);  // BMTrain's rises again here
  ls::Cosine degenerate(opt, 1.0, 0, 0);
  EXPECT_DOUBLE_EQ(degenerate.lr_at(0), 0.0);
}

TEST(LRScheduler, Exponential) {
  auto opt = make_opt();
  ls::Exponential s(opt, 1.0, 10, 0, 0, 0.5);
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1.0);
  EXPECT_DOUBLE_EQ(s.lr_at(12), 0.25);
  ls::Exponential d(opt, 3.0, 0, 0);
  EXPECT_DOUBLE_EQ(d.lr_at(2), 3.0 * 0.95 * 0.95);
}

TEST(LRScheduler, StepWritesGroupsAndStateRoundTrips) {
  auto opt = make_opt();
  ls::Linear s(opt, 1.0, 2, 12);
  for (int i = 0; i < 5; ++i) s.step();
  EXPECT_EQ(s.num_iter(), 5);
  EXPECT_DOUBLE_EQ(group_lr(*opt, 0), 0.7);
  EXPECT_DOUBLE_EQ(group_lr(*opt, 1), 0.7);
  auto sd = s.state_dict();
  EXPECT_EQ(sd.size(), 1u);
  auto opt2 = make_opt();
  ls::Linear s2(opt2, 1.0, 2, 12);
  s2.load_state_dict(sd);
  EXPECT_EQ(s2.num_iter(), 5);
  EXPECT_DOUBLE_EQ(group_lr(*opt2, 0), 0.7);
  s.step(0);
  EXPECT_DOUBLE_EQ(group_lr(*opt, 0), 0.5);
  EXPECT_THROW(s2.load_state_dict({}), bmt::core::Error);
}

TEST(LRScheduler, KeepGroupRatios) {
  auto opt = make_opt();
  ls::NoDecay s(opt, 2.0, 0, 0);
  s.keep_group_ratios(true);
  EXPECT_DOUBLE_EQ(group_lr(*opt, 0), 2.0);
  EXPECT_DOUBLE_EQ(group_lr(*opt, 1), 0.2);
}

TEST(LRScheduler, DrivesTorchOptimizers) {
  std::vector<at::Tensor> ps = {at::zeros({2}).requires_grad_(true)};
  auto opt = std::make_shared<torch::optim::AdamW>(ps, torch::optim::AdamWOptions(1.0));
  ls::Cosine s(opt, 0.5, 0, 10);
  s.step();
  EXPECT_NEAR(opt->param_groups()[0].options().get_lr(), 0.25 * (1 + std::cos(M_PI * 0.1)), 1e-15);
}

TEST(LRScheduler, BadArgumentsAreErrors) {
  auto opt = make_opt();
  using E = bmt::core::Error;
  EXPECT_THROW(ls::NoDecay(opt, -1.0, 0, 0), E);
  EXPECT_THROW(ls::NoDecay(opt, 1.0, -1, 0), E);
  EXPECT_THROW(ls::NoDecay(opt, 1.0, 0, -5), E);
  EXPECT_THROW(ls::NoDecay(opt, 1.0, 0, 0, -1), E);
  EXPECT_THROW(ls::Linear(opt, 1.0, 10, 5), E);
  EXPECT_THROW(ls::Cosine(opt, 1.0, 10, 5), E);
  EXPECT_THROW(ls::Exponential(opt, 1.0, 0, 0, 0, 0.0), E);
  EXPECT_THROW(ls::NoDecay(nullptr, 1.0, 0, 0), E);
}
