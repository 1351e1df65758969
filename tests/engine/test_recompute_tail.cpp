// The recompute's tail (recompute_keep.h, BMT_RECOMPUTE_SKIP_TAIL): in a checkpointed Block's recompute the
// layer's output only roots the backward, so its fused MLP may skip c_proj's GEMM (compute_output = false, as the
// C++ GPT passes). skip_block_outputs_now() is true exactly in the recompute with the switch on; the loss and every
// gradient equal those of the same Blocks with the switch off and without checkpointing, bit for bit (the CPU twin
// of the epilogue GEMMs is deterministic). The same for the FP8 MLP of the C++ GPT's --fp8 layers (nn::fp8_linear
// with compute_output = false: no forward GEMM, no weight cast), per-tensor and rowwise.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "bmt/engine/block.h"
#include "bmt/engine/recompute_keep.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/layers.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"
#include "bmt/runtime/init.h"
#include "run_ranks.h"

namespace {

constexpr int64_t kDim = 8, kHidden = 24, kLayers = 3;

struct MlpLayerImpl : torch::nn::Module {
  MlpLayerImpl()
      : fc(register_module("fc", bmt::nn::Linear(kDim, kHidden, true))),
        proj(register_module("proj", bmt::nn::Linear(kHidden, kDim, true))) {}
  at::Tensor forward(const at::Tensor& x) {
    const bool skip = bmt::skip_block_outputs_now();
    (at::GradMode::is_enabled() ? skips_in_graph_runs : skips_elsewhere) += skip ? 1 : 0;
    return bmt::nn::gelu_mlp_fused(x, bmt::gathered(fc->weight), bmt::gathered(fc->bias), bmt::gathered(proj->weight),
                                   bmt::gathered(proj->bias), x, !skip);
  }
  bmt::nn::Linear fc, proj;
  int skips_in_graph_runs = 0, skips_elsewhere = 0;
};
TORCH_MODULE(MlpLayer);

// The FP8 layers' MLP (examples/models/gpt.cpp): FP8 GEMMs, GELU and the residual add separate. Every GEMM
// dimension a multiple of 16 (rows: 2 x 8), else fp8_linear falls back to the bf16 path.
struct Fp8MlpLayerImpl : torch::nn::Module {
  explicit Fp8MlpLayerImpl(bmt::nn::Fp8Scaling scaling)
      : fc(register_module("fc", bmt::nn::Linear(16, 32, true))),
        proj(register_module("proj", bmt::nn::Linear(32, 16, true))),
        scaling(scaling) {}
  at::Tensor forward(const at::Tensor& x) {
    const bool skip = bmt::skip_block_outputs_now();
    (at::GradMode::is_enabled() ? skips_in_graph_runs : skips_elsewhere) += skip ? 1 : 0;
    const auto e5m2 = bmt::nn::Fp8Format::kE5M2;
    const at::Tensor h = at::gelu(
        bmt::nn::fp8_linear(x, bmt::gathered(fc->weight), bmt::gathered(fc->bias), e5m2, scaling), "tanh");
    return x + bmt::nn::fp8_linear(h, bmt::gathered(proj->weight), bmt::gathered(proj->bias), e5m2, scaling, !skip);
  }
  bmt::nn::Linear fc, proj;
  bmt::nn::Fp8Scaling scaling;
  int skips_in_graph_runs = 0, skips_elsewhere = 0;
};
TORCH_MODULE(Fp8MlpLayer);

struct Result {
  std::vector<at::Tensor> values;  // loss, input gradient, every parameter's gradient
  int skips_in_graph_runs = 0, skips_elsewhere = 0;
};

template <typename Layer = MlpLayer>
Result run(bool checkpoint, bool skip_tail, std::function<Layer()> make = [] { return Layer(); },
           std::vector<int64_t> input = {2, 5, kDim}) {
  bmt::set_recompute_skip_tail_enabled(skip_tail);
  bmt::BlockOptions opts;
  opts.use_checkpoint = checkpoint;
  std::vector<Layer> layers;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  for (int64_t i = 0; i < kLayers; ++i) {
    layers.push_back(make());
    blocks.push_back(bmt::make_block(layers.back().ptr(), opts));
  }
  at::manual_seed(5);
  for (auto& b : blocks) bmt::init_parameters(*b->module());
  at::Tensor x = at::randn(input).requires_grad_(true);
  at::Tensor h = x;
  for (auto& b : blocks) h = b->forward(h);
  at::Tensor loss = h.pow(2).mean();
  loss.backward();
  bmt::set_recompute_skip_tail_enabled(false);
  Result r;
  r.values = {loss.detach(), x.grad()};
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (auto& p : blocks[i]->module()->parameters()) r.values.push_back(bmt::main_grad(p).clone());
    r.skips_in_graph_runs += layers[i]->skips_in_graph_runs;
    r.skips_elsewhere += layers[i]->skips_elsewhere;
  }
  return r;
}

}  // namespace

TEST(RecomputeTail, SkippedOutputsLeaveLossAndGradientsUnchanged) {
  bmt::testing::run_ranks(1, [] {
    EXPECT_FALSE(bmt::recompute_skip_tail_enabled()) << "off by default (BMT_RECOMPUTE_SKIP_TAIL unset)";
    const Result plain = run(/*checkpoint=*/false, /*skip_tail=*/true);
    const Result full = run(true, false);
    const Result skipped = run(true, true);
    EXPECT_EQ(plain.skips_in_graph_runs + plain.skips_elsewhere, 0) << "no recompute without checkpointing";
    EXPECT_EQ(full.skips_in_graph_runs + full.skips_elsewhere, 0) << "switched off";
    EXPECT_EQ(skipped.skips_in_graph_runs, kLayers) << "each layer's recompute, once";
    EXPECT_EQ(skipped.skips_elsewhere, 0) << "never in a first run";
    ASSERT_EQ(plain.values.size(), skipped.values.size());
    for (size_t i = 0; i < plain.values.size(); ++i) {
      EXPECT_TRUE(at::equal(plain.values[i], full.values[i])) << "checkpointing, value " << i;
      EXPECT_TRUE(at::equal(plain.values[i], skipped.values[i])) << "tail skipped, value " << i;
    }
  });
}

TEST(RecomputeTail, Fp8MlpSkipsItsLastGemmWithLossAndGradientsUnchanged) {
  bmt::testing::run_ranks(1, [] {
    for (auto scaling : {bmt::nn::Fp8Scaling::kTensor, bmt::nn::Fp8Scaling::kRow}) {
      const std::function<Fp8MlpLayer()> make = [scaling] { return Fp8MlpLayer(scaling); };
      const Result plain = run<Fp8MlpLayer>(false, true, make, {2, 8, 16});
      const Result skipped = run<Fp8MlpLayer>(true, true, make, {2, 8, 16});
      EXPECT_EQ(skipped.skips_in_graph_runs, kLayers) << "each layer's recompute, once";
      ASSERT_EQ(plain.values.size(), skipped.values.size());
      for (size_t i = 0; i < plain.values.size(); ++i)  // (the casts and GEMMs are deterministic on the CPU)
        EXPECT_TRUE(at::equal(plain.values[i], skipped.values[i])) << "tail skipped, value " << i;
    }
  });
}
