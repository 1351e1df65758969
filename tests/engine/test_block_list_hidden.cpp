// TransformerBlockList with several hidden states (num_hidden = 2), an extra argument passed unchanged to every
// block, and return_hidden_states: outputs and gradients (parameters, both hidden inputs, the shared argument)
// equal plain LibTorch autograd over the unsharded weights, at worlds 1 and 2, ZeRO-2/3, checkpointing on/off,
// prefetch depth 0, 1 and 2. Also the memory bound of prefetching: at most depth + 1 blocks gathered at once.
#include <gtest/gtest.h>

#include "bmt/engine/block.h"
#include "bmt/engine/block_list.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/nn/layers.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/module_state.h"
#include "full_grad.h"
#include "run_ranks.h"
#include "tiny_model.h"

namespace {

using bmt::testing::full_main_grad;

constexpr int64_t kDim = 6, kLayers = 4, kRows = 5;

// Two streams that feed each other, scaled by a shared argument:
//   a' = a + fc_a(gelu(ln(b))) * scale,   b' = b + fc_b(tanh(a)).
struct TwoStreamImpl : torch::nn::Module {
  TwoStreamImpl()
      : ln(register_module("ln", bmt::nn::LayerNorm(kDim))),
        fc_a(register_module("fc_a", bmt::nn::Linear(kDim, kDim))),
        fc_b(register_module("fc_b", bmt::nn::Linear(kDim, kDim))) {}
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in) {
    const at::Tensor &a = in.at(0), &b = in.at(1), &scale = in.at(2);
    return {a + fc_a->forward(at::gelu(ln->forward(b))) * scale, b + fc_b->forward(at::tanh(a))};
  }
  bmt::nn::LayerNorm ln;
  bmt::nn::Linear fc_a, fc_b;
};

// The same math over plain tensors P["<layer>.<name>"].
std::vector<at::Tensor> reference_layer(std::map<std::string, at::Tensor>& P, int i, const at::Tensor& a,
                                        const at::Tensor& b, const at::Tensor& scale) {
  const std::string L = std::to_string(i) + ".";
  at::Tensor h = at::layer_norm(b, {kDim}, P[L + "ln.weight"], P[L + "ln.bias"], 1e-5);
  return {a + at::linear(at::gelu(h), P[L + "fc_a.weight"], P[L + "fc_a.bias"]) * scale,
          b + at::linear(at::tanh(a), P[L + "fc_b.weight"], P[L + "fc_b.bias"])};
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got.detach() - want.detach()).abs().max().item<double>();
  EXPECT_LE(err, 2e-5 * std::max(1.0, want.abs().max().item<double>())) << what << ": max abs error " << err;
}

void hidden_states_case(int zero, bool ckpt, int depth, bool return_hidden) {
  const std::string what = "zero " + std::to_string(zero) + " ckpt " + std::to_string(ckpt) + " depth " +
                           std::to_string(depth) + " return_hidden_states " + std::to_string(return_hidden);
  bmt::BlockOptions opts;
  opts.zero_level = zero;
  opts.use_checkpoint = ckpt;
  std::vector<std::shared_ptr<bmt::Block>> blocks;
  for (int64_t i = 0; i < kLayers; ++i) blocks.push_back(bmt::make_block(std::make_shared<TwoStreamImpl>(), opts));
  bmt::TransformerBlockList list(blocks, depth);
  at::manual_seed(5);
  bmt::init_parameters(list);
  // Same data on every rank: each rank's gradient is the whole one, and ZeRO sums them (world times).
  at::manual_seed(6);
  const at::Tensor a0 = at::randn({kRows, kDim}), b0 = at::randn({kRows, kDim}), s0 = at::rand({kDim}) + 0.5;
  const at::Tensor w_a = at::randn({kRows, kDim}), w_b = at::randn({kRows, kDim});
  const at::Tensor w_ha = at::randn({kLayers, kRows, kDim}), w_hb = at::randn({kLayers, kRows, kDim});
  auto objective = [&](const std::vector<at::Tensor>& out) {
    at::Tensor l = (out[0] * w_a).sum() + (out[1] * w_b).sum();
    if (return_hidden) l = l + (out[2] * w_ha).sum() + (out[3] * w_hb).sum();
    return l;
  };

  // Reference.
  std::map<std::string, at::Tensor> P;
  for (auto& kv : bmt::state_dict(list)) P[kv.first] = kv.second.clone().requires_grad_();
  at::Tensor ra = a0.clone().requires_grad_(), rb = b0.clone().requires_grad_(), rs = s0.clone().requires_grad_();
  std::vector<at::Tensor> ref_out{ra, rb};
  std::vector<at::Tensor> ins_a, ins_b;
  for (int i = 0; i < kLayers; ++i) {
    ins_a.push_back(ref_out[0]);
    ins_b.push_back(ref_out[1]);
    ref_out = reference_layer(P, i, ref_out[0], ref_out[1], rs);
  }
  if (return_hidden) {
    ref_out.push_back(at::stack(ins_a));
    ref_out.push_back(at::stack(ins_b));
  }
  objective(ref_out).backward();

  // The list.
  at::Tensor a = a0.clone().requires_grad_(), b = b0.clone().requires_grad_(), s = s0.clone().requires_grad_();
  std::vector<at::Tensor> out = list.forward({a, b, s}, /*num_hidden=*/2, return_hidden);
  ASSERT_EQ(out.size(), return_hidden ? 4u : 2u) << what;
  for (size_t k = 0; k < out.size(); ++k) expect_close(out[k], ref_out[k], what + ", output " + std::to_string(k));
  if (return_hidden) {
    EXPECT_EQ(out[2].sizes(), (at::IntArrayRef{kLayers, kRows, kDim})) << what;
    expect_close(out[2][0], a0, what + ", first stacked hidden state is the input");
  }
  objective(out).backward();
  expect_close(a.grad(), ra.grad(), what + ", gradient of hidden input a");
  expect_close(b.grad(), rb.grad(), what + ", gradient of hidden input b");
  expect_close(s.grad(), rs.grad(), what + ", gradient of the shared argument");
  const int W = bmt::config().world_size;
  for (auto& item : list.named_parameters())
    expect_close(full_main_grad(item.value()), W * P[item.key()].grad(), what + ", gradient of " + item.key());
  EXPECT_EQ(bmt::memory_stats().gathered_nbytes, 0) << what << ": gathered buffers left after the step";
}

