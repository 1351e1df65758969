// Tensor-parallel GPT and Llama (examples/models, layout in models/gpt.h) on CPU ranks over Gloo, against the same
// model at world 1 (tp 1, the dense code) fed the same global batch: a run_ranks(1) reference writes its losses,
// gradient norms, state_dict and greedy samples to a file; the tensor-parallel run (dp 2 x tp 2 with ZeRO-3,
// sequence parallel; Megatron's replicated layout at tp 2) trains 4 AdamW steps with clipping from the same
// initialisation and compares: losses and norms within 2e-5 relative, every tp-replicated parameter bit-identical
// over the tp ranks, state_dict keys equal and values within 1e-5, the same greedy tokens. Sequence lengths make
// some batches' B·T rows odd, so the padding of sequence-parallel rows is exercised (generation too).
// Llama runs (tp 1 and tp 2) also check their first step's loss and gradient norm against the independent
// plain-LibTorch Llama (llama_reference.h) on the whole global batch, so the chain does not rest on the library at
// tp 1 alone. Bad tp sizes fail with errors naming the layer and the sizes. A custom TpPlan (only the attention
// split, the MLP replicated, Megatron layout) matches the dense model too; plans naming a missing module or leaving
// the vocabulary replicated under sequence parallelism are refused. Label multirank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>

#include "bmt/runtime/distributed.h"
#include "bmt/nn/parallel_layers.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/optim/flat_state_dict.h"
#include "bmt/params/parameter.h"
#include "bmt/params/module_state.h"
#include "llama_reference.h"
#include "models/gpt.h"
#include "models/language_model.h"
#include "run_ranks.h"
#include "train/generate.h"
#include "train/trainer.h"

namespace {

using bmt::testing::run_ranks;

constexpr int kSteps = 4;
constexpr int64_t kGlobalBatch = 4;

examples::ModelConfig gpt_config() {
  examples::ModelConfig c;
  c.vocab_size = 38;
  c.max_seq_len = 12;
  c.num_layers = 2;
  c.dim = 16;
  c.num_heads = 4;
  c.ffn_dim = 40;
  return c;
}

examples::ModelConfig llama_config() {  // grouped-query attention: 4 query heads, 2 kv heads
  examples::ModelConfig c;
  c.arch = "llama";
  c.vocab_size = 30;
  c.max_seq_len = 10;
  c.num_layers = 2;
  c.dim = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_dim = 48;
  return c;
}

bmt::InitOptions tp_init(int tp, bool sequence_parallel = true) {
  bmt::InitOptions o = bmt::testing::test_init();
  o.tp_size = tp;
  o.sequence_parallel = sequence_parallel;
  return o;
}

// A directory shared by the parent and every rank process of this test (children inherit the variable).
std::string shared_dir() {
  if (const char* d = std::getenv("BMT_EXAMPLES_TP_DIR")) return d;
  char tmpl[] = "/tmp/bmt_examples_tp_XXXXXX";
  std::string dir = mkdtemp(tmpl);
  setenv("BMT_EXAMPLES_TP_DIR", dir.c_str(), 1);
  return dir;
}

void remove_shared_dir() {
  if (bmt::testing::in_rank_process()) return;
  const std::string dir = shared_dir();
  // Not fs::remove_all: libtorch.so exports an incompatible std::filesystem::remove_all.
  EXPECT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0);
  unsetenv("BMT_EXAMPLES_TP_DIR");
}

// Step s's global batch (kGlobalBatch, seq + 1), identical on every rank; seq varies per step (odd row counts).
at::Tensor global_batch(const examples::ModelConfig& c, int step) {
  const int64_t seq = c.max_seq_len - (step % 2);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  return at::randint(0, c.vocab_size, {kGlobalBatch, seq + 1}, gen, at::TensorOptions().dtype(at::kLong));
}

