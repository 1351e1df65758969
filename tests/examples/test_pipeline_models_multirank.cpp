// GPT and Llama (examples/models) under pipeline parallelism on CPU ranks over Gloo, against the same model at
// pp 1: a run_ranks(1) reference trains 3 AdamW steps (loss() + OptimManager) and writes its losses and state_dict;
// the pp 2 run (two stages of one rank, 1F1B over 2 micro-batches, LanguageModel::pipeline_step) trains from the
// same by-name initialisation on the same batches and compares: losses within 2e-5 relative, every parameter its
// stage holds within 1e-5 (the embedding on the first stage, the final norm and the head on the last; Llama's
// rotary positions inside the layers). Then the held-out loss through the pipeline (forward_only) equals pp 1's.
// Label multirank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdlib>

#include "bmt/params/module_state.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/flat_state_dict.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/parameter.h"
#include "models/language_model.h"
#include "run_ranks.h"

namespace {

using bmt::testing::run_ranks;

constexpr int kSteps = 3;

examples::ModelConfig tiny(const std::string& arch) {
  examples::ModelConfig c;
  c.arch = arch;
  c.vocab_size = 30;
  c.max_seq_len = 10;
  c.num_layers = 3;  // 2 + 1 layers over two stages
  c.dim = 16;
  c.num_heads = 4;
  c.num_kv_heads = arch == "llama" ? 2 : 0;
  c.ffn_dim = 24;
  return c;
}

at::Tensor batch(const examples::ModelConfig& c, int step) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return at::randint(0, c.vocab_size, {4, c.max_seq_len + 1}, gen, at::TensorOptions().dtype(at::kLong));
}

bmt::optim::StateDict train_impl(const examples::ModelConfig& c) {
  auto model = examples::make_model(c, {3, false}, at::kFloat);
  bmt::init_parameters_by_name(*model, 17);  // the same values at every pipe size
  bmt::optim::AdamOptions adam(1e-3, {0.9, 0.95}, 1e-8, 0.1);
  adam.decoupled_weight_decay(true);
  bmt::optim::OptimManager optim;
  optim.add_optimizer(std::make_shared<bmt::optim::AdamOptimizer>(model->parameters(), adam));
  std::vector<double> losses;
  const int64_t T = c.max_seq_len;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor tokens = batch(c, step);
    at::Tensor loss;
    if (model->pipelined()) {
      loss = model->pipeline_step(tokens.narrow(1, 0, T), tokens.narrow(1, 1, T), optim);
    } else {
      loss = model->loss(tokens.narrow(1, 0, T), tokens.narrow(1, 1, T));
      optim.backward(loss);
    }
    optim.step();
    optim.zero_grad();
    losses.push_back(loss.detach().item<double>());
  }
  bmt::optim::StateDict out;
  out["losses"] = at::tensor(losses, at::kDouble);
  {
    at::NoGradGuard no_grad;
    at::Tensor tokens = batch(c, 99);
    out["eval_loss"] = model->loss(tokens.narrow(1, 0, T), tokens.narrow(1, 1, T)).detach().to(at::kDouble);
  }
  for (auto& [key, value] : bmt::state_dict(*model)) out["sd." + key] = value;
  return out;
}

// torch's errors carry long backtraces; the rank's log keeps only its tail, so report the message itself.
bmt::optim::StateDict train(const examples::ModelConfig& c) {
  try {
    return train_impl(c);
  } catch (const c10::Error& e) {
    ADD_FAILURE() << e.what_without_backtrace();
    throw;
  }
}

void pp2_matches_pp1(const std::string& arch) {
  const examples::ModelConfig c = tiny(arch);
  // The rank processes re-run this test body: they find the parent's directory through the environment.
  std::string dir;
  if (const char* d = std::getenv("BMT_PP_MODELS_DIR")) {
    dir = d;
  } else {
    char tmpl[] = "/tmp/bmt_pp_models_XXXXXX";
    dir = mkdtemp(tmpl);
    setenv("BMT_PP_MODELS_DIR", dir.c_str(), 1);
  }
  const std::string ref = dir + "/reference_" + arch + ".pt";
  run_ranks(1, [&] { bmt::optim::save_state_dict(train(c), ref); });
  bmt::InitOptions init = bmt::testing::test_init();
  init.pipe_size = 2;
  init.num_micro_batches = 2;
  run_ranks(2, [&] {
    ASSERT_EQ(bmt::config().pipe_size, 2);
    const bmt::optim::StateDict got = train(c), want = bmt::optim::load_state_dict_file(ref);
    const std::string who = arch + " stage " + std::to_string(bmt::config().pipe_rank);
    for (int i = 0; i < kSteps; ++i) {
      const double g = got.at("losses")[i].item<double>(), w = want.at("losses")[i].item<double>();
      EXPECT_LE(std::abs(g - w), 2e-5 * std::abs(w)) << who << " step " << i << " loss " << g << " vs " << w;
    }
    const double ge = got.at("eval_loss").item<double>(), we = want.at("eval_loss").item<double>();
    EXPECT_LE(std::abs(ge - we), 2e-5 * std::abs(we)) << who << " held-out loss " << ge << " vs " << we;
    size_t keys = 0;
    for (const auto& [key, value] : got) {
      if (key.rfind("sd.", 0) != 0) continue;
      ++keys;
      ASSERT_TRUE(want.count(key)) << who << ": unexpected key " << key;
      EXPECT_LE((value - want.at(key)).abs().max().item<double>(), 1e-5) << who << ": " << key;
    }
    EXPECT_GT(keys, 0u);
  }, init);
  if (bmt::testing::in_rank_process()) return;
  EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
  unsetenv("BMT_PP_MODELS_DIR");
}

TEST(PipelineModels, GptPp2MatchesPp1) { pp2_matches_pp1("gpt"); }
TEST(PipelineModels, LlamaPp2MatchesPp1) { pp2_matches_pp1("llama"); }

}  // namespace