void all_hidden_cases() {
  for (int zero : {2, 3})
    for (bool ckpt : {true, false})
      for (int depth : {0, 1, 2})
        for (bool ret : {false, true}) hidden_states_case(zero, ckpt, depth, ret);
}

}  // namespace

TEST(BlockListHiddenStates, TwoStreamsMatchPlainLibTorchWorld1) { bmt::testing::run_ranks(1, all_hidden_cases); }
TEST(BlockListHiddenStates, TwoStreamsMatchPlainLibTorchWorld2) { bmt::testing::run_ranks(2, all_hidden_cases); }

TEST(BlockListHiddenStates, NumHiddenOutOfRangeIsAnError) {
  bmt::testing::run_ranks(1, [] {
    std::vector<std::shared_ptr<bmt::Block>> blocks{bmt::make_block(std::make_shared<TwoStreamImpl>())};
    bmt::TransformerBlockList list(blocks);
    at::Tensor x = at::zeros({kRows, kDim});
    EXPECT_THROW(list.forward({x, x, x}, 0), bmt::core::Error);
    EXPECT_THROW(list.forward({x, x, x}, 4), bmt::core::Error);
    EXPECT_THROW(bmt::TransformerBlockList(blocks, -1), bmt::core::Error);
  });
}

// ZeRO-3 with checkpointing at prefetch depth 0, 1, 2: the forward gathers block i and prefetches blocks
// i+1..i+depth, and the backward (depth >= 1) holds its own block and the prefetched previous one, so the gathered
// peak is at most depth + 1 blocks over the whole step, and prefetching does gather ahead (the forward reaches it).
TEST(BlockListHiddenStates, PrefetchDepthBoundsGatheredMemory) {
  bmt::testing::run_ranks(2, [] {
    for (int depth : {0, 1, 2}) {
      tiny::Dims d;
      d.layers = 6;
      d.dim = 32;
      d.ff = 64;
      bmt::BlockOptions opts;
      opts.zero_level = 3;
      opts.use_checkpoint = true;
      tiny::Model model(d, opts, true, depth);
      bmt::init_parameters(model);
      const int64_t one_block_full = model.list->blocks()[0]->shard_nbytes() * bmt::config().world_size;
      for (auto& b : model.list->blocks()) ASSERT_EQ(b->shard_nbytes(), model.list->blocks()[0]->shard_nbytes());
      bmt::reset_peak_memory_stats();
      at::Tensor ids = at::randint(0, d.vocab, {2, 4}, at::TensorOptions().dtype(at::kLong));
      at::Tensor logits = model.forward(ids);
      const int64_t forward_peak = bmt::memory_stats().gathered_peak_nbytes;
      logits.sum().backward();
      const auto st = bmt::memory_stats();
      std::printf("[prefetch] depth %d: forward peak %lld, step peak %lld, one block %lld bytes\n", depth,
                  static_cast<long long>(forward_peak), static_cast<long long>(st.gathered_peak_nbytes),
                  static_cast<long long>(one_block_full));
      EXPECT_LE(st.gathered_peak_nbytes, (depth + 1) * one_block_full)
          << "depth " << depth << ": more blocks gathered at once than the prefetch depth allows";
      EXPECT_LE(forward_peak, (depth + 1) * one_block_full) << "depth " << depth << " forward";
      // Prefetching really happens: the forward holds depth + 1 blocks at its peak (6 layers > depth + 1).
      EXPECT_GE(forward_peak, (depth + 1) * one_block_full) << "depth " << depth << ": prefetch did not gather";
      EXPECT_EQ(st.gathered_nbytes, 0) << "depth " << depth << ": gathered buffers leaked after the step";
    }
  });
}
