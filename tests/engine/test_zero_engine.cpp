// ZeRO engine equivalence: the tiny model trained with sharded parameters (world 1-4, ZeRO-2/3, checkpointing
// on/off, with/without TransformerBlockList, gradient accumulation 1/3, reduce_op kSum and kAvg) gives the same
// losses and parameters as the unsharded model in plain LibTorch (bf16: test_zero_bf16.cpp). fp32 tolerance: 2e-5 relative on losses, 1e-5 absolute on
// parameters (different summation orders only).
#include <gtest/gtest.h>

#include "bmt/runtime/distributed.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/optim/adam.h"
#include "bmt/params/param_init.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/module_state.h"
#include "run_ranks.h"
#include "tiny_model.h"

#include <torch/nn/modules/linear.h>

namespace {

// init_parameters on torch's default generator (InitParametersOptions::torch_generator): the values
// tiny::reference_params reproduces. These tests check the engine against that reference, not the initialisers.
void init_like_reference(torch::nn::Module& model) {
  bmt::InitParametersOptions o;
  o.torch_generator = true;
  bmt::init_parameters(model, o);
}

constexpr uint64_t kSeed = 1234;
constexpr int kSteps = 4;
constexpr int64_t kBatch = 36, kSeq = 4;
constexpr double kLr = 0.5;

struct Config {
  int zero;
  bool ckpt, list;
  int accum;
  bool avg = false;  // BlockOptions::reduce_op = kAvg
};

at::Tensor batch_tokens(int step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return at::randint(0, 16, {kBatch, kSeq + 1}, g, at::TensorOptions().dtype(at::kLong));
}

// Reference: plain LibTorch, full batch, SGD.
std::vector<std::map<std::string, at::Tensor>> g_ref_snapshots;  // parameters after each step

std::vector<double> reference_run(const tiny::Dims& d, std::map<std::string, at::Tensor>& final_params) {
  g_ref_snapshots.clear();
  auto plist = tiny::reference_params(d, kSeed);
  std::map<std::string, at::Tensor> P(plist.begin(), plist.end());
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    at::Tensor tok = batch_tokens(s);
    at::Tensor logits = tiny::reference_logits(d, P, tok.narrow(1, 0, kSeq));
    at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1}));
    loss.backward();
    losses.push_back(loss.item<double>());
    at::NoGradGuard ng;
    for (auto& kv : P) {
      kv.second.sub_(kLr * kv.second.grad());
      kv.second.mutable_grad().zero_();
    }
    std::map<std::string, at::Tensor> snap;
    for (auto& kv : P) snap[kv.first] = kv.second.detach().clone();
    g_ref_snapshots.push_back(snap);
  }
  final_params = P;
  return losses;
}

