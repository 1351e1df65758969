// examples::Llama against an independent plain-LibTorch Llama (llama_reference.h) from the same weights: logits,
// the training loss (the fused cross-entropy of LanguageModel::loss) and every parameter's gradient, for
// multi-head and grouped-query attention (kv heads 4, 2, 1), ZeRO-2/3, checkpointing on/off, at worlds 1 and 2
// (the same batch on every rank: ZeRO sums the ranks' gradients, so they are world times the reference's).
#include <gtest/gtest.h>

#include "bmt/params/module_state.h"
#include "full_grad.h"
#include "llama_reference.h"
#include "models/llama.h"
#include "run_ranks.h"

namespace {

examples::ModelConfig config(int64_t kv_heads) {
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

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got.detach() - want.detach()).abs().max().item<double>();
  const double scale = std::max(1e-3, want.abs().max().item<double>());
  EXPECT_LE(err, tol * scale) << what << ": max abs error " << err << " (scale " << scale << ")";
}

void llama_case(int64_t kv, int zero, bool ckpt) {
  const examples::ModelConfig c = config(kv);
  const std::string what = "kv heads " + std::to_string(c.kv_heads()) + " zero " + std::to_string(zero) + " ckpt " +
                           std::to_string(ckpt);
  examples::Llama model(c, {zero, ckpt}, at::kFloat);
  at::manual_seed(11);
  bmt::init_parameters(model);
  // RMSNorm weights start at 1: perturb every parameter so that a norm weight's gradient path is not hidden.
  {
    auto sd = bmt::state_dict(model);
    for (auto& kv_pair : sd) kv_pair.second += 0.05 * at::randn(kv_pair.second.sizes());
    bmt::load_state_dict(model, sd);
  }
  std::map<std::string, at::Tensor> P;
  for (auto& kv_pair : bmt::state_dict(model)) P[kv_pair.first] = kv_pair.second.clone().requires_grad_();
  const llama_ref::Shape shape{c.num_layers, c.dim, c.num_heads, c.kv_heads(), c.norm_eps, c.rope_theta};

  at::manual_seed(1);  // the same ids on every rank
  at::Tensor ids = at::randint(0, c.vocab_size, {3, c.max_seq_len + 1}, at::TensorOptions().dtype(at::kLong));
  at::Tensor in = ids.narrow(1, 0, c.max_seq_len), tgt = ids.narrow(1, 1, c.max_seq_len);
  at::Tensor ref_logits = llama_ref::logits(shape, P, in);
  at::Tensor ref_loss = llama_ref::mean_cross_entropy(ref_logits, tgt);
  ref_loss.backward();

  {
    at::NoGradGuard no_grad;
    expect_close(model.forward(in), ref_logits, 1e-5, what + ", logits");
  }
  at::Tensor loss = model.loss(in, tgt);
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5 * ref_loss.item<double>()) << what << ", loss";
  loss.backward();
  const int W = bmt::config().world_size;
  size_t checked = 0;
  for (auto& item : model.named_parameters()) {
    ASSERT_TRUE(P.count(item.key())) << item.key();
    expect_close(bmt::testing::full_main_grad(item.value()), W * P[item.key()].grad(), 3e-5,
                 what + ", gradient of " + item.key());
    ++checked;
  }
  EXPECT_EQ(checked, P.size()) << what;
}

void all_llama_cases() {
  for (int64_t kv : {0, 2, 1})
    for (int zero : {2, 3})
      for (bool ckpt : {false, true}) llama_case(kv, zero, ckpt);
}

}  // namespace

TEST(LlamaReference, LogitsLossAndGradientsMatchPlainLibTorchWorld1) { bmt::testing::run_ranks(1, all_llama_cases); }
TEST(LlamaReference, LogitsLossAndGradientsMatchPlainLibTorchWorld2) { bmt::testing::run_ranks(2, all_llama_cases); }
