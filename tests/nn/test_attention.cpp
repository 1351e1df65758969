// nn::causal_attention against the attention written out with torch's ops in double (softmax of masked scores):
// output and the gradients of q, k and v, through our autograd function over torch's CPU flash kernel in fp32 and
// bf16, with grouped-query heads, and through the fallback (operands no fused kernel takes).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <string>

#include "bmt/core/error.h"
#include "attention_test_util.h"
#include "bmt/nn/attention.h"

namespace {

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

void check(at::ScalarType dtype, int64_t heads, int64_t kv_heads, bool transposed_layout, double tol) {
  at::manual_seed(7);
  const int64_t B = 2, T = 9, hd = 16;
  auto make = [&](int64_t h) {
    // (B, T, h, hd) transposed to (B, h, T, hd), as split_heads gives it, or contiguous (B, h, T, hd).
    at::Tensor t = transposed_layout ? at::randn({B, T, h, hd}, at::kDouble).transpose(1, 2)
                                     : at::randn({B, h, T, hd}, at::kDouble);
    return t;
  };
  const at::Tensor q0 = make(heads), k0 = make(kv_heads), v0 = make(kv_heads);
  const at::Tensor dy = at::randn({B, heads, T, hd}, at::kDouble);
  at::Tensor q = leaf(q0.to(dtype)), k = leaf(k0.to(dtype)), v = leaf(v0.to(dtype));
  at::Tensor y = bmt::nn::causal_attention(q, k, v);
  y.backward(dy.to(dtype));
  at::Tensor rq = leaf(q.detach().to(at::kDouble)), rk = leaf(k.detach().to(at::kDouble)),
             rv = leaf(v.detach().to(at::kDouble));
  at::Tensor ry = bmt::testing::reference_causal_attention(rq, rk, rv);
  ry.backward(dy.to(dtype).to(at::kDouble));
  bmt::testing::expect_close(y, ry, tol, "output");
  bmt::testing::expect_close(q.grad(), rq.grad(), tol, "dq");
  bmt::testing::expect_close(k.grad(), rk.grad(), tol, "dk");
  bmt::testing::expect_close(v.grad(), rv.grad(), tol, "dv");
}

}  // namespace

TEST(CausalAttention, FlashFunctionMatchesTheMathInDoubleFp32) {
  const at::Tensor t = at::zeros({1, 2, 4, 8});
  EXPECT_EQ(bmt::nn::causal_attention_kernel(t, t, t), bmt::nn::AttentionKernel::kFlash);
  check(at::kFloat, 4, 4, true, 1e-5);
  check(at::kFloat, 4, 4, false, 1e-5);
}

TEST(CausalAttention, FlashFunctionMatchesTheMathInDoubleBf16) { check(at::kBFloat16, 4, 4, true, 3e-2); }

TEST(CausalAttention, GroupedQueryHeadsShareTheirKeysAndValues) { check(at::kFloat, 6, 2, true, 1e-5); }

TEST(CausalAttention, OperandsTheFlashFunctionRefusesTakeTorchsAttention) {
  const at::Tensor q = at::zeros({1, 2, 4, 8}), shorter = at::zeros({1, 2, 3, 8});
  EXPECT_EQ(bmt::nn::causal_attention_kernel(q, shorter, shorter), bmt::nn::AttentionKernel::kTorch);  // other sequence lengths
  EXPECT_EQ(bmt::nn::causal_attention_kernel(q, q.to(at::kDouble), q), bmt::nn::AttentionKernel::kTorch);  // mixed dtypes
  const at::Tensor strided = at::zeros({1, 2, 4, 16}).narrow(3, 0, 8).contiguous().transpose(2, 3);  // hd stride > 1
  EXPECT_EQ(bmt::nn::causal_attention_kernel(strided, strided, strided), bmt::nn::AttentionKernel::kTorch);
  at::globalContext().setSDPUseFlash(false);  // turned off in torch's context: torch's attention, same results
  const at::Tensor t = at::zeros({1, 2, 4, 8});
  EXPECT_EQ(bmt::nn::causal_attention_kernel(t, t, t), bmt::nn::AttentionKernel::kTorch);
  check(at::kFloat, 4, 4, true, 1e-5);
  at::globalContext().setSDPUseFlash(true);
}

TEST(CausalAttention, BadShapesAreRefusedWithAMessage) {
  const at::Tensor q = at::zeros({1, 3, 4, 8}), kv = at::zeros({1, 2, 4, 8});
  try {
    bmt::nn::causal_attention(q, kv, kv);
    ADD_FAILURE() << "3 query heads over 2 kv heads accepted";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a multiple of 2 kv heads"), std::string::npos) << e.what();
  }
  EXPECT_THROW(bmt::nn::causal_attention(q.view({3, 4, 8}), kv, kv), bmt::core::Error);
}