void run_config(const Config& c, const std::vector<double>& ref_losses, std::map<std::string, at::Tensor>& ref_params) {
  const auto& cfg = bmt::config();
  tiny::Dims d;
  bmt::BlockOptions opts;
  opts.zero_level = c.zero;
  opts.use_checkpoint = c.ckpt;
  if (c.avg) opts.reduce_op = bmt::core::ReduceOp::kAvg;
  tiny::Model model(d, opts, c.list);
  at::manual_seed(kSeed);
  init_like_reference(model);
  const int W = cfg.world_size;
  const int64_t micro = kBatch / c.accum;
  const int64_t per_rank = micro / W;
  for (int s = 0; s < kSteps; ++s) {
    at::Tensor tok = batch_tokens(s);
    double step_loss = 0;
    for (int a = 0; a < c.accum; ++a) {
      std::optional<bmt::GradSyncGuard> defer;
      if (a + 1 < c.accum) defer.emplace();  // reduce once, at the last micro-batch
      at::Tensor mine = tok.narrow(0, a * micro + cfg.rank * per_rank, per_rank);
      at::Tensor logits = model.forward(mine.narrow(1, 0, kSeq));
      at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, d.vocab}), mine.narrow(1, 1, kSeq).reshape({-1}));
      at::Tensor scaled = loss / (W * c.accum);
      // kAvg: the Blocks' reduction divides by W, so the loss is divided by the accumulation count only.
      (c.avg ? loss / c.accum : scaled).backward();
      step_loss += bmt::distributed::all_reduce(scaled.detach(), bmt::core::ReduceOp::kSum, *cfg.comm).item<double>();
    }
    EXPECT_NEAR(step_loss, ref_losses[s], 2e-5 * std::abs(ref_losses[s]))
        << "step " << s << " zero " << c.zero << " ckpt " << c.ckpt << " list " << c.list << " accum " << c.accum
        << " avg " << c.avg;
    at::NoGradGuard ng;
    for (auto& p : model.parameters()) {
      at::Tensor g = bmt::main_grad(p);
      ASSERT_TRUE(g.defined());
      // reduce_op is a Block option: outside Blocks gradients are summed over ranks, hence 1/W under kAvg.
      const bool outside = bmt::meta_of(p).block == nullptr;
      p.sub_((c.avg && outside ? kLr / W : kLr) * g);
      g.zero_();
    }
    auto sd = bmt::state_dict(model);  // parameters after every step, not only at the end
    for (auto& kv : g_ref_snapshots[s])
      EXPECT_LT((sd[kv.first] - kv.second).abs().max().item<double>(), 1e-5) << "after step " << s << ": " << kv.first;
  }
  auto sd = bmt::state_dict(model);
  ASSERT_EQ(sd.size(), ref_params.size());
  for (auto& kv : ref_params) {
    ASSERT_TRUE(sd.count(kv.first)) << kv.first;
    EXPECT_LT((sd[kv.first] - kv.second.detach()).abs().max().item<double>(), 1e-5)
        << kv.first << " zero " << c.zero << " ckpt " << c.ckpt << " list " << c.list << " accum " << c.accum
        << " avg " << c.avg;
  }
}

std::vector<Config> all_configs() {
  std::vector<Config> out;
  for (int zero : {2, 3})
    for (bool ckpt : {true, false})
      for (bool list : {true, false})
        for (int accum : {1, 3}) out.push_back({zero, ckpt, list, accum});
  for (int zero : {2, 3})
    for (bool ckpt : {true, false}) out.push_back({zero, ckpt, true, 3, /*avg=*/true});
  return out;
}

}  // namespace

class ZeroEquivalence : public ::testing::TestWithParam<int> {};

TEST_P(ZeroEquivalence, MatchesUnshardedLibTorch) {
  const int world = GetParam();
  bmt::testing::run_ranks(world, [] {
    tiny::Dims d;
    std::map<std::string, at::Tensor> ref_params;
    auto ref_losses = reference_run(d, ref_params);
    for (const Config& c : all_configs()) run_config(c, ref_losses, ref_params);
  });
}
INSTANTIATE_TEST_SUITE_P(World, ZeroEquivalence, ::testing::Values(1, 2, 3, 4));

TEST(ZeroEngine, InitParametersBitIdenticalAndKeys) {
  bmt::testing::run_ranks(3, [] {
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    at::manual_seed(kSeed);
    init_like_reference(model);
    auto sd = bmt::state_dict(model);
    auto ref = tiny::reference_params(d, kSeed);
    ASSERT_EQ(sd.size(), ref.size());
    for (auto& kv : ref) {
      ASSERT_TRUE(sd.count(kv.first)) << "missing key " << kv.first;
      EXPECT_TRUE(at::equal(sd[kv.first], kv.second.detach())) << kv.first << " differs";
    }
    // Round trip: perturb, load the saved dict back, compare.
    tiny::Model other(d, {}, false);
    bmt::load_state_dict(other, sd);
    auto sd2 = bmt::state_dict(other);
    for (auto& kv : sd) EXPECT_TRUE(at::equal(kv.second, sd2[kv.first])) << kv.first;
  });
}

TEST(ZeroEngine, LoadStateDictErrorsListEverything) {
  bmt::testing::run_ranks(2, [] {
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    auto sd = bmt::state_dict(model);
    sd.erase("ln_f.bias");
    sd["extra.weight"] = at::zeros({2});
    sd["embed.weight"] = at::zeros({3, 3});
    try {
      bmt::load_state_dict(model, sd, true);
      ADD_FAILURE() << "expected an error";
    } catch (const bmt::core::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("ln_f.bias"), std::string::npos) << msg;
      EXPECT_NE(msg.find("extra.weight"), std::string::npos) << msg;
      EXPECT_NE(msg.find("embed.weight"), std::string::npos) << msg;
    }
    sd.erase("embed.weight");
    auto r = bmt::load_state_dict(model, sd, false);
    EXPECT_EQ(r.missing_keys.size(), 2u);
    EXPECT_EQ(r.unexpected_keys.size(), 1u);
  });
}

