// AdamOffloadOptimizer on CPU parameters: bit-identical to AdamOptimizer (both run the same CPU kernel), also when
// part of the update is started early with step_params; interchangeable state dicts.
#include <gtest/gtest.h>

#include "bmt/core/error.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/pending_update.h"
#include "gated_pool.h"
#include "opt_test_util.h"

using bmt::optim::AdamOffloadOptimizer;
using bmt::optim::AdamOptimizer;
using bmt::optim::AdamOptions;
using namespace bmt::optim::testing;

namespace {

enum class GradKind { kOwnDtype, kFp32Main };

void set_grads(std::vector<at::Tensor>& a, std::vector<at::Tensor>& b, GradKind kind, int seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (size_t i = 0; i < a.size(); ++i) {
    at::Tensor g = at::randn(a[i].sizes(), gen);
    if (kind == GradKind::kFp32Main) {
      bmt::set_main_grad(a[i], g.clone());
      bmt::set_main_grad(b[i], g.clone());
    } else {
      a[i].mutable_grad() = g.to(a[i].scalar_type());
      b[i].mutable_grad() = g.to(b[i].scalar_type());
    }
  }
}

void forget(const std::vector<at::Tensor>& ps) {
  for (const auto& p : ps) bmt::forget_param(p);
}

}  // namespace

TEST(AdamOffloadOptimizer, BitIdenticalToAdamOptimizer) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (GradKind kind : {GradKind::kOwnDtype, GradKind::kFp32Main}) {
      auto a = make_params(kShapes, dt, 21);
      auto b = clone_params(a, dt);
      AdamOptions opts(3e-3, {0.9, 0.98}, 1e-7, 0.02);
      AdamOptimizer adam(a, opts);
      AdamOffloadOptimizer offload(b, opts);
      for (int step = 0; step < 10; ++step) {
        set_grads(a, b, kind, 100 + step);
        adam.step(4.0);
        offload.step(4.0);
      }
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(at::equal(a[i], b[i])) << c10::toString(dt) << " param " << i;
        if (a[i].numel() == 0) continue;
        const auto* sa = adam.find_state(a[i]);
        const auto* sb = offload.find_state(b[i]);
        EXPECT_TRUE(at::equal(sa->exp_avg, sb->exp_avg));
        EXPECT_TRUE(at::equal(sa->exp_avg_sq, sb->exp_avg_sq));
        EXPECT_EQ(sa->step, sb->step);
      }
      forget(a);
      forget(b);
    }
  }
}

TEST(AdamOffloadOptimizer, EarlyStartOfASubsetGivesTheSameResult) {
  auto a = make_params(kShapes, at::kBFloat16, 22);
  auto b = clone_params(a, at::kBFloat16);
  AdamOptimizer adam(a, AdamOptions(1e-3, {0.9, 0.999}, 1e-8, 0.1));
  AdamOffloadOptimizer offload(b, AdamOptions(1e-3, {0.9, 0.999}, 1e-8, 0.1));
  for (int step = 0; step < 4; ++step) {
    set_grads(a, b, GradKind::kOwnDtype, 200 + step);
    // "Backward" finished the last blocks first: start their updates, as a per-block hook would.
    offload.step_params(std::vector<size_t>{5, 4}, 8.0);
    offload.step_params(std::vector<at::Tensor>{b[1]}, 8.0);
    EXPECT_EQ(offload.num_started(), 3u);
    EXPECT_THROW(offload.step_params(std::vector<size_t>{4}, 8.0), bmt::core::Error);  // twice in one iteration
    adam.step(8.0);
    offload.step(8.0);  // the rest, then waits
    EXPECT_EQ(offload.num_started(), 0u);
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
  EXPECT_THROW(offload.step_params(std::vector<size_t>{99}), bmt::core::Error);
  EXPECT_THROW(offload.step_params(std::vector<at::Tensor>{at::zeros({3})}), bmt::core::Error);
}

TEST(AdamOffloadOptimizer, ZeroGradEndsTheIteration) {
  auto b = make_params({{100}, {50}}, at::kFloat, 23);
  AdamOffloadOptimizer offload(b);
  for (auto& p : b) p.mutable_grad() = at::ones_like(p);
  offload.step_params(std::vector<size_t>{0});
  offload.zero_grad();  // waits for the running update first
  EXPECT_EQ(offload.num_started(), 0u);
  EXPECT_EQ(offload.find_state(b[0])->step, 1);
  EXPECT_EQ(offload.find_state(b[1]), nullptr);
}

TEST(AdamOffloadOptimizer, StateDictsAreInterchangeableWithAdamOptimizer) {
  auto a = make_params(kShapes, at::kHalf, 24);
  AdamOptimizer adam(a, AdamOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    for (auto& p : a) p.mutable_grad() = at::randn(p.sizes()).to(at::kHalf);
    adam.step();
  }
  auto b = clone_params(a, at::kHalf);
  AdamOffloadOptimizer offload(b);
  offload.load_state_dict(adam.state_dict());
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      at::Tensor g = at::randn(a[i].sizes()).to(at::kHalf);
      a[i].mutable_grad() = g;
      b[i].mutable_grad() = g.clone();
    }
    adam.step();
    offload.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(offload.find_state(b[i])->exp_avg.is_cpu());
}

TEST(AdamOffloadOptimizer, AsyncStepWaitsForParametersOutsideBlocks) {
  // Plain parameters are outside any Block: an asynchronous step() still applies them before returning, even when
  // the pool's only worker is held (the caller runs their updates itself; another group's tasks never block it).
  bmt::testing::GatedPool gated;
  auto a = make_params(kShapes, at::kBFloat16, 25);
  auto b = clone_params(a, at::kBFloat16);
  AdamOptions opts(2e-3, {0.9, 0.99}, 1e-8, 0.05);
  AdamOptimizer adam(a, opts);
  AdamOffloadOptimizer offload(b, opts);
  offload.set_thread_pool(gated.pool);
  offload.set_async_step(true);
  EXPECT_TRUE(offload.async_step());
  gated.close();
  for (int step = 0; step < 4; ++step) {
    set_grads(a, b, GradKind::kFp32Main, 300 + step);
    offload.step_params(std::vector<size_t>{5}, 2.0);
    adam.step(2.0);
    offload.step(2.0);
    EXPECT_EQ(bmt::num_pending_updates(), 0u);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "step " << step << " param " << i;
    offload.zero_grad();
  }
  gated.open();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].numel() == 0) continue;
    EXPECT_TRUE(at::equal(adam.find_state(a[i])->exp_avg_sq, offload.find_state(b[i])->exp_avg_sq)) << i;
  }
  offload.set_async_step(false);
  EXPECT_FALSE(offload.async_step());
  forget(a);
  forget(b);
}
