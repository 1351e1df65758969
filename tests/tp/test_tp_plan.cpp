// Tensor-parallel plans (nn/tp_plan.h, nn/planned_layers.h). The plan as data: style names, validation, name
// matching. Applying it: a small model (vocab-parallel embedding with its tied head, a replicated LayerNorm, a
// column-parallel layer with 2 fused blocks and a row-parallel one, in a nested scope) built from one plan at
// tp 1 and tp 2 (sequence parallel and Megatron's replicated rows) gives the layers of the hand-built tensor-parallel
// path (types and options) and the logits, vocab-parallel loss and parameter gradients of plain LibTorch autograd
// on the same full weights. Errors: a name matching no module, a style that does not fit the layer, a plan whose
// sequence_parallel disagrees with the initialisation, a size tp does not divide (named by module), two entries
// matching one module, layers sharing an input with different layouts.
#include <gtest/gtest.h>

#include <functional>

#include "bmt/loss/fused_cross_entropy.h"
#include "bmt/nn/planned_layers.h"
#include "run_ranks.h"
#include "tp_test_util.h"

namespace {

using bmt::nn::TpPlan;
using bmt::nn::TpStyle;
using bmt::testing::expect_close;
using bmt::testing::logical_grad;
using bmt::testing::run_ranks;

constexpr int64_t kVocab = 10, kDim = 6, kFf = 8, kRows = 6;

bmt::InitOptions tp_init(int tp, bool sequence_parallel = true) {
  bmt::InitOptions o = bmt::testing::test_init();
  o.tp_size = tp;
  o.sequence_parallel = sequence_parallel;
  return o;
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing '" << needles.at(0) << "'";
  } catch (const bmt::core::Error& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TpPlan tiny_plan(bool sequence_parallel) {
  TpPlan plan;
  plan.sequence_parallel = sequence_parallel;
  plan.modules = {{"emb", {TpStyle::kVocabEmbedding}},
                  {"norm", {TpStyle::kReplicated}},
                  {"block.fc", {TpStyle::kColumn, 2}},
                  {"block.proj", {TpStyle::kRow}}};
  return plan;
}

struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl(const bmt::nn::TpScope& tp, int64_t ff) {
    fc = tp.linear(*this, "fc", kDim, ff, true, at::kFloat);  // two fused blocks a, b
    proj = tp.linear(*this, "proj", ff / 2, kDim, true, at::kFloat);
  }
  bmt::nn::PlannedLinear fc, proj;
};
TORCH_MODULE(TinyBlock);

// logits = emb-projection(h + proj(a * gelu(b))), (a, b) = fc(h), h = norm(emb[ids]): rows of ids in, every row's
// logits out. fc's fused blocks split over tp give this rank a slice of a and the matching slice of b, so the
// product is this rank's slice of proj's input features.
struct TinyImpl : torch::nn::Module {
  explicit TinyImpl(TpPlan plan, int64_t ff = kFf) {
    bmt::nn::TpBuilder tp(std::move(plan));
    emb = tp.root().embedding(*this, "emb", kVocab, kDim, at::kFloat);
    norm = register_module("norm", bmt::nn::LayerNorm(kDim));
    block = register_module("block", TinyBlock(tp.scope("block"), ff));
    tp.finish(*this);
  }
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor h = norm->forward(emb.forward(ids));
    auto ab = block->fc.forward(h).chunk(2, -1);
    h = h + block->proj.forward(ab[0] * at::gelu(ab[1]));
    return emb.projection(h);
  }
  bmt::nn::PlannedEmbedding emb;
  bmt::nn::LayerNorm norm{nullptr};
  TinyBlock block{nullptr};
};
TORCH_MODULE(Tiny);

TEST(TpPlanData, StyleNamesRoundTrip) {
  for (TpStyle s : {TpStyle::kReplicated, TpStyle::kColumn, TpStyle::kRow, TpStyle::kVocabEmbedding,
                    TpStyle::kVocabHead})
    EXPECT_EQ(bmt::nn::tp_style_from_name(bmt::nn::tp_style_name(s)), s);
  expect_error([] { bmt::nn::tp_style_from_name("colum"); }, {"unknown style 'colum'", "column, row"});
}

