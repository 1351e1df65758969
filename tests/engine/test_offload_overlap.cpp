// Block-level overlap of the offloaded optimizer: OptimManager::overlap_offload_with_backward() starts
// AdamOffloadOptimizer's update of each Block as soon as its gradients are reduced (during the rest of the
// backward). The result must equal AdamOptimizer's step after the full backward, bit for bit on CPU ranks (same
// CPU kernel). A Block whose gradients hold inf/NaN is never started early, and step() then refuses to skip half a
// step.
// With the asynchronous step, step() returns while the Blocks' updates still run (shown deterministically with a
// one-worker pool whose worker is held: queued updates then run only when somebody waits for them); the next
// forward waits Block by Block, state_dict waits for everything.
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/params/module_state.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "bmt/params/pending_update.h"
#include "gated_pool.h"
#include "run_ranks.h"
#include "inf_grad_hook.h"
#include "tiny_model.h"

namespace {

enum class Mode { kAdam, kOffload, kEarly, kAsync };
// What the asynchronous run does between step() and zero_grad().
enum class AfterStep { kNothing, kForwardFirstBlock, kStateDict };

bool still_running(const at::Tensor& p) {
  auto u = bmt::find_pending_update(p);
  return u != nullptr && !u->host_done();
}

bmt::StateDict train(Mode mode, int steps, AfterStep after = AfterStep::kNothing) {
  bmt::testing::GatedPool gated;  // outlives the optimizer
  tiny::Dims d;
  tiny::Model model(d, {}, true);
  at::manual_seed(5);
  bmt::init_parameters(model);
  bmt::optim::AdamOptions o(1e-2);
  o.weight_decay(0.01);
  std::shared_ptr<bmt::optim::AdamBase> opt;
  if (mode != Mode::kAdam) {
    auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters(), o);
    if (mode == Mode::kAsync) {
      off->set_thread_pool(gated.pool);
      off->set_async_step(true);
    }
    opt = off;
  } else {
    opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters(), o);
  }
  // grad_scale 1: the plain runs call the optimizer on the same unscaled loss.
  bmt::optim::OptimManagerOptions mo;
  mo.grad_scale = 1;
  bmt::optim::OptimManager manager(mo);
  manager.add_optimizer(opt);
  bmt::optim::OffloadOverlap overlap;
  if (mode == Mode::kEarly || mode == Mode::kAsync) overlap = manager.overlap_offload_with_backward();
  std::vector<at::Tensor> block_params, other_params;
  for (auto& p : model.parameters()) (bmt::in_block(p) ? block_params : other_params).push_back(p);
  bmt::StateDict after_step;
  for (int s = 0; s < steps; ++s) {
    if (mode == Mode::kAsync) gated.close();
    at::Tensor ids = at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong));
    at::Tensor logits = model.forward(ids.narrow(1, 0, 4));
    at::cross_entropy_loss(logits.reshape({-1, d.vocab}), ids.narrow(1, 1, 4).reshape({-1})).backward();
    if (overlap.active()) {
      EXPECT_GT(std::dynamic_pointer_cast<bmt::optim::AdamOffloadOptimizer>(opt)->num_started(), 0u);
      EXPECT_TRUE(manager.step());
    } else {
      opt->step();
    }
    if (mode == Mode::kAsync) {
      // step() updated the parameters outside Blocks only; every Block parameter's update is pending, and those
      // with elements on this rank have not run (the pool's only worker is held, nobody waited for them).
      EXPECT_EQ(bmt::num_pending_updates(), block_params.size()) << "step " << s;
      int running = 0;
      for (auto& p : block_params) running += still_running(p) ? 1 : 0;
      EXPECT_GT(running, 0) << "step " << s;
      for (auto& p : other_params) EXPECT_EQ(bmt::find_pending_update(p), nullptr);
      if (after == AfterStep::kForwardFirstBlock) {
        // The forward of block 0 waits for block 0's updates only.
        at::NoGradGuard no_grad;
        (*model.list)[0].forward(at::ones({4, 4, d.dim}));  // no random draw: the data must match
        for (auto& p : (*model.list)[0].module()->parameters()) EXPECT_EQ(bmt::find_pending_update(p), nullptr);
        int later = 0;
        for (size_t i = 1; i < model.list->size(); ++i)
          for (auto& p : (*model.list)[i].module()->parameters()) later += still_running(p) ? 1 : 0;
        EXPECT_GT(later, 0) << "step " << s;
      } else if (after == AfterStep::kStateDict && s == steps - 1) {
        after_step = bmt::state_dict(model);  // must wait for every update (the worker is still held)
        EXPECT_EQ(bmt::num_pending_updates(), 0u);
      }
      gated.open();
    }
    if (overlap.active()) manager.zero_grad();
    else opt->zero_grad();
    if (mode == Mode::kAsync) {
      EXPECT_EQ(bmt::num_pending_updates(), 0u);  // CPU parameters: zero_grad waited
    }
  }
  if (overlap.active()) {
    EXPECT_EQ(overlap.num_early_starts(), steps * d.layers);
    EXPECT_EQ(overlap.num_nonfinite_blocks(), 0);
  }
  return after == AfterStep::kStateDict ? after_step : bmt::state_dict(model);
}

