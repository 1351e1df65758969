// Sharded initialisation (bmt/param_init.h): a model with every built-in initialiser, tensor-parallel pieces (also
// a fused Q/K/V split), Block and standalone parameters, bf16 and fp32, and a custom init method, initialised at
// world 1, 2, 4 and dp 2 x tp 2. Each rank checks the gathered values against references computed here (built-ins:
// element by element from Philox's definition; the custom one: torch's generator after the same at::manual_seed),
// and rank 0 saves them: the parent then compares every world with world 1 bit for bit. A second test checks that
// Blocks allocate their gradient shards only when first needed, and InitParametersOptions::torch_generator.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bmt/engine/block.h"
#include "bmt/engine/block_list.h"
#include "bmt/core/philox.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/params/module_state.h"
#include "bmt/nn/layers.h"
#include "bmt/nn/parallel_layers.h"
#include "bmt/optim/adam.h"
#include "bmt/params/param_init.h"
#include "bmt/params/param_meta.h"
#include "run_ranks.h"

namespace {

constexpr uint64_t kSeed = 11;
constexpr int64_t kDim = 8;

void custom_normal(at::Tensor& t) { t.normal_(0.0, 1.0); }  // any function of the full tensor: torch's generator

struct Layer : torch::nn::Module {
  explicit Layer(bool tp_layers) {
    ln = register_module("ln", bmt::nn::LayerNorm(kDim, 1e-5, at::kFloat));
    fc = register_module("fc", bmt::nn::Linear(kDim, kDim, true, at::kFloat, bmt::init::normal(0.0, 1.0)));
    if (tp_layers) {
      qkv = register_module("qkv", bmt::nn::ColumnParallelLinear(kDim, 12, true, at::kBFloat16, false, true,
                                                                 bmt::init::normal(0.5, 2.0), 3));
      out = register_module("out", bmt::nn::RowParallelLinear(12, kDim, true, at::kFloat, false, false,
                                                              bmt::init::xavier_uniform(1.0)));
    }
    u = register_parameter("u", bmt::DistributedParameter({5, 7}, at::kFloat, bmt::init::uniform(-1.0, 3.0)));
    custom = register_parameter("custom", bmt::DistributedParameter({3, 5}, at::kFloat, custom_normal));
    // Values given at creation (only the last element nonzero: only the last rank holds any), no init method.
    at::Tensor v = at::zeros({2, 5});
    v[1][4] = 7.0;
    fixed = register_parameter("fixed", bmt::DistributedParameter(v));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc->forward(ln->forward(x)) * u.sum(); }
  bmt::nn::LayerNorm ln{nullptr};
  bmt::nn::Linear fc{nullptr};
  bmt::nn::ColumnParallelLinear qkv{nullptr};
  bmt::nn::RowParallelLinear out{nullptr};
  at::Tensor u, custom, fixed;
};

struct Model : torch::nn::Module {
  explicit Model(bool tp_layers) {
    if (tp_layers)
      embed = register_module("embed", bmt::nn::VPEmbedding(38, kDim, at::kFloat, bmt::init::normal(0.0, 1.0)));
    std::vector<std::shared_ptr<bmt::Block>> blocks;
    for (int i = 0; i < 2; ++i) {
      layer_modules.push_back(std::make_shared<Layer>(tp_layers));
      blocks.push_back(bmt::make_block(layer_modules.back()));
    }
    layers = register_module("layers", std::make_shared<bmt::TransformerBlockList>(blocks));
    head = register_parameter("head", bmt::DistributedParameter({7, 9}, at::kBFloat16, bmt::init::xavier_normal(2.0)));
  }
  bmt::nn::VPEmbedding embed{nullptr};
  std::vector<std::shared_ptr<Layer>> layer_modules;
  std::shared_ptr<bmt::TransformerBlockList> layers;
  at::Tensor head;
};

// The logical tensor of a built-in initialiser, element by element from the documented stream layout.
at::Tensor philox_reference(const std::string& name, at::IntArrayRef shape, at::ScalarType dtype,
                            bmt::core::RandomDist dist, double shift, double scale) {
  bmt::core::RandomStream s{dist, kSeed, bmt::core::stream_of_name(name.data(), name.size()), shift, scale};
  at::Tensor out = at::empty(shape, at::kDouble);
  double* p = out.data_ptr<double>();
  for (int64_t i = 0; i < out.numel(); ++i) {
    const uint64_t block = static_cast<uint64_t>(i) / 4;
    const auto w = bmt::core::philox4x32_10(
        {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(s.stream),
         static_cast<uint32_t>(s.stream >> 32)},
        {static_cast<uint32_t>(kSeed), 0u});
    auto unit = [&](int64_t k) { return (static_cast<double>(w[static_cast<size_t>(k)]) + 0.5) / 4294967296.0; };
    const int64_t lane = i % 4, first = lane & ~int64_t{1};
    double z = unit(lane);
    if (dist == bmt::core::RandomDist::kNormal) {
      const double r = std::sqrt(-2.0 * std::log(unit(first))), theta = 2.0 * M_PI * unit(first + 1);
      z = lane == first ? r * std::cos(theta) : r * std::sin(theta);
    }
    p[i] = shift + scale * z;
  }
  return out.to(at::kFloat).to(dtype);  // the generator rounds through float too
}

double xavier_std(at::IntArrayRef shape, double gain) { return gain * std::sqrt(2.0 / (shape[0] + shape[1])); }

// What every parameter of Model must hold after init_parameters with kSeed (custom ones after at::manual_seed(5)).
std::map<std::string, at::Tensor> expected_values(bool tp_layers) {
  using bmt::core::RandomDist;
  std::map<std::string, at::Tensor> e;
  at::manual_seed(5);
  if (tp_layers) e["embed.weight"] = philox_reference("embed.weight", {38, kDim}, at::kFloat, RandomDist::kNormal, 0, 1);
  for (int i = 0; i < 2; ++i) {
    const std::string L = "layers." + std::to_string(i) + ".";
    e[L + "ln.weight"] = at::ones({kDim});
    e[L + "ln.bias"] = at::zeros({kDim});
    e[L + "fc.weight"] = philox_reference(L + "fc.weight", {kDim, kDim}, at::kFloat, RandomDist::kNormal, 0, 1);
    e[L + "fc.bias"] = at::zeros({kDim});
    if (tp_layers) {
      e[L + "qkv.weight"] = philox_reference(L + "qkv.weight", {12, kDim}, at::kBFloat16, RandomDist::kNormal, 0.5, 2);
      e[L + "qkv.bias"] = at::zeros({12}, at::kBFloat16);
      const double bound = std::sqrt(3.0) * xavier_std({kDim, 12}, 1.0);
      e[L + "out.weight"] = philox_reference(L + "out.weight", {kDim, 12}, at::kFloat, RandomDist::kUniform, -bound,
                                             2 * bound);
      e[L + "out.bias"] = at::zeros({kDim});
    }
    e[L + "u"] = philox_reference(L + "u", {5, 7}, at::kFloat, RandomDist::kUniform, -1, 4);
    at::Tensor c = at::empty({3, 5});
    custom_normal(c);  // in named_parameters order: the only custom parameter of each layer
    e[L + "custom"] = c;
    at::Tensor v = at::zeros({2, 5});
    v[1][4] = 7.0;
    e[L + "fixed"] = v;
  }
  e["head"] = philox_reference("head", {7, 9}, at::kBFloat16, RandomDist::kNormal, 0, xavier_std({7, 9}, 2.0));
  return e;
}

std::string shared_dir() {  // the parent's pid: the same in the parent and in its rank processes
  const int pid = bmt::testing::in_rank_process() ? static_cast<int>(getppid()) : static_cast<int>(getpid());
  return "/tmp/bmt_shard_init_" + std::to_string(pid);
}

void init_and_check(const std::string& tag) {
  Model model(/*tp_layers=*/true);
  at::manual_seed(5);
  bmt::init_parameters(model);
  bmt::StateDict sd = bmt::state_dict(model);
  const auto want = expected_values(true);
  ASSERT_EQ(sd.size(), want.size());
  std::vector<at::Tensor> values;
  for (const auto& [key, value] : want) {
    ASSERT_TRUE(sd.count(key)) << key;
    EXPECT_TRUE(at::equal(sd[key], value)) << tag << ": " << key << " differs from its reference";
    values.push_back(sd[key]);
  }
  if (bmt::rank() == 0) torch::save(values, shared_dir() + "/" + tag + ".pt");
}

bmt::InitOptions with_tp(int tp) {
  bmt::InitOptions o = bmt::testing::test_init();
  o.seed = kSeed;
  o.tp_size = tp;
  return o;
}

TEST(ShardInit, SameValuesAtEveryWorldAndTpSize) {
  if (!bmt::testing::in_rank_process()) ::mkdir(shared_dir().c_str(), 0700);
  bmt::testing::run_ranks(1, [] { init_and_check("w1"); }, with_tp(1));
  bmt::testing::run_ranks(2, [] { init_and_check("w2"); }, with_tp(1));
  bmt::testing::run_ranks(4, [] { init_and_check("w4"); }, with_tp(1));
  bmt::testing::run_ranks(4, [] { init_and_check("dp2tp2"); }, with_tp(2));
  if (bmt::testing::in_rank_process()) return;
  std::vector<at::Tensor> w1;
  torch::load(w1, shared_dir() + "/w1.pt");
  for (const char* tag : {"w2", "w4", "dp2tp2"}) {
    std::vector<at::Tensor> other;
    torch::load(other, shared_dir() + "/" + tag + ".pt");
    ASSERT_EQ(other.size(), w1.size()) << tag;
    for (size_t i = 0; i < w1.size(); ++i)
      EXPECT_TRUE(at::equal(other[i], w1[i]) && other[i].scalar_type() == w1[i].scalar_type()) << tag << " #" << i;
  }
  for (const char* tag : {"w1", "w2", "w4", "dp2tp2"}) std::remove((shared_dir() + "/" + tag + ".pt").c_str());
  ::rmdir(shared_dir().c_str());  // (std::filesystem resolves to libtorch's copy here and crashes)
}

TEST(ShardInit, BlockGradientsAllocatedOnFirstUse) {
  bmt::testing::run_ranks(2, [] {
    Model a(false), b(false);
    bmt::init_parameters(a);
    bmt::init_parameters(b);
    EXPECT_EQ(bmt::memory_stats().grad_nbytes, 0) << "no gradient shard before the first backward";
    bmt::optim::AdamOptimizer opt(a.parameters(), bmt::optim::AdamOptions(1e-3));
    opt.zero_grad();
    EXPECT_EQ(bmt::memory_stats().grad_nbytes, 0) << "zero_grad allocated gradient shards";
    // Reading a main gradient before any backward allocates zeros (its Block's shard only).
    at::Tensor g = bmt::main_grad(a.layer_modules[0]->fc->weight);
    ASSERT_TRUE(g.defined());
    EXPECT_EQ(g.numel(), a.layer_modules[0]->fc->weight.numel());
    EXPECT_TRUE(at::equal(g, at::zeros_like(g)));
    EXPECT_EQ(bmt::memory_stats().grad_nbytes, (*a.layers)[0].grad_nbytes());
    EXPECT_EQ((*a.layers)[1].grad_nbytes(), 0);
    // Backward: the same gradients whether the shard was allocated early (a) or by the reduction (b).
    at::manual_seed(9);
    at::Tensor x = at::randn({4, kDim});
    a.layers->forward(x).pow(2).sum().backward();
    b.layers->forward(x).pow(2).sum().backward();
    for (int i = 0; i < 2; ++i) {
      auto& la = *a.layer_modules[i];
      auto& lb = *b.layer_modules[i];
      for (auto pair : {std::make_pair(la.fc->weight, lb.fc->weight), std::make_pair(la.u, lb.u),
                        std::make_pair(la.ln->bias, lb.ln->bias)}) {
        at::Tensor ga = bmt::main_grad(pair.first), gb = bmt::main_grad(pair.second);
        ASSERT_TRUE(ga.defined() && gb.defined());
        EXPECT_TRUE(at::equal(ga, gb)) << "layer " << i;
      }
    }
    EXPECT_GT(bmt::memory_stats().grad_nbytes, 0);

    // (In the same ranks, to save a launch.) torch_generator: built-ins on the full tensor with torch's generator.
    auto fc = bmt::nn::Linear(6, 5, true, at::kFloat, bmt::init::normal(0.0, 0.3));
    bmt::InitParametersOptions o;
    o.torch_generator = true;
    at::manual_seed(3);
    bmt::init_parameters(*fc, o);
    at::manual_seed(3);
    at::Tensor w = at::empty({5, 6});
    w.normal_(0.0, 0.3);
    EXPECT_TRUE(at::equal(bmt::gather_full(fc->weight).view({5, 6}), w));
    EXPECT_TRUE(at::equal(bmt::gather_full(fc->bias), at::zeros({5})));
  }, with_tp(1));
}

}  // namespace