TEST(TpPlanData, ValidationNamesTheEntry) {
  auto plan_with = [](const std::string& name, bmt::nn::TpLayout layout) {
    TpPlan p;
    p.modules[name] = layout;
    return p;
  };
  EXPECT_NO_THROW(bmt::nn::validate_tp_plan(plan_with("layers.*.attn.c_attn", {TpStyle::kColumn, 3})));
  expect_error([&] { bmt::nn::validate_tp_plan(plan_with("layers..fc", {TpStyle::kRow})); },
               {"'layers..fc'", "empty component"});
  expect_error([&] { bmt::nn::validate_tp_plan(plan_with("", {TpStyle::kRow})); }, {"empty"});
  expect_error([&] { bmt::nn::validate_tp_plan(plan_with("fc", {TpStyle::kColumn, 0})); },
               {"'fc' has split_groups = 0"});
  expect_error([&] { bmt::nn::validate_tp_plan(plan_with("proj", {TpStyle::kRow, 3})); },
               {"'proj' has split_groups = 3 with style row"});
}

TEST(TpPlanData, NamesMatchComponentWise) {
  using bmt::nn::tp_plan_name_matches;
  EXPECT_TRUE(tp_plan_name_matches("layers.*.attn.c_attn", "layers.11.attn.c_attn"));
  EXPECT_TRUE(tp_plan_name_matches("wte", "wte"));
  EXPECT_FALSE(tp_plan_name_matches("layers.*.attn.c_attn", "layers.1.attn.c_proj"));
  EXPECT_FALSE(tp_plan_name_matches("layers.*", "layers.1.attn"));  // a "*" is one component, not a prefix
  EXPECT_FALSE(tp_plan_name_matches("attn.c_attn", "layers.1.attn.c_attn"));
  TpPlan plan;
  plan.modules = {{"block.*", {TpStyle::kRow}}, {"block.fc", {TpStyle::kColumn}}};
  EXPECT_EQ(bmt::nn::find_tp_entry(plan, "block.proj")->first, "block.*");
  EXPECT_EQ(bmt::nn::find_tp_entry(plan, "other"), nullptr);
  expect_error([&] { bmt::nn::find_tp_entry(plan, "block.fc"); }, {"'block.fc' matches both", "one entry"});
}

// The planned model against plain LibTorch autograd on the same full weights.
void check_tiny_against_dense() {
  const bmt::Config& cfg = bmt::config();
  const bool sp = cfg.sequence_parallel, split = cfg.tp_size > 1;
  Tiny model(tiny_plan(sp));

  // The layers the hand-built tensor-parallel path would use, with its options.
  if (split) {
    auto* fc = dynamic_cast<bmt::nn::ColumnParallelLinearImpl*>(&model->block->fc.module());
    auto* proj = dynamic_cast<bmt::nn::RowParallelLinearImpl*>(&model->block->proj.module());
    auto* emb = dynamic_cast<bmt::nn::VPEmbeddingImpl*>(&model->emb.module());
    ASSERT_TRUE(fc && proj && emb);
    EXPECT_EQ(fc->gather_input, sp);
    EXPECT_FALSE(fc->gather_output);
    EXPECT_EQ(fc->split_groups, 2);
    EXPECT_FALSE(proj->split_input);
    EXPECT_EQ(proj->all_reduce_output, !sp);
    EXPECT_EQ(emb->sequence_parallel, sp);
    EXPECT_EQ(model->block->fc.local_out_features(), kFf / cfg.tp_size);
    EXPECT_TRUE(model->emb.vocab_parallel());
  } else {
    EXPECT_NE(dynamic_cast<bmt::nn::LinearImpl*>(&model->block->fc.module()), nullptr);
    EXPECT_NE(dynamic_cast<bmt::nn::LinearImpl*>(&model->block->proj.module()), nullptr);
    EXPECT_NE(dynamic_cast<bmt::nn::EmbeddingImpl*>(&model->emb.module()), nullptr);
    EXPECT_EQ(model->block->fc.style(), TpStyle::kReplicated);
    EXPECT_FALSE(model->emb.vocab_parallel());
  }
  // Keys are the dense model's, whatever the plan chose.
  std::vector<std::string> keys;
  for (const auto& item : model->named_parameters()) keys.push_back(item.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"emb.weight", "norm.weight", "norm.bias", "block.fc.weight",
                                            "block.fc.bias", "block.proj.weight", "block.proj.bias"}));

  // The same random full weights on every rank.
  at::manual_seed(3);
  std::map<std::string, at::Tensor> full;
  for (const auto& item : model->named_parameters()) {
    std::vector<int64_t> shape = bmt::meta_of(item.value()).logical_shape();
    full[item.key()] = at::randn(shape).requires_grad_();
    bmt::scatter_logical(item.value(), full[item.key()].detach());
  }
  at::Tensor ids = at::randint(0, kVocab, {kRows}, at::TensorOptions().dtype(at::kLong));
  at::Tensor targets = at::randint(0, kVocab, {kRows}, at::TensorOptions().dtype(at::kLong));

  at::Tensor h = at::layer_norm(at::embedding(full["emb.weight"], ids), {kDim}, full["norm.weight"], full["norm.bias"]);
  auto ab = at::linear(h, full["block.fc.weight"], full["block.fc.bias"]).chunk(2, -1);
  h = h + at::linear(ab[0] * at::gelu(ab[1]), full["block.proj.weight"], full["block.proj.bias"]);
  at::Tensor want_logits = at::linear(h, full["emb.weight"]);
  at::Tensor want_loss = at::cross_entropy_loss(want_logits, targets);
  want_loss.backward();

  at::Tensor logits = model->forward(ids);
  bmt::loss::FusedCrossEntropyOptions o;
  o.parallel = split;
  at::Tensor loss = bmt::loss::fused_cross_entropy(logits, targets, o);
  loss.backward();
  at::Tensor all_logits = logits.detach();
  if (split) {
    at::Tensor slices = bmt::distributed::raw_all_gather(all_logits.contiguous(), *cfg.tp_comm);
    all_logits = at::cat(slices.unbind(0), -1);
  }
  expect_close(all_logits, want_logits, "logits");
  expect_close(loss, want_loss, "loss");
  for (const auto& item : model->named_parameters())
    expect_close(logical_grad(item.value()), full[item.key()].grad(), item.key() + " gradient");
}

