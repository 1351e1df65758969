// OptimManager over real Gloo ranks: an inf on one rank skips the step everywhere; clip_grad_norm over shards of
// unequal and zero length equals the closed-form norm of the unsharded vector, replicated elements counted once.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "bmt/optim/adam.h"
#include "bmt/optim/grad_utils.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/param_meta.h"
#include "run_ranks.h"

using bmt::optim::AdamOptimizer;
using bmt::optim::AdamOptions;
using bmt::optim::OptimManager;
using bmt::optim::OptimManagerOptions;

namespace {

OptimManagerOptions scaled(double scale) {
  OptimManagerOptions o;
  o.loss_scale = scale;
  o.loss_scale_steps = 2;
  o.grad_scale = 1;
  return o;
}

// The full (unsharded) gradient vector: G_i = ((i * 7) % 11) - 5 + 0.25, i in [0, n).
at::Tensor full_vector(int64_t n) {
  at::Tensor i = at::arange(n, at::kDouble);
  return (at::fmod(i * 7, 11) - 5 + 0.25).to(at::kFloat);
}

// Unequal shard sizes with empty shards, per world size.
std::vector<int64_t> shard_sizes(int world) {
  switch (world) {
    case 1: return {23};
    case 2: return {5, 18};
    case 3: return {0, 11, 12};
    default: return {7, 0, 16, 0};
  }
}

}  // namespace

TEST(OptimManagerMultiRank, InfOnOneRankSkipsTheStepEverywhere) {
  for (int world : {2, 3}) {
    bmt::testing::run_ranks(world, [] {
      const int rank = bmt::rank();
      at::Tensor p = at::full({6}, 1.0).requires_grad_(true);
      bmt::set_replication(p, 1);  // a ZeRO shard: every rank holds different elements
      auto opt = std::make_shared<AdamOptimizer>(std::vector<at::Tensor>{p}, AdamOptions(0.1));
      OptimManager m(scaled(1024));
      m.add_optimizer(opt);
      p.mutable_grad() = at::ones({6});
      if (rank == 1) p.mutable_grad()[3] = std::numeric_limits<float>::infinity();
      EXPECT_FALSE(m.step()) << "rank " << rank;
      EXPECT_DOUBLE_EQ(m.loss_scale(), 512) << "rank " << rank;
      EXPECT_TRUE(at::equal(p, at::full({6}, 1.0))) << "rank " << rank;
      p.mutable_grad() = at::ones({6});
      EXPECT_TRUE(m.step()) << "rank " << rank;
      EXPECT_TRUE(m.step());  // second good step: growth after loss_scale_steps = 2
      EXPECT_DOUBLE_EQ(m.loss_scale(), 1024) << "rank " << rank;
      EXPECT_FALSE(at::equal(p, at::full({6}, 1.0)));
      // An inf on the last rank only, in a half-precision gradient.
      at::Tensor h = at::zeros({0}, at::kBFloat16).requires_grad_(true);
      std::vector<at::Tensor> params = {p, h};
      p.mutable_grad() = at::ones({6});
      if (rank == bmt::world_size() - 1) p.mutable_grad()[0] = std::numeric_limits<float>::quiet_NaN();
      EXPECT_EQ(bmt::optim::grads_have_inf_nan(params, bmt::config().comm.get()), true);
      bmt::forget_param(p);
    });
  }
}

TEST(OptimManagerMultiRank, ClipGradNormOverUnequalShardsMatchesClosedForm) {
  for (int world : {1, 2, 3, 4}) {
    bmt::testing::run_ranks(world, [world] {
      const int rank = bmt::rank();
      const double scale = 16;
      std::vector<int64_t> sizes = shard_sizes(world);
      int64_t n = 0, offset = 0;
      for (int64_t s : sizes) n += s;
      for (int r = 0; r < rank; ++r) offset += sizes[r];
      at::Tensor full = full_vector(n);
      at::Tensor replicated_grad = at::tensor({3.0f, -12.0f});  // same on every rank
      // Closed forms over the unsharded data (the replicated vector counted once).
      double sumsq = full.to(at::kDouble).square().sum().item<double>() + 9 + 144;
      double two_norm = std::sqrt(sumsq);
      double inf_norm = std::max(full.abs().max().item<double>(), 12.0);

      at::Tensor shard = at::zeros({sizes[rank]}).requires_grad_(true);
      bmt::set_replication(shard, 1);
      at::Tensor rep = at::zeros({2}).requires_grad_(true);  // replication defaults to the world size
      auto opt = std::make_shared<AdamOptimizer>(std::vector<at::Tensor>{shard, rep});
      OptimManager m(scaled(scale));
      m.add_optimizer(opt);
      auto set_grads = [&] {
        shard.mutable_grad() = full.narrow(0, offset, sizes[rank]) * scale;
        rep.mutable_grad() = replicated_grad * scale;
      };
      set_grads();
      EXPECT_NEAR(m.clip_grad_norm(1e6), two_norm, 1e-5 * two_norm) << "world " << world << " rank " << rank;
      EXPECT_NEAR(m.clip_grad_norm(1e6, INFINITY), inf_norm, 1e-6) << "world " << world;
      // Clipping to half the norm scales every shard by the same factor.
      EXPECT_NEAR(m.clip_grad_norm(two_norm / 2, 2.0, 0.0), two_norm, 1e-5 * two_norm);
      EXPECT_NEAR(m.clip_grad_norm(1e6), two_norm / 2, 1e-5 * two_norm);
      EXPECT_TRUE(at::allclose(rep.grad(), replicated_grad * scale / 2));
      bmt::forget_param(shard);
    });
  }
}

TEST(OptimManagerMultiRank, TensorParallelReplicasCountOnce) {
  // World 4 = 2 data shards x 2 copies: ranks 2k and 2k+1 hold the same half of a vector (replication 2).
  bmt::testing::run_ranks(4, [] {
    const int rank = bmt::rank();
    at::Tensor full = full_vector(10);
    at::Tensor p = at::zeros({5}).requires_grad_(true);
    bmt::set_replication(p, 2);
    p.mutable_grad() = full.narrow(0, (rank / 2) * 5, 5).clone();
    double expect = full.to(at::kDouble).norm().item<double>();
    EXPECT_NEAR(bmt::optim::global_grad_norm({p}, 2.0, bmt::config().comm.get()), expect, 1e-6 * expect);
    EXPECT_NEAR(bmt::optim::global_grad_norm({p}, 3.0, bmt::config().comm.get()),
                full.to(at::kDouble).abs().pow(3).sum().pow(1.0 / 3).item<double>(), 1e-5);
    bmt::forget_param(p);
  });
}
