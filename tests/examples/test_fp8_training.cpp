// FP8 linears in the example GPT (ParallelOptions::fp8, train_gpt --fp8): the tiny preset learns on 2 CPU ranks
// over Gloo with ZeRO-3, with and without activation checkpointing (the recompute repeats the casts), at tp 2 and
// the tiny Llama with checkpointing (both with the LM head in FP8 too, fp8_head), with delayed scales of the linears'
// operands and gradients (BMT_FP8_DELAYED_INPUTS, BMT_FP8_DELAYED_GRADS) and checkpointing, the loss finite
// throughout; fp8
// off is today's model bit for bit and fp8 on changes the layers' GEMMs only within FP8's rounding. On CPU the
// GEMMs are torch's CPU _scaled_mm and the casts our kernels' CPU twin.
#include <gtest/gtest.h>

#include <cmath>

#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/layers.h"
#include "bmt/params/module_state.h"
#include "bmt/params/param_init.h"
#include "bmt/params/parameter.h"
#include "bmt/runtime/distributed.h"
#include "models/gpt.h"
#include "run_ranks.h"
#include "train/train_args.h"
#include "train/trainer.h"

namespace {

// A GPT small enough for one CPU rank, every GEMM dimension a multiple of 16.
examples::ModelConfig tiny_gpt(int64_t layers) {
  examples::ModelConfig c;
  c.num_layers = layers, c.dim = 64, c.num_heads = 4, c.ffn_dim = 256, c.vocab_size = 32, c.max_seq_len = 16;
  return c;
}

examples::TrainArgs fp8_args(bool checkpointing) {
  examples::TrainArgs a;
  a.progress = "off";
  a.samples = 0;
  a.batch = 8;
  a.seq = 40;  // 8 x 40 = 320 rows per rank: every GEMM dimension of the tiny GPT is a multiple of 16
  a.eval_batches = 2;
  a.task_rows = 32;
  a.steps = 120;
  a.eval_every = 60;
  a.fp8 = true;
  a.checkpointing = checkpointing;
  return a;
}

void expect_learns(const examples::TrainResult& r) {
  EXPECT_EQ(r.end_step, 120);
  EXPECT_TRUE(std::isfinite(r.first_loss) && std::isfinite(r.last_loss)) << r.first_loss << " " << r.last_loss;
  EXPECT_LT(r.last_loss, r.first_loss - 0.8) << "train loss " << r.first_loss << " -> " << r.last_loss;
  ASSERT_TRUE(r.first_eval_loss && r.last_eval_loss);
  EXPECT_TRUE(std::isfinite(*r.last_eval_loss));
  EXPECT_LT(*r.last_eval_loss, *r.first_eval_loss - 0.8);
}

}  // namespace

TEST(Fp8Training, TinyGptLearnsOnTwoRanks) {
  bmt::testing::run_ranks(2, [] { expect_learns(examples::run_training(fp8_args(false))); });
}

TEST(Fp8Training, TinyGptLearnsOnTwoRanksWithCheckpointing) {
  bmt::testing::run_ranks(2, [] { expect_learns(examples::run_training(fp8_args(true))); });
}

TEST(Fp8Training, TinyGptLearnsWithDelayedScalesAndCheckpointing) {
  // BMT_FP8_DELAYED_INPUTS (every linear's input and weight; on CPU also c_proj's GELU input, the MLP being the
  // separate composition there), BMT_FP8_DELAYED_GRADS (every linear's output gradient, recorded once per backward
  // however often the recompute repeats the forward) and the FP8 head, under ZeRO-3's gathered weights
  bmt::testing::run_ranks(2, [] {
    bmt::nn::set_fp8_delayed_inputs_enabled(true);
    bmt::nn::set_fp8_delayed_grads_enabled(true);
    examples::TrainArgs a = fp8_args(true);
    a.fp8_head = true;
    expect_learns(examples::run_training(a));
    bmt::nn::set_fp8_delayed_inputs_enabled(false);
    bmt::nn::set_fp8_delayed_grads_enabled(false);
  });
}

