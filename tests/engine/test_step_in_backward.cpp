// OptimManager::overlap_step_with_backward() with AdamOptimizer (state on the parameters' device): each Block's
// update is queued right after its gradients are reduced, and with release_gradients the Block's gradient shards
// are freed until its next backward. The parameters and optimizer state after several steps must equal those of
// the plain manager.step() bit for bit (the same kernel over the same gradients; on CPU ranks the kernel is
// element-wise), in fp32 and in bf16 (fp32 master weights and gradients), with gradient accumulation under
// GradSyncGuard too; the gradient bytes must drop to 0 for every Block after the backward.
#include <gtest/gtest.h>

#include <limits>
#include <optional>
#include <string>

#include "bmt/engine/block.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/params/module_state.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "run_ranks.h"
#include "inf_grad_hook.h"
#include "tiny_model.h"

namespace {

enum class Mode { kPlain, kEarlyKeep, kEarlyRelease };

struct Result {
  bmt::StateDict model, optim;
};

void loss_backward(tiny::Model& model, const tiny::Dims& d, const at::Tensor& ids, bmt::optim::OptimManager& m) {
  at::Tensor logits = model.forward(ids.narrow(1, 0, 4));
  m.backward(at::cross_entropy_loss(logits.reshape({-1, d.vocab}).to(at::kFloat), ids.narrow(1, 1, 4).reshape({-1})));
}

Result train(Mode mode, const tiny::Dims& d, int steps, int micro_batches) {
  tiny::Model model(d, {}, true);
  at::manual_seed(5);
  bmt::init_parameters(model);
  bmt::optim::AdamOptions o(1e-2);
  o.weight_decay(0.01);
  auto opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters(), o);
  bmt::optim::OptimManager manager;
  manager.add_optimizer(opt);
  bmt::optim::OffloadOverlap overlap;
  if (mode != Mode::kPlain) overlap = manager.overlap_step_with_backward(mode == Mode::kEarlyRelease);
  for (int s = 0; s < steps; ++s) {
    for (int mb = 0; mb < micro_batches; ++mb) {
      at::Tensor ids = at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong));
      if (mb + 1 < micro_batches) {
        bmt::GradSyncGuard defer;  // accumulate without reducing; the last micro-batch reduces everything once
        loss_backward(model, d, ids, manager);
      } else {
        loss_backward(model, d, ids, manager);
      }
    }
    size_t block_params = 0;
    for (size_t i = 0; i < model.list->size(); ++i) block_params += (*model.list)[i].module()->parameters().size();
    if (mode != Mode::kPlain) {
      EXPECT_EQ(opt->num_started(), block_params) << "step " << s;
    }
    if (mode == Mode::kEarlyRelease) {
      for (size_t i = 0; i < model.list->size(); ++i) {
        EXPECT_EQ((*model.list)[i].grad_nbytes(), 0) << "Block " << i;
        for (auto& p : (*model.list)[i].module()->parameters()) EXPECT_FALSE(bmt::main_grad(p).defined());
      }
      EXPECT_EQ(bmt::memory_stats().grad_nbytes, 0);  // the engine's count of Block gradient bytes
    } else {
      EXPECT_GT(bmt::memory_stats().grad_nbytes, 0);
    }
    EXPECT_TRUE(manager.step());
    manager.zero_grad();
  }
  if (mode != Mode::kPlain) {
    EXPECT_EQ(overlap.num_early_starts(), steps * d.layers);
  }
  return {bmt::state_dict(model), opt->state_dict()};
}

void expect_equal(const bmt::StateDict& ref, const bmt::StateDict& got, const std::string& what) {
  EXPECT_EQ(ref.size(), got.size()) << what;
  for (auto& kv : ref) {
    auto it = got.find(kv.first);
    ASSERT_NE(it, got.end()) << what << " " << kv.first;
    EXPECT_TRUE(at::equal(kv.second, it->second)) << what << " " << kv.first;
  }
}

void compare_modes(const tiny::Dims& d, int micro_batches) {
  at::manual_seed(99);
  const Result ref = train(Mode::kPlain, d, 3, micro_batches);
  for (Mode mode : {Mode::kEarlyKeep, Mode::kEarlyRelease}) {
    at::manual_seed(99);
    const Result got = train(mode, d, 3, micro_batches);
    const std::string what = mode == Mode::kEarlyKeep ? "keep" : "release";
    expect_equal(ref.model, got.model, what);
    expect_equal(ref.optim, got.optim, what);
  }
}

}  // namespace

TEST(StepInBackward, EqualsThePlainStepBitForBitFp32) {
  for (int world : {1, 2}) bmt::testing::run_ranks(world, [] { compare_modes(tiny::Dims{}, 1); });
}

TEST(StepInBackward, EqualsThePlainStepBitForBitBf16WithFp32MasterAndGradients) {
  // World 1 with release: the Blocks hand their bf16 gradients to the optimizer (no fp32 shard); world 2 reduces.
  for (int world : {1, 2})
    bmt::testing::run_ranks(world, [] {
      tiny::Dims d;
      d.dtype = at::kBFloat16;
      compare_modes(d, 1);
    });
}

TEST(StepInBackward, AccumulationUnderGradSyncGuardReducesAndUpdatesOnce) {
  bmt::testing::run_ranks(2, [] { compare_modes(tiny::Dims{}, 3); });
}

TEST(StepInBackward, ClippingAfterEarlyUpdatesAndLossScalingAreRefused) {
  bmt::testing::run_ranks(1, [] {
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    bmt::init_parameters(model);
    auto opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters());
    bmt::optim::OptimManager manager;
    manager.add_optimizer(opt);
    bmt::optim::OffloadOverlap overlap = manager.overlap_step_with_backward();
    EXPECT_THROW(manager.overlap_step_with_backward(), bmt::core::Error);  // one at a time
    loss_backward(model, d, at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong)), manager);
    try {
      manager.clip_grad_norm(1.0);
      ADD_FAILURE() << "clipping a half-updated model";
    } catch (const bmt::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("every gradient before any update"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(manager.step());
    manager.zero_grad();
    overlap.remove();  // without the overlap clipping works again
    loss_backward(model, d, at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong)), manager);
    EXPECT_GT(manager.clip_grad_norm(1.0), 0.0);
    EXPECT_TRUE(manager.step());

    bmt::optim::OptimManagerOptions mo;
    mo.loss_scale = 1024;
    bmt::optim::OptimManager scaled(mo);
    scaled.add_optimizer(opt);
    EXPECT_THROW(scaled.overlap_step_with_backward(), bmt::core::Error);
  });
}

// An inf injected into one Block's reduced gradient on rank 0: the updates were queued without a host check, so
// step() must find it (rank 0's flag, agreed over the world) and refuse the half-applied step on every rank.
TEST(StepInBackward, InfInAnEarlyUpdatedBlockMakesStepThrowOnEveryRank) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(3);
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    bmt::init_parameters(model);
    bmt::Block* poisoned = &(*model.list)[1];
    std::optional<tiny::InfGradOnRank0> poison(std::in_place, poisoned);
    auto opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters());
    bmt::optim::OptimManager manager;
    manager.add_optimizer(opt);
    bmt::optim::OffloadOverlap overlap = manager.overlap_step_with_backward();
    loss_backward(model, d, at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong)), manager);
    try {
      manager.step();
      ADD_FAILURE() << "step() accepted a half-applied step with an inf gradient";
    } catch (const bmt::core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("diverged"), std::string::npos) << e.what();
    }
    poison.reset();
  });
}