void expect_equal(const bmt::StateDict& ref, const bmt::StateDict& got) {
  EXPECT_EQ(ref.size(), got.size());
  for (auto& kv : ref) {
    auto it = got.find(kv.first);
    ASSERT_NE(it, got.end()) << kv.first;
    EXPECT_TRUE(at::equal(kv.second, it->second)) << kv.first;
  }
}

}  // namespace

TEST(OffloadOverlap, EarlyBlockUpdatesEqualAdamOptimizer) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(99);
    auto ref = train(Mode::kAdam, 3);
    at::manual_seed(99);
    auto early = train(Mode::kEarly, 3);
    expect_equal(ref, early);
  });
}

TEST(OffloadOverlap, OverlapViaManagerIsBitIdenticalToAPlainOffloadStep) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(42);
    auto plain = train(Mode::kOffload, 3);
    at::manual_seed(42);
    auto early = train(Mode::kEarly, 3);
    expect_equal(plain, early);
  });
}

TEST(OffloadOverlap, AsyncStepReturnsBeforeBlockUpdatesAndEqualsAdamOptimizer) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(99);
    auto ref = train(Mode::kAdam, 4);
    at::manual_seed(99);
    auto async = train(Mode::kAsync, 4);
    expect_equal(ref, async);
    EXPECT_EQ(bmt::num_pending_updates(), 0u);
  });
}

TEST(OffloadOverlap, AsyncStepNextForwardWaitsBlockByBlock) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(7);
    auto ref = train(Mode::kAdam, 3);
    at::manual_seed(7);
    auto async = train(Mode::kAsync, 3, AfterStep::kForwardFirstBlock);
    expect_equal(ref, async);
  });
}

TEST(OffloadOverlap, StateDictRightAfterAsyncStepHasTheUpdatedValues) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(11);
    auto ref = train(Mode::kAdam, 2);
    at::manual_seed(11);
    auto async = train(Mode::kAsync, 2, AfterStep::kStateDict);
    expect_equal(ref, async);
  });
}

// One forward + backward of the tiny model on fixed data.
void backward(tiny::Model& model, const tiny::Dims& d) {
  at::Tensor ids = at::arange(20, at::TensorOptions().dtype(at::kLong)).remainder(d.vocab).reshape({4, 5});
  at::Tensor logits = model.forward(ids.narrow(1, 0, 4));
  at::cross_entropy_loss(logits.reshape({-1, d.vocab}), ids.narrow(1, 1, 4).reshape({-1})).backward();
}

TEST(OffloadOverlap, TheHandleRemovesTheHook) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(3);
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    bmt::init_parameters(model);
    auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters());
    bmt::optim::OptimManager manager;
    manager.add_optimizer(off);
    {
      bmt::optim::OffloadOverlap first = manager.overlap_offload_with_backward();
      EXPECT_THROW(manager.overlap_offload_with_backward(), bmt::core::Error);  // one at a time
      bmt::optim::OffloadOverlap moved = std::move(first);
      EXPECT_FALSE(first.active());
      EXPECT_TRUE(moved.active());
      backward(model, d);
      EXPECT_GT(off->num_started(), 0u);
      manager.step();
      manager.zero_grad();
      moved.remove();
      EXPECT_FALSE(moved.active());
      EXPECT_EQ(moved.num_early_starts(), d.layers);  // counters outlive remove()
      backward(model, d);
      EXPECT_EQ(off->num_started(), 0u);
      manager.step();
      manager.zero_grad();
    }
    {
      bmt::optim::OffloadOverlap scoped = manager.overlap_offload_with_backward();  // the removed one is gone
    }
    backward(model, d);  // the destructor removed the hook
    EXPECT_EQ(off->num_started(), 0u);
    manager.step();
  });
}

