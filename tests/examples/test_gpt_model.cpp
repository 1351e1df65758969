// GPT (examples/models/gpt.h) at world 1 against an independent plain-LibTorch reference of the same math
// (explicit masked softmax attention, no SDPA): logits within 1e-5, loss and gradients within 1e-5, with every
// parameter (biases and LayerNorms included) set to random values. Also the initialisation rule and the keys.
#include <gtest/gtest.h>

#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/module_state.h"
#include "models/gpt.h"
#include "run_ranks.h"

namespace {

examples::ModelConfig tiny_config() {
  examples::ModelConfig c;
  c.vocab_size = 37;
  c.max_seq_len = 12;
  c.num_layers = 2;
  c.dim = 16;
  c.num_heads = 4;
  c.ffn_dim = 40;
  return c;
}

at::Tensor reference_attention(const at::Tensor& x, std::map<std::string, at::Tensor>& P, const std::string& L,
                               int64_t heads) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads;
  at::Tensor qkv = at::linear(x, P[L + "attn.c_attn.weight"], P[L + "attn.c_attn.bias"]);
  auto heads_of = [&](int64_t i) { return qkv.narrow(2, i * D, D).reshape({B, T, heads, hd}).permute({0, 2, 1, 3}); };
  at::Tensor q = heads_of(0), k = heads_of(1), v = heads_of(2);
  at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(hd));
  at::Tensor mask = at::ones({T, T}, at::kBool).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  at::Tensor y = at::matmul(at::softmax(scores, -1), v).permute({0, 2, 1, 3}).reshape({B, T, D});
  return at::linear(y, P[L + "attn.c_proj.weight"], P[L + "attn.c_proj.bias"]);
}

at::Tensor reference_logits(const examples::ModelConfig& c, std::map<std::string, at::Tensor>& P, const at::Tensor& ids) {
  const int64_t T = ids.size(1);
  at::Tensor h = at::embedding(P["wte.weight"], ids) + P["wpe.weight"].narrow(0, 0, T);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string L = "layers." + std::to_string(i) + ".";
    h = h + reference_attention(at::layer_norm(h, {c.dim}, P[L + "ln_1.weight"], P[L + "ln_1.bias"], 1e-5), P, L, c.num_heads);
    at::Tensor m = at::layer_norm(h, {c.dim}, P[L + "ln_2.weight"], P[L + "ln_2.bias"], 1e-5);
    m = at::linear(at::gelu(at::linear(m, P[L + "mlp.c_fc.weight"], P[L + "mlp.c_fc.bias"]), "tanh"),
                   P[L + "mlp.c_proj.weight"], P[L + "mlp.c_proj.bias"]);
    h = h + m;
  }
  h = at::layer_norm(h, {c.dim}, P["ln_f.weight"], P["ln_f.bias"], 1e-5);
  return at::linear(h, P["wte.weight"]);
}

}  // namespace

TEST(GptModel, InitialisationAndKeys) {
  bmt::testing::run_ranks(2, [] {
    auto c = tiny_config();
    examples::Gpt model(c, {3, false}, at::kFloat);
    at::manual_seed(7);
    bmt::init_parameters(model);
    auto sd = bmt::state_dict(model);
    EXPECT_EQ(sd.size(), 2u + 12u * c.num_layers + 2u);
    for (auto& [key, t] : sd) {
      const bool is_bias = key.size() > 5 && key.compare(key.size() - 5, 5, ".bias") == 0;
      const bool is_norm = key.find("ln_") != std::string::npos;
      if (is_norm && !is_bias) EXPECT_TRUE(at::equal(t, at::ones_like(t))) << key;
      else if (is_bias) EXPECT_TRUE(at::equal(t, at::zeros_like(t))) << key;
      else EXPECT_NEAR(t.std().item<double>(), 0.02, 0.004) << key;
    }
    ASSERT_TRUE(sd.count("layers.1.attn.c_attn.weight"));
    EXPECT_EQ(sd["layers.1.attn.c_attn.weight"].sizes(), at::IntArrayRef({3 * c.dim, c.dim}));
    EXPECT_EQ(sd["wpe.weight"].sizes(), at::IntArrayRef({c.max_seq_len, c.dim}));
  });
}

TEST(GptModel, ForwardAndGradientsMatchPlainLibTorch) {
  bmt::InitOptions on_gpu_if_any = bmt::testing::test_init();
  on_gpu_if_any.backend = bmt::Backend::kAuto;  // NCCL + GPU when built with CUDA and one is visible
  bmt::testing::run_ranks(1, [] {
    auto c = tiny_config();
    examples::Gpt model(c, {3, true}, at::kFloat);
    bmt::init_parameters(model);
    // Random values everywhere so that biases, LayerNorm affine terms and transposes all matter.
    at::manual_seed(11);
    bmt::StateDict random;
    for (auto& [key, t] : bmt::state_dict(model)) random[key] = at::randn_like(t) * 0.3;
    bmt::load_state_dict(model, random);
    std::map<std::string, at::Tensor> P;
    for (auto& [key, t] : random) P[key] = t.clone().requires_grad_(true);

    // The model runs on the configured device (a GPU when there is one), the reference on the CPU.
    const at::Device dev = bmt::config().device;
    at::Tensor ids = at::randint(0, c.vocab_size, {3, c.max_seq_len + 1}, at::TensorOptions().dtype(at::kLong));
    at::Tensor x = ids.narrow(1, 0, c.max_seq_len), y = ids.narrow(1, 1, c.max_seq_len);
    at::Tensor ours = model.forward(x.to(dev));
    at::Tensor ref = reference_logits(c, P, x);
    EXPECT_LT((ours.cpu() - ref).abs().max().item<double>(), 1e-5);
    // Shorter sequences use the first positions only.
    at::Tensor short_ids = x.narrow(1, 0, 5);
    EXPECT_LT((model.forward(short_ids.to(dev)).cpu() - reference_logits(c, P, short_ids)).abs().max().item<double>(), 1e-5);

    // model.loss: the fused cross-entropy with its in-place backward (what training runs).
    at::Tensor loss = model.loss(x.to(dev), y.to(dev)), ref_loss = examples::lm_loss(ref, y);
    EXPECT_NEAR(examples::lm_loss(ours, y.to(dev)).item<double>(), ref_loss.item<double>(), 1e-5);
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5);
    loss.backward();
    ref_loss.backward();
    for (auto& item : model.named_parameters()) {
      at::Tensor g = bmt::main_grad(item.value());
      ASSERT_TRUE(g.defined()) << item.key();
      EXPECT_LT((g.reshape(-1).cpu() - P[item.key()].grad().reshape(-1)).abs().max().item<double>(), 1e-5) << item.key();
    }
  }, on_gpu_if_any);
}

TEST(GptModel, RejectsTooLongSequencesAndBadShapes) {
  bmt::testing::run_ranks(1, [] {
    auto c = tiny_config();
    examples::Gpt model(c, {}, at::kFloat);
    bmt::init_parameters(model);
    at::Tensor ids = at::zeros({1, c.max_seq_len + 1}, at::TensorOptions().dtype(at::kLong));
    EXPECT_THROW(model.forward(ids), bmt::core::Error);
    c.num_heads = 5;
    EXPECT_THROW(examples::Gpt(c, {}, at::kFloat), bmt::core::Error);
  });
}
