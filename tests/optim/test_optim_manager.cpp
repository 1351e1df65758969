// OptimManager in one process: loss scaling (skip, back-off, growth, clamps), unscaling for bmtrain and torch
// optimizers, clip_grad_norm, state dicts and errors. Multi-rank behaviour: test_optim_multirank.cpp.
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <limits>

#include "bmt/core/error.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/optim_manager.h"
#include "opt_test_util.h"

using bmt::optim::AdamOptimizer;
using bmt::optim::AdamOptions;
using bmt::optim::OptimManager;
using bmt::optim::OptimManagerOptions;
using namespace bmt::optim::testing;

namespace {

OptimManagerOptions scaler(double scale, int64_t steps = 1024, double min = 1,
                           double max = std::numeric_limits<double>::infinity()) {
  OptimManagerOptions o;
  o.loss_scale = scale;
  o.loss_scale_steps = steps;
  o.min_loss_scale = min;
  o.max_loss_scale = max;
  o.grad_scale = 1;
  return o;
}

}  // namespace

TEST(OptimManager, BackwardScalesTheLoss) {
  OptimManagerOptions o = scaler(1024);
  o.grad_scale = 4;
  OptimManager m(o);
  at::Tensor w = at::ones({3}).requires_grad_(true);
  m.backward((w * at::tensor({1.0f, 2.0f, 3.0f})).sum());
  EXPECT_TRUE(at::equal(w.grad(), at::tensor({256.0f, 512.0f, 768.0f})));
  EXPECT_DOUBLE_EQ(OptimManager().grad_scale(), 1.0);  // default before init_distributed
}

TEST(OptimManager, OverflowSkipsTheStepAndBacksOff) {
  auto p = make_params({{4}, {5}}, at::kBFloat16, 31);
  auto before = clone_params(p, at::kBFloat16);
  auto opt = std::make_shared<AdamOptimizer>(p, AdamOptions(0.1));
  auto sched = std::make_shared<bmt::optim::lr_scheduler::NoDecay>(opt, 0.1, 10, 0);
  OptimManager m(scaler(1024, 2));
  m.add_optimizer(opt, sched);
  p[0].mutable_grad() = at::ones({4}, at::kBFloat16);
  p[1].mutable_grad() = at::ones({5}, at::kBFloat16);
  p[1].mutable_grad()[2] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(m.step());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 512);
  EXPECT_EQ(m.num_skipped_steps(), 1);
  EXPECT_EQ(sched->num_iter(), 0);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::equal(p[i], before[i]));
  EXPECT_EQ(p[1].grad().abs().sum().item<float>(), 0.0f);  // zeroed
  EXPECT_EQ(opt->find_state(p[0]), nullptr);
  p[1].mutable_grad()[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(m.step());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 256);
}

TEST(OptimManager, GrowthAfterIntervalAndClamps) {
  auto p = make_params({{4}}, at::kFloat, 32);
  auto opt = std::make_shared<AdamOptimizer>(p);
  OptimManager m(scaler(1024, 3, 256, 3000));
  m.add_optimizer(opt);
  auto good = [&] {
    p[0].mutable_grad() = at::ones({4});
    return m.step();
  };
  auto bad = [&] {
    p[0].mutable_grad() = at::full({4}, std::numeric_limits<float>::infinity());
    return m.step();
  };
  EXPECT_TRUE(good());
  EXPECT_TRUE(good());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 1024);
  EXPECT_TRUE(good());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 2048);
  EXPECT_EQ(m.steps_since_last_scale(), 0);
  for (int i = 0; i < 3; ++i) good();
  EXPECT_DOUBLE_EQ(m.loss_scale(), 3000);  // clamped at max, not 4096
  for (int i = 0; i < 6; ++i) good();
  EXPECT_DOUBLE_EQ(m.loss_scale(), 3000);
  EXPECT_GT(m.steps_since_last_scale(), 0);  // at the max the interval keeps counting
  EXPECT_FALSE(bad());
  EXPECT_EQ(m.steps_since_last_scale(), 0);  // an overflow restarts the interval
  EXPECT_DOUBLE_EQ(m.loss_scale(), 1500);
  EXPECT_FALSE(bad());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 750);
  EXPECT_FALSE(bad());
  EXPECT_FALSE(bad());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 256);  // clamped at min
  EXPECT_FALSE(bad());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 256);
}

TEST(OptimManager, DisabledScalingStillSkipsNonFiniteSteps) {
  auto p = make_params({{4}}, at::kFloat, 33);
  auto before = clone_params(p, at::kFloat);
  auto opt = std::make_shared<AdamOptimizer>(p);
  OptimManager m;
  m.add_optimizer(opt);
  EXPECT_FALSE(m.loss_scale_enabled());
  p[0].mutable_grad() = at::full({4}, std::numeric_limits<float>::quiet_NaN());
  EXPECT_FALSE(m.step());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 1);
  EXPECT_TRUE(at::equal(p[0], before[0]));
}