TEST(ZeroEngine, MemoryBoundsShardsAndGathered) {
  for (int world : {1, 2, 4}) {
    bmt::testing::run_ranks(world, [world] {
      tiny::Dims d;
      d.layers = 6;
      d.dim = 64;
      d.ff = 256;
      auto before = bmt::memory_stats();
      tiny::Model model(d, {}, true, /*prefetch_depth=*/1);
      auto after = bmt::memory_stats();
      int64_t block_param_nbytes = 0;
      for (auto& b : model.list->blocks())
        for (auto& p : b->module()->parameters()) block_param_nbytes += bmt::meta_of(p).full_numel * 4;
      const int64_t shard = after.shard_nbytes - before.shard_nbytes;
      // 1/W of the model, plus at most one 512-byte alignment gap per parameter and the partition round-up.
      const int64_t slack = 6 * 6 * 512 + 6 * 4 * world;
      EXPECT_LE(shard, block_param_nbytes / world + slack);
      EXPECT_GE(shard, block_param_nbytes / world);
      int64_t one_block_full = model.list->blocks()[0]->shard_nbytes() * world;
      bmt::reset_peak_memory_stats();
      at::Tensor ids = at::randint(0, d.vocab, {2, 4}, at::TensorOptions().dtype(at::kLong));
      at::Tensor loss = model.forward(ids).sum();
      loss.backward();
      auto st = bmt::memory_stats();
      EXPECT_LE(st.gathered_peak_nbytes, 2 * one_block_full) << "more than depth+1 blocks gathered at once";
      if (world == 1) EXPECT_EQ(st.gathered_peak_nbytes, 0) << "one rank: the shard is the gathered buffer";
      else EXPECT_GE(st.gathered_peak_nbytes, one_block_full);
      EXPECT_EQ(st.gathered_nbytes, 0) << "gathered buffers leaked after the step";
    });
  }
}

// ZeRO-3 without checkpointing: autograd keeps views of the gathered weights from forward to backward. Their
// storage must hold no bytes in between (it is refilled before the block's backward), or every block's full
// parameters would stay alive until the backward, as under ZeRO-2.
TEST(ZeroEngine, Zero3WithoutCheckpointingFreesGatheredStorageAfterForward) {
  bmt::testing::run_ranks(2, [] {
    tiny::Dims d;
    d.layers = 3;
    bmt::BlockOptions opts;
    opts.zero_level = 3;
    opts.use_checkpoint = false;
    tiny::Model model(d, opts, true);
    bmt::init_parameters(model);
    at::Tensor ids = at::randint(0, d.vocab, {2, 4}, at::TensorOptions().dtype(at::kLong));
    at::Tensor loss = model.forward(ids).sum();
    for (auto& b : model.list->blocks()) EXPECT_EQ(b->gathered_storage_nbytes(), 0) << "after forward";
    loss.backward();  // the saved views are read again: the storage was refilled (results: ZeroEquivalence)
    for (auto& b : model.list->blocks()) EXPECT_EQ(b->gathered_storage_nbytes(), 0) << "after backward";
    // ZeRO-2 keeps them from forward to backward by design.
    opts.zero_level = 2;
    tiny::Model kept(d, opts, true);
    bmt::init_parameters(kept);
    at::Tensor loss2 = kept.forward(ids).sum();
    for (auto& b : kept.list->blocks()) EXPECT_GT(b->gathered_storage_nbytes(), 0);
    loss2.backward();
  });
}