// Trains kSteps steps on this data-parallel rank's share of each global batch; returns what the comparison needs.
bmt::optim::StateDict train_and_record(const examples::ModelConfig& c,
                                       std::optional<bmt::nn::TpPlan> plan = std::nullopt) {
  const auto& cfg = bmt::config();
  const int dp = cfg.tp_zero_size, dp_rank = cfg.tp_zero_rank;
  auto model = examples::make_model(c, {3, false, plan}, at::kFloat);
  at::manual_seed(5);
  bmt::init_parameters(*model);
  // lr 1e-3: Adam divides by sqrt(v), so elements with gradients near eps turn fp32 summation-order differences
  // (~1e-7 relative in the gradients) into larger update differences; at 1e-3 they stay below ~3e-6.
  bmt::optim::AdamOptions adam(1e-3, {0.9, 0.95}, 1e-8, 0.1);
  adam.decoupled_weight_decay(true);
  auto optimizer = std::make_shared<bmt::optim::AdamOptimizer>(model->parameters(), adam);
  bmt::optim::OptimManagerOptions om;
  om.grad_scale = dp;  // gradients are summed over the data-parallel group only
  bmt::optim::OptimManager optim(om);
  optim.add_optimizer(optimizer);

  // Plain-LibTorch loss and gradient 2-norm of step 0 from the same initial weights (llama only).
  double plain_loss = 0, plain_norm = 0;
  if (c.arch == "llama") {
    std::map<std::string, at::Tensor> P;
    for (auto& [key, value] : bmt::state_dict(*model)) P[key] = value.clone().requires_grad_();
    const llama_ref::Shape shape{c.num_layers, c.dim, c.num_heads, c.kv_heads(), c.norm_eps, c.rope_theta};
    at::Tensor tokens = global_batch(c, 0);
    const int64_t seq = tokens.size(1) - 1;
    at::Tensor loss = llama_ref::mean_cross_entropy(llama_ref::logits(shape, P, tokens.narrow(1, 0, seq)),
                                                    tokens.narrow(1, 1, seq));
    loss.backward();
    plain_loss = loss.item<double>();
    for (auto& kv : P) plain_norm += kv.second.grad().pow(2).sum().item<double>();
    plain_norm = std::sqrt(plain_norm);
  }

  bmt::optim::StateDict out;
  std::vector<double> losses, norms;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor tokens = global_batch(c, step);
    const int64_t share = kGlobalBatch / dp, seq = tokens.size(1) - 1;
    at::Tensor mine = tokens.narrow(0, share * dp_rank, share);
    at::Tensor loss = model->loss(mine.narrow(1, 0, seq), mine.narrow(1, 1, seq));
    optim.backward(loss);
    norms.push_back(optim.clip_grad_norm(0.5));  // clipping active: the norm must count every element once
    optim.step();
    optim.zero_grad();
    losses.push_back(bmt::sum_loss(loss.detach()).item<double>());  // the mean over the global batch
  }
  if (c.arch == "llama") {
    const std::string who = "tp " + std::to_string(cfg.tp_size) + " rank " + std::to_string(cfg.rank);
    EXPECT_LE(std::abs(losses[0] - plain_loss), 2e-5 * plain_loss) << who << ": step 0 loss vs plain LibTorch Llama";
    EXPECT_LE(std::abs(norms[0] - plain_norm), 2e-5 * plain_norm)
        << who << ": step 0 gradient norm vs plain LibTorch Llama (" << norms[0] << " vs " << plain_norm << ")";
  }
  out["losses"] = at::tensor(losses, at::kDouble);
  out["norms"] = at::tensor(norms, at::kDouble);
  for (auto& [key, value] : bmt::state_dict(*model)) out["sd." + key] = value;
  // Greedy generation (context lengths 3..6: odd row counts too) and the vocabulary-parallel argmax.
  examples::GenerateOptions gen;
  gen.max_new_tokens = 4;
  std::vector<int64_t> tokens = examples::generate(*model, {1, 2, 3}, gen);
  out["generated"] = at::tensor(tokens, at::kLong);
  {
    at::NoGradGuard no_grad;
    at::Tensor ids = global_batch(c, 0).narrow(1, 0, 5);
    out["argmax"] = model->argmax_vocab(model->forward(ids));
    out["eval_loss"] = model->loss(ids.narrow(1, 0, 4), ids.narrow(1, 1, 4)).detach().to(at::kDouble);
  }

  // Every tp-replicated parameter is bit-identical over the tp ranks (after the clipped, decayed steps).
  for (auto& item : model->named_parameters()) {
    const bmt::ParamMeta& m = bmt::meta_of(item.value());
    if (m.is_tp_split()) continue;
    at::Tensor full = bmt::gather_full(item.value());
    if (cfg.tp_size == 1) continue;
    at::Tensor all = bmt::distributed::raw_all_gather(full.contiguous(), *cfg.tp_comm);
    for (int r = 1; r < cfg.tp_size; ++r)
      EXPECT_TRUE(at::equal(all[r], all[0])) << item.key() << " differs between tp ranks 0 and " << r;
    EXPECT_NE(m.tp_grad_reduce, bmt::TpGradReduce::kNone) << item.key();
  }
  return out;
}

