// bmt::inspect against plain LibTorch statistics of the unsharded tensors: inspect_model over ZeRO shards (worlds
// 1, 2, 4) and tensor-parallel pieces (tp 2 at worlds 2 and 4); record_tensor inside Blocks with and without
// activation checkpointing (recorded once per forward, gradients from the recompute); format_summary and the glob
// pattern against closed forms.
#include <gtest/gtest.h>

#include "bmt/runtime/distributed.h"
#include "bmt/engine/inspect.h"
#include "bmt/params/module_state.h"
#include "bmt/nn/layers.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "full_grad.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace {

constexpr uint64_t kSeed = 77;
constexpr int64_t kBatch = 8, kSeq = 3;

// Population statistics of a whole tensor, the reference for every row.
void expect_stats(const bmt::inspect::TensorStats& s, const at::Tensor& value, const at::Tensor& grad,
                  const std::string& what, bool check_grad = true) {
  at::Tensor v = value.detach().to(at::kDouble);
  const double tol = 1e-6;
  auto near = [&](double got, double want, const char* stat) {
    EXPECT_NEAR(got, want, tol * std::max(1.0, std::abs(want))) << what << " " << stat;
  };
  near(s.mean, v.mean().item<double>(), "mean");
  near(s.std, v.std(/*unbiased=*/false).item<double>(), "std");
  near(s.min, v.min().item<double>(), "min");
  near(s.max, v.max().item<double>(), "max");
  if (!check_grad) return;
  if (!grad.defined()) {
    EXPECT_FALSE(s.grad_mean.has_value()) << what;
    return;
  }
  ASSERT_TRUE(s.grad_mean && s.grad_std && s.grad_min && s.grad_max) << what << ": no gradient statistics";
  at::Tensor g = grad.detach().to(at::kDouble);
  near(*s.grad_mean, g.mean().item<double>(), "grad_mean");
  near(*s.grad_std, g.std(false).item<double>(), "grad_std");
  near(*s.grad_min, g.min().item<double>(), "grad_min");
  near(*s.grad_max, g.max().item<double>(), "grad_max");
}

at::Tensor tokens() {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(5);
  return at::randint(0, 16, {kBatch, kSeq + 1}, g, at::TensorOptions().dtype(at::kLong));
}

class InspectModelWorld : public ::testing::TestWithParam<int> {};

TEST_P(InspectModelWorld, ShardedStatisticsEqualTheUnshardedTensors) {
  bmt::testing::run_ranks(GetParam(), [] {
    const auto& cfg = bmt::config();
    tiny::Dims d;
    bmt::BlockOptions opts;
    tiny::Model model(d, opts, /*use_list=*/true);
    at::manual_seed(kSeed);
    bmt::init_parameters(model);
    // Before any backward: values only.
    auto before = bmt::inspect::inspect_model(model);
    auto sd = bmt::state_dict(model);
    ASSERT_EQ(before.size(), sd.size());
    for (auto& s : before) expect_stats(s, sd.at(s.name), at::Tensor(), s.name + " (before backward)", false);

    const int64_t per_rank = kBatch / cfg.world_size;
    at::Tensor mine = tokens().narrow(0, cfg.rank * per_rank, per_rank);
    at::Tensor logits = model.forward(mine.narrow(1, 0, kSeq));
    (at::cross_entropy_loss(logits.reshape({-1, d.vocab}), mine.narrow(1, 1, kSeq).reshape({-1})) / cfg.world_size)
        .backward();
    auto rows = bmt::inspect::inspect_model(model);
    ASSERT_EQ(rows.size(), sd.size());
    for (auto& s : rows) {
      ASSERT_TRUE(sd.count(s.name)) << s.name;
      // By value: named_parameters() returns a temporary dict, a reference into it would dangle.
      const at::Tensor p = [&]() -> at::Tensor {
        for (auto& item : model.named_parameters()) if (item.key() == s.name) return item.value();
        throw std::runtime_error("no parameter " + s.name);
      }();
      EXPECT_EQ(s.shape, sd.at(s.name).sizes().vec()) << s.name;
      expect_stats(s, sd.at(s.name), bmt::testing::full_main_grad(p), s.name);
    }
    auto fc1 = bmt::inspect::inspect_model(model, "layers.*.fc1.*");
    ASSERT_EQ(fc1.size(), static_cast<size_t>(2 * d.layers));
    for (auto& s : fc1) EXPECT_NE(s.name.find(".fc1."), std::string::npos) << s.name;
  });
}
INSTANTIATE_TEST_SUITE_P(World, InspectModelWorld, ::testing::Values(1, 2, 4));

