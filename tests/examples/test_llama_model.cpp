// Llama (examples/models/llama.h): logits shape, causality (a token never changes earlier positions' logits),
// grouped-query attention, keys; RoPE (examples/models/rope.h) against its closed form and the relative-position
// property q(m)·k(n) = f(m - n).
#include <gtest/gtest.h>

#include "bmt/params/module_state.h"
#include "full_grad.h"
#include "models/llama.h"
#include "models/rope.h"
#include "run_ranks.h"

namespace {

examples::ModelConfig llama_config(int64_t kv_heads) {
  examples::ModelConfig c;
  c.arch = "llama";
  c.vocab_size = 29;
  c.max_seq_len = 10;
  c.num_layers = 2;
  c.dim = 32;
  c.num_heads = 4;
  c.num_kv_heads = kv_heads;
  c.ffn_dim = 48;
  return c;
}

}  // namespace

TEST(Rope, MatchesClosedForm) {
  const int64_t T = 7, hd = 8;
  const double theta = 10000.0;
  auto tables = examples::rope_tables(T, hd, theta, at::kCPU);
  at::manual_seed(3);
  at::Tensor x = at::randn({2, 3, T, hd});
  at::Tensor y = examples::apply_rope(x, tables);
  auto X = x.accessor<float, 4>();
  auto Y = y.accessor<float, 4>();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t p = 0; p < T; ++p)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const double angle = static_cast<double>(p) * std::pow(theta, -2.0 * static_cast<double>(i) / hd);
          const double a = X[b][h][p][i], c = X[b][h][p][i + hd / 2];
          EXPECT_NEAR(Y[b][h][p][i], a * std::cos(angle) - c * std::sin(angle), 1e-5);
          EXPECT_NEAR(Y[b][h][p][i + hd / 2], c * std::cos(angle) + a * std::sin(angle), 1e-5);
        }
  // Position 0 is the identity; norms are preserved.
  EXPECT_TRUE(at::allclose(y.select(2, 0), x.select(2, 0)));
  EXPECT_TRUE(at::allclose(y.norm(2, -1), x.norm(2, -1), 1e-5, 1e-5));
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  const int64_t T = 12, hd = 16;
  auto tables = examples::rope_tables(T, hd, 10000.0, at::kCPU);
  at::manual_seed(5);
  at::Tensor q = at::randn({hd}), k = at::randn({hd});
  // The same q and k placed at every position.
  at::Tensor qr = examples::apply_rope(q.expand({1, 1, T, hd}).contiguous(), tables)[0][0];
  at::Tensor kr = examples::apply_rope(k.expand({1, 1, T, hd}).contiguous(), tables)[0][0];
  for (int64_t m = 3; m < T; ++m)
    for (int64_t n = 3; n <= m; ++n)
      EXPECT_NEAR(qr[m].dot(kr[n]).item<double>(), qr[m - n].dot(kr[0]).item<double>(), 1e-4) << m << "," << n;
}

TEST(LlamaModel, ShapeCausalityAndGroupedQueryAttention) {
  bmt::testing::run_ranks(2, [] {
    for (int64_t kv : {0, 2, 1}) {
      auto c = llama_config(kv);
      examples::Llama model(c, {3, false}, at::kFloat);
      at::manual_seed(9);
      bmt::init_parameters(model);
      auto sd = bmt::state_dict(model);
      ASSERT_TRUE(sd.count("layers.0.attention.wk.weight"));
      EXPECT_EQ(sd["layers.0.attention.wk.weight"].size(0), c.kv_heads() * c.head_dim());
      EXPECT_EQ(sd.count("output.weight"), 1u);
      EXPECT_EQ(sd.count("layers.0.attention.wq.bias"), 0u) << "llama has no biases";

      at::manual_seed(1);  // same ids on both ranks
      at::Tensor ids = at::randint(0, c.vocab_size, {2, c.max_seq_len}, at::TensorOptions().dtype(at::kLong));
      at::Tensor logits = model.forward(ids);
      EXPECT_EQ(logits.sizes(), at::IntArrayRef({2, c.max_seq_len, c.vocab_size}));
      EXPECT_TRUE(logits.isfinite().all().item<bool>());
      const int64_t t = 6;
      at::Tensor changed = ids.clone();
      changed.select(1, t).fill_((ids[0][t].item<int64_t>() + 1) % c.vocab_size);
      at::Tensor logits2 = model.forward(changed);
      EXPECT_LT((logits2.narrow(1, 0, t) - logits.narrow(1, 0, t)).abs().max().item<double>(), 1e-6)
          << "a later token changed earlier logits (kv heads " << c.kv_heads() << ")";
      EXPECT_GT((logits2.narrow(1, t, 1) - logits.narrow(1, t, 1)).abs().max().item<double>(), 1e-6);
      // The loss reaches every parameter (values against a plain-LibTorch Llama: test_llama_reference.cpp).
      examples::lm_loss(logits, ids).backward();
      for (auto& item : model.named_parameters()) {
        at::Tensor g = bmt::testing::full_main_grad(item.value());
        EXPECT_TRUE(g.isfinite().all().item<bool>()) << item.key();
        EXPECT_GT(g.abs().sum().item<double>(), 0.0) << item.key() << " received no gradient";
      }
    }
  });
}

TEST(LlamaModel, RejectsBadHeadCounts) {
  bmt::testing::run_ranks(1, [] {
    auto c = llama_config(3);  // 4 heads are not a multiple of 3 kv heads
    EXPECT_THROW(examples::Llama(c, {}, at::kFloat), bmt::core::Error);
  });
}