void expect_rel(double got, double want, double tol, const std::string& what) {
  EXPECT_LE(std::abs(got - want), tol * std::max(1e-12, std::abs(want))) << what << ": " << got << " vs " << want;
}

// Compares this rank's run with the reference written by the tp 1 run.
void compare_with_reference(const bmt::optim::StateDict& got, const std::string& ref_path) {
  const bmt::optim::StateDict want = bmt::optim::load_state_dict_file(ref_path);
  const std::string who = "rank " + std::to_string(bmt::rank()) + ", tp rank " + std::to_string(bmt::config().tp_rank);
  for (const char* key : {"losses", "norms"}) {
    at::Tensor g = got.at(key), w = want.at(key);
    ASSERT_EQ(g.numel(), w.numel());
    for (int64_t i = 0; i < g.numel(); ++i)
      expect_rel(g[i].item<double>(), w[i].item<double>(), 2e-5, who + " " + key + "[" + std::to_string(i) + "]");
  }
  expect_rel(got.at("eval_loss").item<double>(), want.at("eval_loss").item<double>(), 2e-5, who + " eval loss");
  EXPECT_TRUE(at::equal(got.at("generated"), want.at("generated"))) << who << ": " << got.at("generated") << " vs "
                                                                    << want.at("generated");
  EXPECT_TRUE(at::equal(got.at("argmax"), want.at("argmax"))) << who;
  size_t keys = 0;
  for (const auto& [key, w] : want) {
    if (key.rfind("sd.", 0) != 0) continue;
    ++keys;
    auto it = got.find(key);
    ASSERT_TRUE(it != got.end()) << who << ": missing state_dict key " << key.substr(3);
    ASSERT_EQ(it->second.sizes(), w.sizes()) << key;
    EXPECT_LE((it->second - w).abs().max().item<double>(), 1e-5) << who << ": state_dict value " << key.substr(3);
  }
  size_t got_keys = 0;
  for (const auto& kv : got) got_keys += kv.first.rfind("sd.", 0) == 0;
  EXPECT_EQ(got_keys, keys) << who << ": state_dict has extra keys";
}

void tp_matches_dense(const examples::ModelConfig& c, int world, bmt::InitOptions init,
                      std::optional<bmt::nn::TpPlan> plan = std::nullopt) {
  const std::string ref = shared_dir() + "/reference.pt";
  run_ranks(1, [&] { bmt::optim::save_state_dict(train_and_record(c, plan), ref); });
  run_ranks(world, [&] {
    ASSERT_EQ(bmt::config().tp_size, 2);
    compare_with_reference(train_and_record(c, plan), ref);
  }, init);
  remove_shared_dir();
}

TEST(TensorParallelModels, GptDp2Tp2SequenceParallelMatchesDense) { tp_matches_dense(gpt_config(), 4, tp_init(2)); }

TEST(TensorParallelModels, GptTp2MegatronLayoutMatchesDense) {
  tp_matches_dense(gpt_config(), 2, tp_init(2, /*sequence_parallel=*/false));
}

// The same model definition under another plan: the MLPs replicated (every rank computes them on all rows).
TEST(TensorParallelModels, GptTp2PlanWithReplicatedMlpMatchesDense) {
  bmt::nn::TpPlan plan = examples::gpt_tp_plan(/*sequence_parallel=*/false);
  plan.modules.erase("layers.*.mlp.c_fc");
  plan.modules["layers.*.mlp.c_proj"] = {bmt::nn::TpStyle::kReplicated};
  tp_matches_dense(gpt_config(), 2, tp_init(2, /*sequence_parallel=*/false), plan);
}