TEST(Fp8Training, TinyGptLearnsAtTensorParallelSizeTwo) {  // each rank's GEMM of the column/row-parallel layers
  bmt::InitOptions init = bmt::testing::test_init();
  init.tp_size = 2;
  init.sequence_parallel = true;
  bmt::testing::run_ranks(2, [] {
    examples::TrainArgs a = fp8_args(false);
    a.tp = 2;
    a.fp8_head = true;  // and the vocabulary-parallel head's GEMM (each rank's slice)
    expect_learns(examples::run_training(a));
  }, init);
}

TEST(Fp8Training, TinyGptLearnsAtTensorParallelSizeTwoWithDelayedScales) {  // each rank's own delayed scales
  bmt::InitOptions init = bmt::testing::test_init();
  init.tp_size = 2;
  init.sequence_parallel = true;
  bmt::testing::run_ranks(2, [] {
    bmt::nn::set_fp8_delayed_inputs_enabled(true);
    bmt::nn::set_fp8_delayed_grads_enabled(true);
    examples::TrainArgs a = fp8_args(false);
    a.tp = 2;
    expect_learns(examples::run_training(a));
    bmt::nn::set_fp8_delayed_inputs_enabled(false);
    bmt::nn::set_fp8_delayed_grads_enabled(false);
  }, init);
}

TEST(Fp8Training, TinyLlamaLearnsOnTwoRanks) {
  bmt::testing::run_ranks(2, [] {
    examples::TrainArgs a = fp8_args(true);
    a.model = "llama";
    a.fp8_head = true;  // and the output head
    expect_learns(examples::run_training(a));
  });
}

TEST(Fp8Training, LayersListedInFp8Bf16LayersStayInTheParameterDtype) {
  bmt::testing::run_ranks(1, [] {
    examples::ModelConfig c = tiny_gpt(4);
    examples::ParallelOptions p(3, false);
    p.fp8 = true;
    p.fp8_bf16_layers = {0, -1};
    examples::Gpt model(c, p, at::kFloat);
    int fp8_on = 0, fp8_off = 0;
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      auto* lin = dynamic_cast<bmt::nn::LinearImpl*>(item.value().get());
      if (!lin || item.key().rfind("layers.", 0) != 0) continue;
      const bool kept = item.key().rfind("layers.0.", 0) == 0 || item.key().rfind("layers.3.", 0) == 0;
      EXPECT_EQ(lin->fp8, !kept) << item.key();
      (lin->fp8 ? fp8_on : fp8_off) += 1;
    }
    EXPECT_EQ(fp8_on, 8) << "layers 1 and 2: four linears each";
    EXPECT_EQ(fp8_off, 8) << "layers 0 and 3 (-1)";
    p.fp8_bf16_layers = {4};
    EXPECT_THROW(
        {
          try {
            examples::Gpt bad(c, p, at::kFloat);
          } catch (const std::exception& e) {
            EXPECT_NE(std::string(e.what()).find("names layer 4, but the model has 4 layers"), std::string::npos)
                << e.what();
            throw;
          }
        },
        std::exception);
  });
  const char* argv[] = {"train_gpt", "--fp8", "--fp8-bf16-layers", "0,-1"};
  EXPECT_EQ(examples::parse_train_args(4, argv).fp8_bf16_layers, (std::vector<int64_t>{0, -1}));
  const char* bad[] = {"train_gpt", "--fp8", "--fp8-bf16-layers", "0,x"};
  EXPECT_THROW(examples::parse_train_args(4, bad), std::exception);
  const char* no_fp8[] = {"train_gpt", "--fp8-bf16-layers", "0"};
  EXPECT_THROW(examples::parse_train_args(3, no_fp8), std::exception);
}

