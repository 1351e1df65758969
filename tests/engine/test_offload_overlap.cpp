// Block-level overlap of the offloaded optimizer: a grad-ready hook starts AdamOffloadOptimizer's update of each
// Block as soon as its gradients are reduced (during the rest of the backward). The result must equal
// AdamOptimizer's step after the full backward, bit for bit on CPU ranks (same CPU kernel).
// With the asynchronous step, step() returns while the Blocks' updates still run (shown deterministically with a
// one-worker pool whose worker is held: queued updates then run only when somebody waits for them); the next
// forward waits Block by Block, state_dict waits for everything.
#include <gtest/gtest.h>

#include <stdexcept>

#include "bmt/core/error.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/parameter.h"
#include "bmt/pending_update.h"
#include "bmt/state_dict.h"
#include "bmt/stream_sync.h"
#include "gated_pool.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace {

enum class Mode { kAdam, kEarly, kAsync };
// What the asynchronous run does between step() and zero_grad().
enum class AfterStep { kNothing, kForwardFirstBlock, kStateDict };

bool in_block(const at::Tensor& p) {
  const bmt::ParamMeta* m = bmt::find_meta(p);
  return m != nullptr && m->block != nullptr;
}

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
  int hook = -1;
  int started_blocks = 0;
  if (mode != Mode::kAdam) {
    auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters(), o);
    if (mode == Mode::kAsync) {
      off->set_thread_pool(gated.pool);
      off->set_async_step(true);
    }
    hook = bmt::add_grad_ready_hook([off, &started_blocks](bmt::Block& b) {
      bmt::wait_for_gradient_reduction();
      off->step_params(b.module()->parameters());
      ++started_blocks;
    });
    opt = off;
  } else {
    opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters(), o);
  }
  std::vector<at::Tensor> block_params, other_params;
  for (auto& p : model.parameters()) (in_block(p) ? block_params : other_params).push_back(p);
  bmt::StateDict after_step;
  for (int s = 0; s < steps; ++s) {
    if (mode == Mode::kAsync) gated.close();
    at::Tensor ids = at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong));
    at::Tensor logits = model.forward(ids.narrow(1, 0, 4));
    at::cross_entropy_loss(logits.reshape({-1, d.vocab}), ids.narrow(1, 1, 4).reshape({-1})).backward();
    opt->step();
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
    opt->zero_grad();
    if (mode == Mode::kAsync) {
      EXPECT_EQ(bmt::num_pending_updates(), 0u);  // CPU parameters: zero_grad waited
    }
  }
  if (hook >= 0) {
    bmt::remove_grad_ready_hook(hook);
    EXPECT_EQ(started_blocks, steps * static_cast<int>(d.layers));
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