TEST(TensorParallelModels, PlansNamingMissingModulesOrReplicatedVocabAreRefused) {
  run_ranks(2, [] {
    auto expect_error = [](bmt::nn::TpPlan plan, const std::vector<std::string>& needles) {
      try {
        examples::make_model(gpt_config(), {3, false, plan}, at::kFloat);
        ADD_FAILURE() << "no error";
      } catch (const std::exception& e) {
        for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
      }
    };
    bmt::nn::TpPlan plan = examples::gpt_tp_plan();
    plan.modules["layers.*.mlp.fc"] = {bmt::nn::TpStyle::kColumn};
    expect_error(plan, {"no module of the model matches 'layers.*.mlp.fc'", "layers.*.mlp.c_fc", "ln_f"});
    plan = examples::gpt_tp_plan();
    plan.modules["layers.*.ln_1"] = {bmt::nn::TpStyle::kColumn};
    expect_error(plan, {"layers.0.ln_1", "not built through the plan"});
    plan = examples::gpt_tp_plan();
    plan.modules.erase("wte");
    expect_error(plan, {"token embedding 'wte'", "vocab_embedding and vocab_head", "replicated"});
  }, tp_init(2));
}

TEST(TensorParallelModels, LlamaGqaDp2Tp2SequenceParallelMatchesDense) { tp_matches_dense(llama_config(), 4, tp_init(2)); }

// train_gpt's loop at dp 1 x tp 2 (the synthetic data's 13 ids padded to 14): it evaluates and samples, and a
// run interrupted by a checkpoint and resumed at tp 2 ends where the uninterrupted run does.
TEST(TensorParallelModels, TrainerAtTp2ResumesTheSameRun) {
  const std::string root = shared_dir();
  run_ranks(2, [&] {
    examples::TrainArgs a;
    a.tp = 2;
    a.progress = "off";
    a.batch = 4;
    a.seq = 24;
    a.eval_every = 1000;
    a.eval_batches = 1;
    a.task_rows = 8;
    a.samples = 1;
    a.sample_tokens = 3;
    a.steps = 6;
    a.save_dir = root + "/straight";
    const examples::TrainResult straight = examples::run_training(a);
    ASSERT_EQ(straight.samples.size(), 1u);
    ASSERT_TRUE(straight.last_task_acc.has_value());
    a.samples = 0;
    a.save_dir = root + "/resumed";
    a.stop_at = 3;
    a.save_every = 3;
    EXPECT_EQ(examples::run_training(a).end_step, 3);
    EXPECT_TRUE(std::filesystem::exists(a.save_dir + "/step_00000003/rank-00001.bin"));  // sharded format
    a.stop_at = -1;
    a.save_every = 0;
    a.resume = true;
    const examples::TrainResult resumed = examples::run_training(a);
    EXPECT_EQ(resumed.start_step, 3);
    EXPECT_NEAR(resumed.last_eval_loss.value(), straight.last_eval_loss.value(), 1e-5);
  }, tp_init(2));
  remove_shared_dir();
}

TEST(TensorParallelModels, SizesNotDivisibleByTpNameTheLayer) {
  run_ranks(2, [] {
    auto expect_error = [](examples::ModelConfig c, const std::vector<std::string>& needles) {
      try {
        examples::make_model(c, {}, at::kFloat);
        ADD_FAILURE() << "no error for " << c.describe();
      } catch (const std::exception& e) {
        for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
      }
    };
    examples::ModelConfig c = gpt_config();
    c.num_heads = 1;
    expect_error(c, {"num_heads = 1 is not divisible by tp_size 2", "attn.c_attn"});
    c = gpt_config();
    c.ffn_dim = 41;
    expect_error(c, {"ffn_dim = 41 is not divisible by tp_size 2", "mlp.c_fc"});
    c = gpt_config();
    c.vocab_size = 37;
    expect_error(c, {"vocab_size = 37 is not divisible by tp_size 2", "wte"});
    c = llama_config();
    c.num_kv_heads = 1;
    expect_error(c, {"num_kv_heads = 1 is not divisible by tp_size 2", "attention.wk"});
    c = llama_config();
    c.vocab_size = 29;
    expect_error(c, {"vocab_size = 29", "output"});
    // A fused projection whose blocks tp does not divide (the layer's own check).
    try {
      bmt::nn::ColumnParallelLinear(4, 9, true, at::kFloat, false, true, bmt::init::normal(0, 1), 3);
      ADD_FAILURE() << "no error for 3 blocks of 3 features at tp 2";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("out_features / split_groups = 3 is not divisible by tp_size 2"),
                std::string::npos) << e.what();
    }
  }, tp_init(2));
}

}  // namespace