TEST(OptimManager, UnscalesForBmtAndTorchOptimizers) {
  auto a = make_params(kShapes, at::kFloat, 34);  // managed, scaled by 2^10
  auto b = clone_params(a, at::kFloat);           // plain AdamOptimizer
  auto c = clone_params(a, at::kFloat);           // managed torch AdamW
  auto d = clone_params(a, at::kFloat);           // plain torch AdamW
  auto oa = std::make_shared<AdamOptimizer>(a, AdamOptions(1e-2, {0.9, 0.999}, 1e-8, 0.1));
  AdamOptimizer ob(b, AdamOptions(1e-2, {0.9, 0.999}, 1e-8, 0.1));
  auto oc = std::make_shared<torch::optim::AdamW>(c, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW od(d, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  OptimManager m(scaler(1024));
  m.add_optimizer(oa);
  m.add_optimizer(oc);
  for (int step = 0; step < 5; ++step) {
    m.zero_grad();
    for (size_t i = 0; i < a.size(); ++i) {
      at::Tensor x = at::randn(a[i].sizes());
      m.backward((a[i] * x).sum() + (c[i] * x).sum());
      b[i].mutable_grad() = x.clone();
      d[i].mutable_grad() = x.clone();
    }
    EXPECT_TRUE(m.step());
    ob.step();
    od.step();
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << i;
    EXPECT_TRUE(at::equal(c[i], d[i])) << i;
  }
}

TEST(OptimManager, ClipGradNormIsUnscaleAware) {
  at::Tensor w = at::zeros({4}).requires_grad_(true);
  at::Tensor v = at::zeros({0}).requires_grad_(true);  // empty shard
  auto opt = std::make_shared<AdamOptimizer>(std::vector<at::Tensor>{w, v});
  OptimManager m(scaler(8));
  m.add_optimizer(opt);
  m.backward((w * at::tensor({3.0f, 0.0f, 4.0f, 0.0f})).sum());  // grad = 8 * (3, 0, 4, 0)
  EXPECT_NEAR(m.clip_grad_norm(10.0), 5.0, 1e-6);                // below max: untouched
  EXPECT_TRUE(at::equal(w.grad(), at::tensor({24.0f, 0.0f, 32.0f, 0.0f})));
  EXPECT_NEAR(m.clip_grad_norm(1.0, INFINITY), 4.0, 1e-6);  // inf norm, clips by 1 / (4 + eps)
  EXPECT_NEAR(w.grad()[2].item<float>(), 8.0, 1e-4);
  EXPECT_NEAR(m.clip_grad_norm(0.5), std::sqrt(3.0 * 3 + 4 * 4) / 4.0, 1e-5);
  EXPECT_NEAR(at::linalg_vector_norm(w.grad(), 2, c10::nullopt, false, c10::nullopt).item<double>() / 8, 0.5, 1e-5);
  EXPECT_THROW(m.clip_grad_norm(0.0), bmt::core::Error);
  EXPECT_THROW(m.clip_grad_norm(1.0, 0.5), bmt::core::Error);
  w.mutable_grad()[1] = std::numeric_limits<float>::infinity();
  at::Tensor before = w.grad().clone();
  EXPECT_TRUE(std::isinf(m.clip_grad_norm(1.0)));
  EXPECT_TRUE(at::equal(w.grad(), before));  // an overflowed norm leaves gradients to step()'s check
}

TEST(OptimManager, StateDictRoundTrip) {
  auto make = [](std::vector<at::Tensor> a, std::vector<at::Tensor> c) {
    auto m = std::make_unique<OptimManager>(scaler(64, 2));
    auto oa = std::make_shared<bmt::optim::AdamOffloadOptimizer>(a, AdamOptions(1e-2));
    auto oc = std::make_shared<torch::optim::AdamW>(c, torch::optim::AdamWOptions(1e-2));
    m->add_optimizer(oa, std::make_shared<bmt::optim::lr_scheduler::Cosine>(oa, 1e-2, 2, 20));
    m->add_optimizer(oc);
    return m;
  };
  auto a = make_params({{5}, {7}}, at::kBFloat16, 35);
  auto c = make_params({{3}}, at::kFloat, 36);
  auto m1 = make(a, c);
  auto run = [](OptimManager& m, std::vector<at::Tensor>& a, std::vector<at::Tensor>& c, int seed) {
    at::Generator gen = at::detail::createCPUGenerator(seed);
    m.zero_grad();
    for (auto& p : a) m.backward((p.to(at::kFloat) * at::randn(p.sizes(), gen)).sum());
    for (auto& p : c) m.backward((p * at::randn(p.sizes(), gen)).sum());
    return m.step();
  };
  for (int s = 0; s < 3; ++s) run(*m1, a, c, s);
  EXPECT_DOUBLE_EQ(m1->loss_scale(), 128);
  auto a2 = clone_params(a, at::kBFloat16);
  auto c2 = clone_params(c, at::kFloat);
  auto m2 = make(a2, c2);
  m2->load_state_dict(m1->state_dict());
  EXPECT_DOUBLE_EQ(m2->loss_scale(), 128);
  EXPECT_EQ(m2->steps_since_last_scale(), 1);
  EXPECT_EQ(m2->lr_schedulers()[0]->num_iter(), 3);
  for (int s = 3; s < 6; ++s) {
    run(*m1, a, c, s);
    run(*m2, a2, c2, s);
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], a2[i]));
  for (size_t i = 0; i < c.size(); ++i) EXPECT_TRUE(at::equal(c[i], c2[i]));
  EXPECT_DOUBLE_EQ(m1->loss_scale(), m2->loss_scale());

  // Mismatches are errors: another model, a missing scheduler, another number of optimizers.
  auto sd = m1->state_dict();
  auto other = make(make_params({{5}, {8}}, at::kBFloat16, 37), make_params({{3}}, at::kFloat, 38));
  EXPECT_THROW(other->load_state_dict(sd), bmt::core::Error);
  auto other_torch = make(make_params({{5}, {7}}, at::kBFloat16, 37), make_params({{4}}, at::kFloat, 38));
  EXPECT_THROW(other_torch->load_state_dict(sd), bmt::core::Error);
  OptimManager lonely(scaler(64));
  lonely.add_optimizer(std::make_shared<AdamOptimizer>(make_params({{5}, {7}}, at::kBFloat16, 39)));
  EXPECT_THROW(lonely.load_state_dict(sd), bmt::core::Error);
}