TEST(OffloadOverlap, RefusedWithDynamicLossScalingOrWithoutAnOffloadOptimizer) {
  bmt::testing::run_ranks(1, [] {
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    bmt::optim::OptimManagerOptions mo;
    mo.loss_scale = 1024;
    bmt::optim::OptimManager scaled(mo);
    scaled.add_optimizer(std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters()));
    try {
      scaled.overlap_offload_with_backward();
      ADD_FAILURE() << "no error with loss scaling";
    } catch (const bmt::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("loss scaling"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("loss_scale = 0"), std::string::npos) << e.what();  // the fix
    }
    bmt::optim::OptimManager gpu_only;
    gpu_only.add_optimizer(std::make_shared<bmt::optim::AdamOptimizer>(model.parameters()));
    EXPECT_THROW(gpu_only.overlap_offload_with_backward(), bmt::core::Error);
  });
}

// An inf written into one rank's shard of one Block's reduced gradients (by a grad-ready hook that runs before the
// overlap's): that Block is not updated early on any rank, the others are, and step() raises instead of skipping.
TEST(OffloadOverlap, InfInOneBlockIsNotUpdatedEarlyAndStepRefusesAHalfAppliedStep) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(3);
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    bmt::init_parameters(model);
    const bmt::StateDict before = bmt::state_dict(model);
    bmt::Block* poisoned = &(*model.list)[1];
    std::optional<tiny::InfGradOnRank0> poison(std::in_place, poisoned);
    auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters());
    bmt::optim::OptimManager manager;
    manager.add_optimizer(off);
    bmt::optim::OffloadOverlap overlap = manager.overlap_offload_with_backward();
    backward(model, d);
    EXPECT_EQ(overlap.num_nonfinite_blocks(), 1);
    EXPECT_EQ(overlap.num_early_starts(), d.layers - 1);
    for (auto& p : poisoned->module()->parameters()) EXPECT_EQ(off->find_state(p), nullptr);
    for (auto& p : (*model.list)[0].module()->parameters()) EXPECT_NE(off->find_state(p), nullptr);
    try {
      manager.step();
      ADD_FAILURE() << "step() skipped half a step silently";
    } catch (const bmt::core::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("diverged"), std::string::npos) << what;
      EXPECT_NE(what.find("2 Block(s) were already updated"), std::string::npos) << what;
      EXPECT_NE(what.find("withheld for inf/NaN: #1"), std::string::npos) << what;  // backward order: 2, 1, 0
      EXPECT_NE(what.find("checkpoint"), std::string::npos) << what;
    }
    poison.reset();
    const bmt::StateDict after = bmt::state_dict(model);
    for (const auto& kv : before) {
      const bool changed = !at::equal(kv.second, after.at(kv.first));
      const bool early = kv.first.rfind("layers.0.", 0) == 0 || kv.first.rfind("layers.2.", 0) == 0;
      // Biases start at 0 and LayerNorm at 1, but one Adam step moves every element with a nonzero gradient.
      if (early) EXPECT_TRUE(changed) << kv.first;
      else EXPECT_FALSE(changed) << kv.first;  // the poisoned Block and the parameters outside Blocks
    }
    EXPECT_EQ(off->num_started(), 0u);  // the iteration ended: the run may go on from a loaded checkpoint
  });
}

TEST(PendingUpdates, WaitRethrowsOnceAndUnregisters) {
  bmt::testing::run_ranks(1, [] {
    bmt::testing::GatedPool gated;
    at::Tensor p = bmt::DistributedParameter(at::zeros({4}));
    at::Tensor q = bmt::DistributedParameter(at::zeros({4}));
    gated.close();
    auto failing = std::make_shared<bmt::PendingUpdate>(gated.pool);
    failing->run([] { throw std::runtime_error("update failed"); });
    auto fine = std::make_shared<bmt::PendingUpdate>(gated.pool);
    bool ran = false;
    fine->run([&ran] { ran = true; });
    EXPECT_FALSE(fine->host_done());
    bmt::set_pending_update(p, failing);
    bmt::set_pending_update(q, fine);
    EXPECT_THROW(bmt::set_pending_update(q, fine), bmt::core::Error);  // one pending update per parameter
    EXPECT_EQ(bmt::num_pending_updates(), 2u);
    EXPECT_THROW(bmt::wait_pending_update(p), std::runtime_error);
    EXPECT_EQ(bmt::find_pending_update(p), nullptr);
    bmt::wait_pending_update(p);  // no-op now
    bmt::wait_all_pending_updates();
    EXPECT_TRUE(ran);
    EXPECT_EQ(bmt::num_pending_updates(), 0u);
    EXPECT_EQ(bmt::find_pending_update(at::zeros({4})), nullptr);  // plain tensors never have one
  });
}