class InspectModelTp : public ::testing::TestWithParam<int> {};

TEST_P(InspectModelTp, TensorParallelPiecesCombineOverTheTpGroup) {
  bmt::InitOptions o = bmt::testing::test_init();
  o.tp_size = 2;
  bmt::testing::run_ranks(GetParam(), [] {
    at::manual_seed(kSeed);
    auto split0 = bmt::TensorParallelParameter({6, 5}, 0, at::kFloat, bmt::init::normal(0.5, 2.0));
    auto split1 = bmt::TensorParallelParameter({3, 8}, 1, at::kFloat, bmt::init::uniform(-1.0, 3.0));
    auto replicated = bmt::DistributedParameter({7}, at::kFloat, bmt::init::normal(0.0, 1.0));
    torch::nn::Module holder;
    holder.register_parameter("split0", split0);
    holder.register_parameter("split1", split1);
    holder.register_parameter("replicated", replicated);
    bmt::init_parameters(holder);
    // Gradients: set each shard to a known function of the element's logical position is not needed: give every
    // main_grad shard the value of its parameter shard times 3, so the gradient statistics are 3x the value's.
    for (auto& p : {split0, split1, replicated}) bmt::set_main_grad(p, p.detach().to(at::kFloat) * 3);
    auto rows = bmt::inspect::inspect_model(holder);
    ASSERT_EQ(rows.size(), 3u);
    for (auto& s : rows) {
      at::Tensor full = bmt::gather_logical(*holder.named_parameters().find(s.name));
      EXPECT_EQ(s.shape, full.sizes().vec()) << s.name;
      expect_stats(s, full, full * 3, s.name);
    }
  }, o);
}
INSTANTIATE_TEST_SUITE_P(World, InspectModelTp, ::testing::Values(2, 4));

// A residual MLP layer that records its output, as a user's forward would.
struct RecLayerImpl : torch::nn::Module {
  explicit RecLayerImpl(int64_t dim)
      : fc1(register_module("fc1", bmt::nn::Linear(dim, 2 * dim, true))),
        fc2(register_module("fc2", bmt::nn::Linear(2 * dim, dim, true))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x + fc2->forward(at::tanh(fc1->forward(x)));
    bmt::inspect::record_tensor(y, "hidden", "layers");
    return y;
  }
  bmt::nn::Linear fc1, fc2;
};
TORCH_MODULE(RecLayer);