TEST(TpPlanApply, Tp1BuildsTheDenseLayers) { run_ranks(1, check_tiny_against_dense); }

TEST(TpPlanApply, Tp2SequenceParallelMatchesDense) { run_ranks(2, check_tiny_against_dense, tp_init(2)); }

TEST(TpPlanApply, Tp2ReplicatedRowsMatchesDense) { run_ranks(2, check_tiny_against_dense, tp_init(2, false)); }

TEST(TpPlanApply, ErrorsNameTheModuleAndTheFix) {
  auto cases = [] {
    const bool split = bmt::config().tp_size > 1;
    TpPlan plan = tiny_plan(true);
    plan.modules["block.fcx"] = {TpStyle::kColumn};
    expect_error([&] { Tiny m(plan); }, {"no module of the model matches 'block.fcx'", "block.fc", "norm"});

    plan = tiny_plan(true);
    plan.modules["emb"] = {TpStyle::kColumn};
    expect_error([&] { Tiny m(plan); }, {"emb is an Embedding", "makes it column", "replicated or vocab_embedding"});

    plan = tiny_plan(true);
    plan.modules["block.fc"] = {TpStyle::kVocabEmbedding};
    expect_error([&] { Tiny m(plan); }, {"block.fc is a Linear", "vocab_embedding"});

    plan = tiny_plan(true);
    plan.modules["norm"] = {TpStyle::kRow};
    expect_error([&] { Tiny m(plan); }, {"norm (", "not built through the plan", "makes it row"});

    plan = tiny_plan(true);
    plan.modules["block.*"] = {TpStyle::kRow};
    expect_error([&] { Tiny m(plan); }, {"'block.fc' matches both"});

    if (!split) return;
    // 2 fused blocks of 3 features: tp 2 does not divide a block.
    expect_error([&] { Tiny m(tiny_plan(true), 6); }, {"building block.fc as column",
                                                       "out_features / split_groups = 3 is not divisible by tp_size 2"});
    expect_error([&] { Tiny m(tiny_plan(false)); }, {"sequence_parallel = 0", "initialised with sequence_parallel = 1"});

    plan = tiny_plan(true);
    plan.modules["block.proj"] = {TpStyle::kReplicated};
    plan.modules["block.fc"] = {TpStyle::kColumn};
    Tiny m(plan);
    at::Tensor x = at::zeros({kRows / 2, kDim});
    expect_error([&] { bmt::nn::shared_input(x, {&m->block->fc, &m->block->proj}); },
                 {"block.fc (column) and block.proj (replicated)", "different input layouts"});
  };
  run_ranks(1, cases);                // names and styles are checked at tp 1 too
  run_ranks(2, cases, tp_init(2));
}

}  // namespace
