// Selective recomputation (recompute_keep.h) in checkpointed Blocks: an attention layer's nn::causal_attention keeps
// its output and log-sum-exp from the first run, so the backward's recompute calls the flash forward kernel no more
// (counted through torch's RecordFunction: one call per layer per step instead of two), and the loss and every
// gradient equal those of the same Blocks recomputing everything and of Blocks without checkpointing, bit for bit
// (CPU kernels are deterministic). BlockOptions::keep_for_recompute = false and the process switch turn it off; a
// recompute that meets another attention than the first run fails with a message instead of using wrong values.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "attention_test_util.h"
#include "bmt/engine/block.h"
#include "bmt/engine/block_list.h"
#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/nn/attention.h"
#include "bmt/nn/layers.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "bmt/engine/recompute_keep.h"
#include "run_ranks.h"

namespace {

constexpr int64_t kDim = 16, kHeads = 2, kLayers = 3, kBatch = 2, kSeq = 7;

struct AttnLayerImpl : torch::nn::Module {
  AttnLayerImpl()
      : qkv(register_module("qkv", bmt::nn::Linear(kDim, 3 * kDim, true))),
        proj(register_module("proj", bmt::nn::Linear(kDim, kDim, true))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    if (shorten_recompute && at::GradMode::is_enabled()) h = x.narrow(1, 0, x.size(1) - 1);  // the recompute only
    auto parts = qkv->forward(h).chunk(3, -1);
    auto heads = [](const at::Tensor& t) {
      return t.view({t.size(0), t.size(1), kHeads, kDim / kHeads}).transpose(1, 2);
    };
    at::Tensor y = bmt::nn::causal_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]));
    y = y.transpose(1, 2).reshape({h.size(0), h.size(1), kDim});
    return h + proj->forward(at::gelu(y, "tanh"));
  }
  bmt::nn::Linear qkv, proj;
  bool shorten_recompute = false;
};
TORCH_MODULE(AttnLayer);

struct Model {
  explicit Model(bmt::BlockOptions opts) {
    for (int64_t i = 0; i < kLayers; ++i) {
      layers.emplace_back();
      blocks.push_back(bmt::make_block(layers.back().ptr(), opts));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : blocks) h = b->forward(h);
    return h;
  }
  std::vector<AttnLayer> layers;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
};

struct Result {
  std::vector<at::Tensor> values;  // loss, input gradient, then every parameter's gradient
  int flash_forwards = 0;          // per step
};

Result run(bool checkpoint, bool keep, bmt::testing::OpCallCounter& flash_forwards) {
  bmt::BlockOptions opts;
  opts.use_checkpoint = checkpoint;
  opts.keep_for_recompute = keep;
  Model model(opts);
  at::manual_seed(21);
  for (auto& b : model.blocks) bmt::init_parameters(*b->module());
  at::Tensor x = at::randn({kBatch, kSeq, kDim}).requires_grad_(true);
  flash_forwards.reset();
  at::Tensor loss = model.forward(x).pow(2).mean();
  loss.backward();
  Result r;
  r.flash_forwards = flash_forwards.count();
  r.values.push_back(loss.detach());
  r.values.push_back(x.grad());
  for (auto& b : model.blocks)
    for (auto& p : b->module()->parameters()) r.values.push_back(bmt::main_grad(p).clone());
  return r;
}

void expect_identical(const Result& ref, const Result& got, const std::string& what) {
  ASSERT_EQ(ref.values.size(), got.values.size()) << what;
  for (size_t i = 0; i < ref.values.size(); ++i)
    EXPECT_TRUE(at::equal(ref.values[i], got.values[i])) << what << ": value " << i;
}

}  // namespace

TEST(KeepForRecompute, AttentionIsNotRecomputedAndGradientsAreUnchanged) {
  bmt::testing::run_ranks(1, [] {
    // The CPU flash forward kernel, on every thread (the recompute runs on autograd's).
    bmt::testing::OpCallCounter counter({"aten::_scaled_dot_product_flash_attention_for_cpu"});
    const Result plain = run(/*checkpoint=*/false, true, counter);
    const Result recompute_all = run(true, /*keep=*/false, counter);
    const Result kept = run(true, true, counter);
    EXPECT_EQ(plain.flash_forwards, kLayers);
    EXPECT_EQ(recompute_all.flash_forwards, 2 * kLayers);
    EXPECT_EQ(kept.flash_forwards, kLayers);
    expect_identical(plain, recompute_all, "checkpointing, recomputing everything");
    expect_identical(plain, kept, "checkpointing, attention kept");

    bmt::detail::set_keep_for_recompute_enabled(false);  // the process switch (BMT_KEEP_FOR_RECOMPUTE=0)
    const Result switched_off = run(true, true, counter);
    bmt::detail::set_keep_for_recompute_enabled(true);
    EXPECT_EQ(switched_off.flash_forwards, 2 * kLayers);
    expect_identical(plain, switched_off, "switched off");
  });
}

TEST(KeepForRecompute, ARecomputeThatMeetsAnotherAttentionFails) {
  bmt::testing::run_ranks(1, [] {
    Model model(bmt::BlockOptions{});
    for (auto& b : model.blocks) bmt::init_parameters(*b->module());
    model.layers[1]->shorten_recompute = true;
    at::Tensor x = at::randn({kBatch, kSeq, kDim}).requires_grad_(true);
    at::Tensor loss = model.forward(x).pow(2).mean();
    try {
      loss.backward();
      ADD_FAILURE() << "the recompute used an attention output of another shape";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("recompute met a different attention"), std::string::npos) << e.what();
    }
  });
}