void run_record(bool checkpoint) {
  const auto& cfg = bmt::config();
  const int64_t dim = 4, layers = 3;
  bmt::BlockOptions opts;
  opts.use_checkpoint = checkpoint;
  std::vector<RecLayer> inner;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  torch::nn::Module holder;
  for (int64_t i = 0; i < layers; ++i) {
    inner.emplace_back(dim);
    holder.register_module(std::to_string(i), inner.back().ptr());
    blocks.push_back(bmt::make_block(inner.back().ptr(), opts));
  }
  at::manual_seed(kSeed);
  bmt::init_parameters(holder);
  auto sd = bmt::state_dict(holder);

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor x_all = at::randn({kBatch, kSeq, dim}, gen);
  const int64_t per_rank = kBatch / cfg.world_size;
  // Reference: the same layers on the whole batch in plain LibTorch, the hidden states' gradients kept.
  std::vector<at::Tensor> ref_h;
  at::Tensor h = x_all.clone().requires_grad_(true);
  for (int64_t i = 0; i < layers; ++i) {
    const std::string L = std::to_string(i) + ".";
    h = h + at::linear(at::tanh(at::linear(h, sd[L + "fc1.weight"], sd[L + "fc1.bias"])), sd[L + "fc2.weight"],
                       sd[L + "fc2.bias"]);
    h.retain_grad();
    ref_h.push_back(h);
  }
  (h * h).sum().backward();

  bmt::inspect::InspectTensor scope;
  at::Tensor y = x_all.narrow(0, cfg.rank * per_rank, per_rank).clone().requires_grad_(true);
  for (auto& b : blocks) y = b->forward(y);
  (y * y).sum().backward();
  EXPECT_EQ(scope.size(), static_cast<size_t>(layers)) << "recorded once per forward (checkpoint " << checkpoint << ")";
  auto summary = scope.summary();
  ASSERT_EQ(summary.size(), static_cast<size_t>(layers));
  for (int64_t i = 0; i < layers; ++i) {
    const auto& s = summary[static_cast<size_t>(i)];
    EXPECT_EQ(s.name, "layers." + std::to_string(i) + ".hidden");
    EXPECT_EQ(s.shape, (std::vector<int64_t>{kBatch, kSeq, dim}));
    expect_stats(s, ref_h[static_cast<size_t>(i)], ref_h[static_cast<size_t>(i)].grad(),
                 s.name + (checkpoint ? " (checkpointed)" : ""));
  }
  at::Tensor mine_ref = ref_h[1].narrow(0, cfg.rank * per_rank, per_rank);
  EXPECT_TRUE(at::allclose(scope.get_tensor("hidden", "layers", 1), mine_ref, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(scope.get_grad("hidden", "layers", 1), ref_h[1].grad().narrow(0, cfg.rank * per_rank, per_rank),
                           1e-5, 1e-6));
  const std::string table = bmt::inspect::format_summary(summary);
  EXPECT_NE(table.find("layers.2.hidden"), std::string::npos) << table;
}

class RecordTensor : public ::testing::TestWithParam<int> {};

TEST_P(RecordTensor, InsideBlocksWithAndWithoutCheckpointing) {
  bmt::testing::run_ranks(GetParam(), [] {
    run_record(/*checkpoint=*/true);
    run_record(/*checkpoint=*/false);
    // Outside a scope record_tensor does nothing; a parameter is refused.
    bmt::inspect::record_tensor(at::ones({2}), "ignored");
    bmt::inspect::InspectTensor scope;
    auto p = bmt::DistributedParameter({2}, at::kFloat, bmt::init::ones());
    EXPECT_THROW(bmt::inspect::record_tensor(p, "w"), bmt::core::Error);
    EXPECT_EQ(scope.size(), 0u);
  });
}
INSTANTIATE_TEST_SUITE_P(World, RecordTensor, ::testing::Values(1, 2, 4));

TEST(InspectFormat, TableAsBMTrainPrintsIt) {
  bmt::inspect::TensorStats a;
  a.name = "w";
  a.shape = {3};
  a.mean = 0.5;
  a.std = 0.25;
  a.min = -1;
  a.max = 2.0;
  bmt::inspect::TensorStats b = a;
  b.name = "layer.bias";
  b.shape = {2, 3};
  b.grad_mean = 0.125;
  b.grad_std = 1.0;
  const std::string want =
      "name           shape                       max        min        std       mean   grad_std  grad_mean\n"
      "w              (3,)                     2.0000    -1.0000     0.2500     0.5000                      \n"
      "layer.bias     (2, 3)                   2.0000    -1.0000     0.2500     0.5000     1.0000     0.1250";
  EXPECT_EQ(bmt::inspect::format_summary({a, b}), want);
}

TEST(InspectFormat, GlobPattern) {
  using bmt::inspect::detail::glob_match;
  EXPECT_TRUE(glob_match("*", "a.b.c"));
  EXPECT_TRUE(glob_match("layers.*.weight", "layers.0.fc.weight"));
  EXPECT_FALSE(glob_match("layers.*.weight", "layers.0.fc.bias"));
  EXPECT_TRUE(glob_match("layers.?.w", "layers.7.w"));
  EXPECT_FALSE(glob_match("layers.?.w", "layers.17.w"));
  EXPECT_TRUE(glob_match("l[0-3]", "l2"));
  EXPECT_FALSE(glob_match("l[!0-3]", "l2"));
  EXPECT_TRUE(glob_match("*bias", "bias"));
  EXPECT_FALSE(glob_match("", "x"));
}

}  // namespace