TEST(OptimManager, BadOptionsAreErrors) {
  using E = bmt::core::Error;
  EXPECT_THROW(OptimManager(scaler(-1)), E);
  EXPECT_THROW(OptimManager(scaler(1024, 0)), E);
  EXPECT_THROW(OptimManager(scaler(1024, 10, 0)), E);
  EXPECT_THROW(OptimManager(scaler(1024, 10, 4, 2)), E);
  EXPECT_THROW(OptimManager(scaler(0.5, 10, 1)), E);  // below min
  OptimManagerOptions o = scaler(1024);
  o.loss_scale_factor = 0.5;  // inverted, as in BMTrain
  EXPECT_DOUBLE_EQ(OptimManager(o).loss_scale_factor(), 2.0);
  OptimManager m;
  EXPECT_THROW(m.add_optimizer(nullptr), E);
  auto opt = std::make_shared<AdamOptimizer>(make_params({{2}}, at::kFloat, 40));
  auto other = std::make_shared<AdamOptimizer>(make_params({{2}}, at::kFloat, 41));
  EXPECT_THROW(m.add_optimizer(opt, std::make_shared<bmt::optim::lr_scheduler::NoDecay>(other, 1.0, 0, 0)), E);
  m.add_optimizer(opt);
  EXPECT_THROW(m.add_optimizer(opt), E);
}

TEST(OptimManager, SetLossScaleStateAlone) {
  using E = bmt::core::Error;
  OptimManager m(scaler(1024, 4, /*min=*/2, /*max=*/4096));
  m.set_loss_scale_state(256, true, 3);
  EXPECT_TRUE(m.loss_scale_enabled());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 256);
  EXPECT_EQ(m.steps_since_last_scale(), 3);
  EXPECT_DOUBLE_EQ(m.scale_loss(at::ones({1})).item<double>(), 256.0 / m.grad_scale());
  m.set_loss_scale_state(123, false, 0);  // disabled: the scale is 1 whatever was passed
  EXPECT_FALSE(m.loss_scale_enabled());
  EXPECT_DOUBLE_EQ(m.loss_scale(), 1);
  EXPECT_THROW(m.set_loss_scale_state(1, true, 0), E);       // below min_loss_scale 2
  EXPECT_THROW(m.set_loss_scale_state(8192, true, 0), E);    // above max_loss_scale
  EXPECT_THROW(m.set_loss_scale_state(256, true, -1), E);
  EXPECT_THROW(m.set_loss_scale_state(std::nan(""), true, 0), E);
  EXPECT_FALSE(m.loss_scale_enabled());  // a refused call changes nothing
}
