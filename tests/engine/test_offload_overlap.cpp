// Block-level overlap of the offloaded optimizer: a grad-ready hook starts AdamOffloadOptimizer's update of each
// Block as soon as its gradients are reduced (during the rest of the backward). The result must equal
// AdamOptimizer's step after the full backward, bit for bit on CPU ranks (same CPU kernel).
#include <gtest/gtest.h>

#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/state_dict.h"
#include "bmt/stream_sync.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace {

bmt::StateDict train(bool offload_early, int steps) {
  tiny::Dims d;
  tiny::Model model(d, {}, true);
  at::manual_seed(5);
  bmt::init_parameters(model);
  bmt::optim::AdamOptions o(1e-2);
  o.weight_decay(0.01);
  std::shared_ptr<bmt::optim::AdamBase> opt;
  int hook = -1;
  int started_blocks = 0;
  if (offload_early) {
    auto off = std::make_shared<bmt::optim::AdamOffloadOptimizer>(model.parameters(), o);
    hook = bmt::add_grad_ready_hook([off, &started_blocks](bmt::Block& b) {
      bmt::wait_for_gradient_reduction();
      off->step_params(b.module()->parameters());
      ++started_blocks;
    });
    opt = off;
  } else {
    opt = std::make_shared<bmt::optim::AdamOptimizer>(model.parameters(), o);
  }
  for (int s = 0; s < steps; ++s) {
    at::Tensor ids = at::randint(0, d.vocab, {4, 5}, at::TensorOptions().dtype(at::kLong));
    at::Tensor logits = model.forward(ids.narrow(1, 0, 4));
    at::cross_entropy_loss(logits.reshape({-1, d.vocab}), ids.narrow(1, 1, 4).reshape({-1})).backward();
    opt->step();
    opt->zero_grad();
  }
  if (hook >= 0) {
    bmt::remove_grad_ready_hook(hook);
    EXPECT_EQ(started_blocks, steps * static_cast<int>(d.layers));
  }
  return bmt::state_dict(model);
}

}  // namespace

TEST(OffloadOverlap, EarlyBlockUpdatesEqualAdamOptimizer) {
  bmt::testing::run_ranks(2, [] {
    at::manual_seed(99);
    auto ref = train(false, 3);
    at::manual_seed(99);
    auto early = train(true, 3);
    for (auto& kv : ref) EXPECT_TRUE(at::equal(kv.second, early[kv.first])) << kv.first;
  });
}