TEST(ZeroEngine, BadInputErrors) {
  bmt::testing::run_ranks(2, [] {
    tiny::Dims d;
    auto layer = tiny::MlpLayer(d);
    auto b1 = bmt::make_block(layer.ptr());
    EXPECT_THROW(bmt::make_block(layer.ptr()), bmt::core::Error);  // wrapped twice / shared parameters
    auto layer2 = tiny::MlpLayer(d);
    bmt::BlockOptions bad;
    bad.zero_level = 1;
    EXPECT_THROW(bmt::make_block(layer2.ptr(), bad), bmt::core::Error);
    bad.zero_level = 4;
    EXPECT_THROW(bmt::make_block(layer2.ptr(), bad), bmt::core::Error);
    auto plain = torch::nn::Linear(2, 2);
    EXPECT_THROW(bmt::make_block(plain.ptr()), bmt::core::Error);  // plain parameters inside a Block
  });
}

TEST(ZeroEngine, InferenceAndFrozenParameters) {
  bmt::testing::run_ranks(2, [] {
    tiny::Dims d;
    tiny::Model model(d, {}, true);
    at::manual_seed(kSeed);
    bmt::init_parameters(model);
    at::Tensor ids = at::randint(0, d.vocab, {2, 4}, at::TensorOptions().dtype(at::kLong));
    at::Tensor with_grad = model.forward(ids);
    at::Tensor no_grad;
    {
      at::NoGradGuard g;
      no_grad = model.forward(ids);
    }
    EXPECT_TRUE(at::allclose(with_grad.detach(), no_grad));
    EXPECT_EQ(bmt::memory_stats().gathered_nbytes, 0);
    // Freeze the embedding: the first block then has no input requiring grad but its parameters still learn.
    model.embed->weight.requires_grad_(false);
    for (auto& p : model.parameters()) bmt::main_grad(p).defined() ? (void)bmt::main_grad(p).zero_() : (void)0;
    model.forward(ids).sum().backward();
    auto& fc1 = model.list->blocks()[0]->module();
    double gsum = 0;
    for (auto& p : fc1->parameters()) gsum += bmt::main_grad(p).abs().sum().item<double>();
    gsum = bmt::distributed::all_reduce(at::tensor({gsum}), bmt::core::ReduceOp::kSum, *bmt::config().comm).item<double>();
    EXPECT_GT(gsum, 0.0);
    // An optimizer step over every parameter leaves the frozen one bit-identical and moves the others.
    auto before = bmt::state_dict(model);
    bmt::optim::AdamOptimizer opt(model.parameters(), bmt::optim::AdamOptions(1e-2));
    opt.step(1.0);
    auto after = bmt::state_dict(model);
    EXPECT_TRUE(at::equal(after["embed.weight"], before["embed.weight"])) << "a frozen parameter changed";
    EXPECT_FALSE(bmt::main_grad(model.embed->weight).defined() &&
                 bmt::main_grad(model.embed->weight).abs().sum().item<double>() > 0)
        << "a frozen parameter received a gradient";
    for (const char* key : {"layers.0.fc1.weight", "layers.2.fc2.bias", "ln_f.weight"})
      EXPECT_FALSE(at::equal(after[key], before[key])) << key << " did not take the step";
  });
}

TEST(ZeroEngine, GradientsMatchReference) {
  bmt::testing::run_ranks(1, [] {
    tiny::Dims d;
    auto plist = tiny::reference_params(d, kSeed);
    std::map<std::string, at::Tensor> P(plist.begin(), plist.end());
    at::Tensor tok = batch_tokens(0);
    at::Tensor logits = tiny::reference_logits(d, P, tok.narrow(1, 0, kSeq));
    at::cross_entropy_loss(logits.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1})).backward();
    tiny::Model model(d, {}, true);
    at::manual_seed(kSeed);
    init_like_reference(model);
    at::Tensor l2 = model.forward(tok.narrow(1, 0, kSeq));
    at::cross_entropy_loss(l2.reshape({-1, d.vocab}), tok.narrow(1, 1, kSeq).reshape({-1})).backward();
    for (auto& item : model.named_parameters()) {
      at::Tensor g = bmt::main_grad(item.value());
      at::Tensor ref = P[item.key()].grad().reshape({-1});
      EXPECT_LT((g - ref).abs().max().item<double>(), 1e-6) << item.key() << " ours " << g.norm().item<double>()
                                                             << " ref " << ref.norm().item<double>();
    }
  });
}