TEST(Fp8Training, Fp8LinearsChoosesTheAttentionOrTheMlpLinears) {
  bmt::testing::run_ranks(1, [] {
    examples::ModelConfig c = tiny_gpt(2);
    for (const std::string group : {"all", "mlp", "attn"}) {
      examples::ParallelOptions p(3, false);
      p.fp8 = true;
      p.fp8_linears = group;
      examples::Gpt model(c, p, at::kFloat);
      int fp8_on = 0;
      for (const auto& item : model.named_modules("", /*include_self=*/false)) {
        auto* lin = dynamic_cast<bmt::nn::LinearImpl*>(item.value().get());
        if (!lin || item.key().rfind("layers.", 0) != 0) continue;
        const bool in_mlp = item.key().find(".mlp.") != std::string::npos;
        EXPECT_EQ(lin->fp8, group == "all" || (group == "mlp") == in_mlp) << group << ": " << item.key();
        fp8_on += lin->fp8;
      }
      EXPECT_EQ(fp8_on, group == "all" ? 8 : 4) << group;
    }
    examples::ParallelOptions p(3, false);
    p.fp8 = true;
    p.fp8_linears = "qkv";
    try {
      examples::Gpt bad(c, p, at::kFloat);
      ADD_FAILURE() << "fp8_linears 'qkv' was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("must be all, mlp or attn, got 'qkv'"), std::string::npos) << e.what();
    }
  });
  const char* argv[] = {"train_gpt", "--fp8", "--fp8-linears", "mlp"};
  EXPECT_EQ(examples::parse_train_args(4, argv).fp8_linears, "mlp");
  const char* bad[] = {"train_gpt", "--fp8", "--fp8-linears", "none"};
  EXPECT_THROW(examples::parse_train_args(4, bad), std::exception);
  const char* no_fp8[] = {"train_gpt", "--fp8-linears", "mlp"};
  EXPECT_THROW(examples::parse_train_args(3, no_fp8), std::exception);
}

TEST(Fp8Training, OffIsTodaysModelAndOnStaysWithinFp8Rounding) {
  bmt::testing::run_ranks(1, [] {
    examples::ModelConfig c = tiny_gpt(2);
    examples::ParallelOptions off(3, false), on(3, false);
    on.fp8 = true;
    examples::Gpt today(c, {3, false}, at::kFloat), fp8_off(c, off, at::kFloat), fp8_on(c, on, at::kFloat);
    for (examples::Gpt* m : {&today, &fp8_off, &fp8_on}) bmt::init_parameters(*m);
    EXPECT_TRUE(fp8_on.layers->size() == 2);
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 16}, at::TensorOptions().dtype(at::kLong));
    const at::Tensor a = today.forward(ids), b = fp8_off.forward(ids), f = fp8_on.forward(ids);
    EXPECT_TRUE(at::equal(a, b)) << "fp8 off must be the unchanged path";
    const double diff = (f - a).abs().max().item<double>(), scale = a.abs().max().item<double>();
    EXPECT_GT(diff, 0.0) << "fp8 on did not change the GEMMs";
    EXPECT_LT(diff, 0.1 * scale) << "fp8 logits far from the fp32 ones";
  });
}

TEST(Fp8Training, Fp8HeadRunsTheLmHeadsGemmsInFp8) {
  bmt::testing::run_ranks(1, [] {
    examples::ModelConfig c = tiny_gpt(2);
    examples::ParallelOptions layers(3, false), head(3, false);
    layers.fp8 = head.fp8 = true;
    head.fp8_head = true;
    examples::Gpt a(c, layers, at::kFloat), b(c, head, at::kFloat);
    for (examples::Gpt* m : {&a, &b}) bmt::init_parameters(*m);
    // The tied projection is fp8_linear of wte's weight, bit for bit, and not the fp32 GEMM.
    const at::Tensor x = at::randn({32, c.dim});
    const at::Tensor E = bmt::gathered(b.wte.weight());
    const at::Tensor fp8 = b.wte.projection(x), want = bmt::nn::fp8_linear(x, E, at::Tensor(),
                                                                          bmt::nn::fp8_grad_format());
    EXPECT_TRUE(at::equal(fp8, want));
    EXPECT_FALSE(at::equal(fp8, at::linear(x, E)));
    EXPECT_TRUE(at::equal(a.wte.projection(x), at::linear(x, bmt::gathered(a.wte.weight()))))
        << "fp8_head off: the head stays in the parameter dtype";
    // The whole model: the same layers, only the head's rounding differs.
    const at::Tensor ids = at::randint(0, c.vocab_size, {2, 16}, at::TensorOptions().dtype(at::kLong));
    const at::Tensor la = a.forward(ids), lb = b.forward(ids);
    const double diff = (lb - la).abs().max().item<double>(), scale = la.abs().max().item<double>();
    EXPECT_GT(diff, 0.0) << "fp8_head did not change the head's GEMM";
    EXPECT_LT(diff, 0.1 * scale);
    const examples::ModelConfig gpt_config = c;
    // Llama: its untied output linear.
    c.arch = "llama";
    for (bool on : {false, true}) {
      head.fp8_head = on;
      auto llama = examples::make_model(c, head, at::kFloat);
      auto* out = dynamic_cast<bmt::nn::LinearImpl*>(llama->named_modules()["output"].get());
      ASSERT_NE(out, nullptr);
      EXPECT_EQ(out->fp8, on);
    }
    examples::ParallelOptions no_fp8(3, false);
    no_fp8.fp8_head = true;
    try {
      examples::Gpt bad(gpt_config, no_fp8, at::kFloat);
      ADD_FAILURE() << "fp8_head without fp8 was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("fp8_head (--fp8-head)"), std::string::npos) << e.what();
    }
  });
  const char* argv[] = {"train_gpt", "--fp8", "--fp8-head"};
  EXPECT_TRUE(examples::parse_train_args(3, argv).fp8_head);
  const char* no_fp8[] = {"train_gpt", "--fp8-head"};
  EXPECT_THROW(examples::parse_train_args(2, no_fp8), std::exception);
}

