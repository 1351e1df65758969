// nn::causal_attention on the GPU: our autograd function over the kernel torch picks (cuDNN's or flash; bf16 and
// fp16) against the attention written out in double, with grouped-query heads; and its keep-for-recompute path
// driven as a checkpointed Block drives it (a first run without autograd that keeps, a recompute that takes): the
// recompute calls no forward kernel and gives the plain call's output bit for bit and its gradients (up to the
// fused backward's own run-to-run bits).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cstdio>
#include <string>

#include "attention_test_util.h"
#include "bmt/nn/attention.h"
#include "bmt/engine/recompute_keep.h"

namespace {

struct Operands {
  at::Tensor q, k, v, dy;
};

Operands make(at::ScalarType dtype, int64_t heads, int64_t kv_heads) {
  at::manual_seed(5);
  const int64_t B = 2, T = 256, hd = 64;
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kDouble);
  auto split = [&](int64_t h) { return at::randn({B, T, h, hd}, opts).to(dtype).transpose(1, 2); };
  return {split(heads), split(kv_heads), split(kv_heads), at::randn({B, heads, T, hd}, opts).to(dtype)};
}

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

}  // namespace

TEST(CausalAttentionCuda, FlashMatchesTheMathInDouble) {
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    for (auto [heads, kv_heads] : {std::pair<int64_t, int64_t>{4, 4}, {8, 2}}) {
      Operands o = make(dtype, heads, kv_heads);
      at::Tensor q = leaf(o.q), k = leaf(o.k), v = leaf(o.v);
      const bmt::nn::AttentionKernel kernel = bmt::nn::causal_attention_kernel(q, q, q);
      ASSERT_NE(kernel, bmt::nn::AttentionKernel::kTorch);
      std::printf("%s heads %lld: %s\n", c10::toString(dtype), static_cast<long long>(heads),
                  kernel == bmt::nn::AttentionKernel::kCudnn ? "cuDNN" : "flash");
      at::Tensor y = bmt::nn::causal_attention(q, k, v);
      y.backward(o.dy);
      at::Tensor rq = leaf(o.q.to(at::kDouble)), rk = leaf(o.k.to(at::kDouble)), rv = leaf(o.v.to(at::kDouble));
      at::Tensor ry = bmt::testing::reference_causal_attention(rq, rk, rv);
      ry.backward(o.dy.to(at::kDouble));
      const double tol = dtype == at::kHalf ? 4e-3 : 2e-2;  // a few output roundings of the dtype
      const std::string what = std::string(c10::toString(dtype)) + " heads " + std::to_string(heads) + "/" +
                               std::to_string(kv_heads);
      bmt::testing::expect_close(y, ry, tol, what + " output");
      bmt::testing::expect_close(q.grad(), rq.grad(), tol, what + " dq");
      bmt::testing::expect_close(k.grad(), rk.grad(), tol, what + " dk");
      bmt::testing::expect_close(v.grad(), rv.grad(), tol, what + " dv");
    }
  }
}

TEST(CausalAttentionCuda, TheRecomputeTakesTheKeptOutput) {
  Operands o = make(at::kBFloat16, 4, 4);
  bmt::testing::OpCallCounter forwards(
      {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention"});
  // Plain: one forward with autograd.
  at::Tensor q = leaf(o.q), k = leaf(o.k), v = leaf(o.v);
  forwards.reset();
  at::Tensor y = bmt::nn::causal_attention(q, k, v);
  y.backward(o.dy);
  EXPECT_EQ(forwards.count(), 1);
  // As a checkpointed Block runs it: first without autograd, keeping; then the recompute, taking.
  bmt::detail::KeptValues kept;
  forwards.reset();
  {
    bmt::detail::RecomputeScope first(bmt::RecomputePhase::kFirstRun, &kept);
    at::NoGradGuard no_grad;
    bmt::nn::causal_attention(o.q, o.k, o.v);
  }
  ASSERT_EQ(kept.values.size(), 1u);
  at::Tensor q2 = leaf(o.q), k2 = leaf(o.k), v2 = leaf(o.v), y2;
  {
    bmt::detail::RecomputeScope again(bmt::RecomputePhase::kRecompute, &kept);
    y2 = bmt::nn::causal_attention(q2, k2, v2);
  }
  EXPECT_TRUE(kept.values.empty());
  EXPECT_EQ(forwards.count(), 1);  // only the first run's
  y2.backward(o.dy);
  EXPECT_TRUE(at::equal(y, y2));  // the kept output itself
  // The fused backwards sum dq over key blocks with atomics (run to run, the last bits move): one bf16 rounding.
  bmt::testing::expect_close(q2.grad(), q.grad().to(at::kDouble), 1e-2, "dq");
  bmt::testing::expect_close(k2.grad(), k.grad().to(at::kDouble), 1e-2, "dk");
  bmt::testing::expect_close(v2.grad(), v.grad().to(at::kDouble), 1e-2, "dv");
}