TEST(Fp8Training, Fp8HeadBackwardKeepsTheLogitsAndPutsTheHeadsGradientsInFp8) {
  bmt::testing::run_ranks(1, [] {
    examples::ModelConfig c = tiny_gpt(2);
    examples::ParallelOptions head(3, false);
    head.fp8 = true;
    head.fp8_head_backward = true;
    examples::Gpt m(c, head, at::kFloat);
    bmt::init_parameters(m);
    // The logits are the fp32 GEMM's; the table's gradient through them is fp8_linear's (E5M2 dy, E4M3 x).
    const at::Tensor x = at::randn({32, c.dim}), g = at::randn({32, c.vocab_size});
    const at::Tensor E = bmt::gathered(m.wte.weight()).detach().requires_grad_();
    const at::Tensor logits = m.wte.projection(x, E);
    EXPECT_TRUE(at::equal(logits.detach(), at::linear(x, E.detach())));
    logits.backward(g);
    const at::Tensor E8 = E.detach().clone().requires_grad_();
    bmt::nn::fp8_linear(x, E8, at::Tensor(), bmt::nn::fp8_grad_format()).backward(g);
    EXPECT_TRUE(at::equal(E.grad(), E8.grad()));
    EXPECT_FALSE(at::equal(E.grad(), at::mm(g.t(), x)));
    // Llama: its output linear's FP8 state says backward only.
    c.arch = "llama";
    auto llama = examples::make_model(c, head, at::kFloat);
    auto* out = dynamic_cast<bmt::nn::LinearImpl*>(llama->named_modules()["output"].get());
    ASSERT_NE(out, nullptr);
    EXPECT_TRUE(out->fp8 && out->fp8_scales.backward_only);
    // Both head choices at once, or either without fp8: refused, naming the options.
    examples::ParallelOptions both = head;
    both.fp8_head = true;
    try {
      c.arch = "gpt";
      examples::Gpt bad(c, both, at::kFloat);
      ADD_FAILURE() << "fp8_head with fp8_head_backward was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("set one"), std::string::npos) << e.what();
    }
  });
  const char* argv[] = {"train_gpt", "--fp8", "--fp8-head-backward"};
  const examples::TrainArgs a = examples::parse_train_args(3, argv);
  EXPECT_TRUE(a.fp8_head_backward && !a.fp8_head);
  const char* both[] = {"train_gpt", "--fp8", "--fp8-head", "--fp8-head-backward"};
  EXPECT_THROW(examples::parse_train_args(4, both), std::exception);
  const char* no_fp8[] = {"train_gpt", "--fp8-head-backward"};
  EXPECT_THROW(examples::parse_train_args(2, no_fp8), std::exception);
}
