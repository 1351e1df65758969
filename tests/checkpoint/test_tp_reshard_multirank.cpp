// Tensor-parallel checkpoints. A small model (VPEmbedding, LayerNorm, a ZeRO-3 Block holding a grouped (gate/up)
// ColumnParallelLinear -> GELU-gated product -> RowParallelLinear with biases, a gather-output ColumnParallelLinear head; Megatron layout) is trained 2
// steps with AdamOptimizer under an OptimManager at world 4 / tp 2 (dp 2) and saved as a sharded checkpoint and as
// consolidated .safetensors / .pt. The sharded checkpoint then loads at world 4 tp 2 (bit-identical resume), world 1
// tp 1, world 4 tp 4, world 2 tp 2 and world 2 tp 1: bmt::state_dict equals the saved logical values exactly, and 2
// more steps give the uninterrupted run's losses (within 1e-5 relative). The consolidated files and bmt-ckpt's
// export hold exactly the logical values; consolidated files load at tp 2, 4 and 1. Mismatches name logical shapes.
// Also: the tp re-cut (assemble_piece_range) against plain slicing for every split dim / tp size pair.
#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/consolidated.h"
#include "bmt/checkpoint/export.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/checkpoint/tp_layout.h"
#include "bmt/nn/parallel_layers.h"
#include "ckpt_test_util.h"

using namespace ckpt_test;
namespace ck = bmt::checkpoint;

namespace {

constexpr int64_t kVocab = 16, kDim = 8, kFf = 16, kRows = 12, kSteps = 2;

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t ff)
      // A fused gate/up projection (2 blocks, each split over tp): the grouped layout of GPT's Q/K/V weight.
      : up(register_module("up", bmt::nn::ColumnParallelLinear(kDim, 2 * ff, true, at::kFloat, false, false,
                                                               bmt::init::normal(0.0, 0.02), 2))),
        down(register_module("down", bmt::nn::RowParallelLinear(ff, kDim, true, at::kFloat, false, true))) {}
  at::Tensor forward(const at::Tensor& x) {
    auto gate_up = up->forward(x).chunk(2, -1);
    return x + down->forward(at::gelu(gate_up[0]) * gate_up[1]);
  }
  bmt::nn::ColumnParallelLinear up;
  bmt::nn::RowParallelLinear down;
};
TORCH_MODULE(Mlp);

struct TpModel : torch::nn::Module {
  explicit TpModel(int64_t ff = kFf) {
    embed = register_module("embed", bmt::nn::VPEmbedding(kVocab, kDim, at::kFloat, bmt::init::normal(0, 0.5), false));
    ln = register_module("ln", bmt::nn::LayerNorm(kDim));
    mlp = register_module("mlp", Mlp(ff));
    block = bmt::make_block(mlp.ptr(), bmt::BlockOptions{3, true});
    head = register_module("head", bmt::nn::ColumnParallelLinear(kDim, kVocab, true, at::kFloat, true, false,
                                                                 bmt::init::normal(0, 0.5)));
  }
  at::Tensor forward(const at::Tensor& ids) { return head->forward(block->forward(ln->forward(embed->forward(ids)))); }
  bmt::nn::VPEmbedding embed{nullptr};
  bmt::nn::LayerNorm ln{nullptr};
  Mlp mlp{nullptr};
  std::shared_ptr<bmt::Block> block;
  bmt::nn::ColumnParallelLinear head{nullptr};
};

bmt::InitOptions tp_init(int tp) {
  bmt::InitOptions o = bmt::testing::test_init();
  o.tp_size = tp;
  o.sequence_parallel = false;
  return o;
}

struct TpTrainer {
  std::unique_ptr<TpModel> model;
  std::shared_ptr<bmt::optim::AdamOptimizer> adam;
  std::unique_ptr<bmt::optim::OptimManager> manager;

  explicit TpTrainer(int64_t ff = kFf) {
    model = std::make_unique<TpModel>(ff);
    at::manual_seed(kSeed);
    bmt::init_parameters(*model);
    adam = std::make_shared<bmt::optim::AdamOptimizer>(model->parameters(), bmt::optim::AdamOptions(1e-2));
    bmt::optim::OptimManagerOptions mo;
    mo.grad_scale = bmt::config().tp_zero_size;  // per-rank mean losses summed over dp: the global mean
    manager = std::make_unique<bmt::optim::OptimManager>(mo);
    manager->add_optimizer(adam);
  }

  ck::TrainingState state(int64_t step) {
    ck::TrainingState s;
    s.model = model.get();
    s.add("optim", *manager);
    s.step = step;
    return s;
  }

  // One update on global batch `step` (split over the data-parallel ranks, the same on every tp rank).
  double step(int step) {
    const auto& cfg = bmt::config();
    at::Generator g = at::make_generator<at::CPUGeneratorImpl>(7000 + step);
    at::Tensor tok = at::randint(0, kVocab, {kRows, 2}, g, at::TensorOptions().dtype(at::kLong));
    const int64_t per = kRows / cfg.tp_zero_size;
    tok = tok.narrow(0, cfg.tp_zero_rank * per, per);
    at::Tensor loss = at::cross_entropy_loss(model->forward(tok.select(1, 0)), tok.select(1, 1));
    manager->backward(loss);
    manager->step();
    manager->zero_grad();
    // Identical on the ranks of a tp group: the world mean is the data-parallel mean.
    at::Tensor sum = bmt::distributed::raw_all_reduce(loss.detach().reshape({1}), bmt::core::ReduceOp::kSum, *cfg.comm);
    return sum.item<double>() / cfg.world_size;
  }
};

// Rank 0 writes `sd` with the plain tensor-file writer (independent of the checkpoint's tp assembly).
void write_reference(const bmt::StateDict& sd, const std::string& path) {
  if (bmt::rank() != 0) return;
  std::vector<ck::TensorInfo> infos;
  for (const auto& kv : sd) infos.push_back({kv.first, ck::dtype_name(kv.second.scalar_type()), kv.second.sizes().vec()});
  auto w = ck::create_tensor_file(path, infos);
  for (const auto& kv : sd) {
    at::Tensor c = kv.second.contiguous();
    w->append(c.data_ptr(), static_cast<int64_t>(c.nbytes()));
  }
  w->commit();
}

std::map<std::string, at::Tensor> read_tensors(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  auto f = ck::open_tensor_file(path);
  for (size_t i = 0; i < f->tensors().size(); ++i) {
    const ck::TensorInfo& ti = f->tensors()[i];
    at::Tensor t = at::empty(ti.shape, at::TensorOptions().dtype(ck::scalar_type_of(ti.dtype)));
    f->read(i, 0, static_cast<int64_t>(t.nbytes()), t.data_ptr());
    out[ti.name] = t;
  }
  return out;
}

void expect_equal_tensors(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                          const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& kv : want) {
    auto it = got.find(kv.first);
    ASSERT_TRUE(it != got.end()) << what << ": no " << kv.first;
    EXPECT_EQ(it->second.sizes(), kv.second.sizes()) << what << ": " << kv.first;
    EXPECT_TRUE(it->second.sizes() == kv.second.sizes() && at::equal(it->second, kv.second)) << what << ": " << kv.first;
  }
}

void perturb(TpModel& model) {
  at::NoGradGuard ng;
  for (auto& p : model.parameters()) p.detach().fill_(-3);
}

void resume_and_compare(const SharedDir& dir, bool exact) {
  const auto& cfg = bmt::config();
  const std::string where = "world " + std::to_string(cfg.world_size) + " tp " + std::to_string(cfg.tp_size);
  TpTrainer t;
  t.step(100);  // optimizer state and parameters the load must overwrite
  ck::TrainingState st = t.state(0);
  ck::LoadInfo info = ck::load(dir / "ckpt", st);
  EXPECT_EQ(info.step, kSteps);
  EXPECT_EQ(info.saved_world_size, 4);
  EXPECT_EQ(info.rng_restored, cfg.world_size == 4 && cfg.tp_size == 2) << where;
  expect_equal_tensors(bmt::state_dict(*t.model), read_tensors(dir / "ref.safetensors"), "state_dict at " + where);
  std::vector<double> ref = read_doubles(dir / "losses.txt");
  ASSERT_EQ(ref.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    const double loss = t.step(kSteps + s);
    if (exact) EXPECT_EQ(loss, ref[static_cast<size_t>(s)]) << "step " << s << " " << where;
    else EXPECT_NEAR(loss, ref[static_cast<size_t>(s)], 1e-5 * std::abs(ref[static_cast<size_t>(s)])) << "step " << s << " " << where;
  }
}

void load_consolidated(const SharedDir& dir) {
  for (const char* name : {"model.safetensors", "model.pt"}) {
    TpModel model;
    bmt::ConsolidatedOptions o;
    o.chunk_nbytes = 40;
    bmt::LoadResult r = bmt::load(model, dir / name, true, o);
    EXPECT_TRUE(r.missing_keys.empty() && r.unexpected_keys.empty());
    expect_equal_tensors(bmt::state_dict(model), read_tensors(dir / "ref.safetensors"),
                         std::string(name) + " loaded at tp " + std::to_string(bmt::config().tp_size));
  }
}

}  // namespace

TEST(TpCheckpoint, SavedAtTp2LoadsAtTp1AndTp4) {
  SharedDir dir("tp_reshard");
  bmt::testing::run_ranks(4, [&] {
    TpTrainer t;
    ASSERT_TRUE(bmt::meta_of(t.model->mlp->down->weight).is_tp_split());
    for (int s = 0; s < kSteps; ++s) t.step(s);
    ck::save(dir / "ckpt", t.state(kSteps)).wait();
    const bmt::StateDict sd = bmt::state_dict(*t.model);
    write_reference(sd, dir / "ref.safetensors");
    // Consolidated files at tp 2: logical tensors, small chunks (several logical rows per split piece).
    for (const char* name : {"model.safetensors", "model.pt"}) {
      bmt::ConsolidatedOptions o;
      o.chunk_nbytes = 40;
      bmt::save(*t.model, dir / name, o);
    }
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) losses.push_back(t.step(kSteps + s));
    EXPECT_NE(losses[0], losses[1]);
    if (bmt::rank() == 0) write_doubles(dir / "losses.txt", losses);
  }, tp_init(2));
  // The files written at tp 2 hold exactly the logical values.
  if (!bmt::testing::in_rank_process()) {
    const auto ref = read_tensors(dir / "ref.safetensors");
    ASSERT_EQ(ref.at("mlp.down.weight").sizes(), at::IntArrayRef({kDim, kFf}));
    for (const char* name : {"model.safetensors", "model.pt"}) expect_equal_tensors(read_tensors(dir / name), ref, name);
    // bmt-ckpt export: logical tensors from the stacked pieces.
    for (const char* name : {"export.safetensors", "export.pt"}) {
      ck::export_consolidated(dir / "ckpt", dir / name, "model/", 48);
      expect_equal_tensors(read_tensors(dir / name), ref, name);
    }
    const std::string info = ck::describe_checkpoint(dir / "ckpt", true);
    EXPECT_NE(info.find("model/mlp.down.weight  F32 [2, 8, 8]  tp pieces of [8, 16] (split along dim 1 over tp 2)"),
              std::string::npos) << info;
    EXPECT_NE(info.find("optim/shard/optimizers.0.embed.weight/exp_avg  F32 [2, 8, 8]  tp pieces of [16, 8] (split "
                        "along dim 0 over tp 2)"), std::string::npos) << info;
    EXPECT_NE(info.find("model/ln.weight  F32 [8]  pieces"), std::string::npos) << info;
    EXPECT_TRUE(ck::CheckpointReader(dir / "ckpt").verify_all().empty());
  }
  bmt::testing::run_ranks(4, [&] { resume_and_compare(dir, true); }, tp_init(2));
  bmt::testing::run_ranks(1, [&] { resume_and_compare(dir, false); }, tp_init(1));
  bmt::testing::run_ranks(4, [&] {
    resume_and_compare(dir, false);
    load_consolidated(dir);
  }, tp_init(4));
  bmt::testing::run_ranks(2, [&] {
    resume_and_compare(dir, false);
    load_consolidated(dir);
    // A different model: the errors name logical shapes.
    TpTrainer wrong(32);
    ck::TrainingState st = wrong.state(0);
    std::string msg;
    try {
      ck::load(dir / "ckpt", st);
    } catch (const bmt::core::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("mlp.down.weight: checkpoint has F32 [8, 16] (split along dim 1 over tp 2), model has F32 "
                       "[8, 32] (split along dim 1 over tp 2)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("exp_avg of mlp.up.weight has shape [32, 8] (split along dim 0 in 2 blocks over tp 2) in the "
                       "checkpoint, the parameter has [64, 8] (split along dim 0 in 2 blocks over tp 2)"),
              std::string::npos) << msg;
    msg.clear();
    try {
      bmt::load(*wrong.model, dir / "model.safetensors");
    } catch (const bmt::core::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("mlp.up.weight: file has F32 [32, 8], model has F32 [64, 8] (split along dim 0 in 2 blocks over "
                       "tp 2)"),
              std::string::npos) << msg;
  }, tp_init(2));
  bmt::testing::run_ranks(2, [&] {
    resume_and_compare(dir, false);
    load_consolidated(dir);
  }, tp_init(1));
}

// Consolidated round trip at tp 2 from a fresh model: save, overwrite, load back.
TEST(TpCheckpoint, ConsolidatedRoundTripAtTp2) {
  SharedDir dir("tp_consolidated");
  bmt::testing::run_ranks(2, [&] {
    TpTrainer t;
    const bmt::StateDict sd = bmt::state_dict(*t.model);
    for (const char* name : {"m.safetensors", "m.pt"}) {
      bmt::save(*t.model, dir / name);
      perturb(*t.model);
      bmt::load(*t.model, dir / name);
      expect_equal_tensors(bmt::state_dict(*t.model), sd, name);
    }
  }, tp_init(2));
}

// The re-cut against plain slicing: a 3-D logical tensor stored split along each dim over tp 1, 2, 4, rebuilt as
// every piece of every other layout, for whole pieces and sub-ranges.
TEST(TpCheckpoint, RecutMatchesSlicing) {
  const std::vector<int64_t> shape = {4, 8, 12};
  at::Tensor logical = at::arange(4 * 8 * 12, at::kFloat).view(shape);
  std::vector<ck::TpLayout> layouts = {ck::unsplit_layout(shape)};
  for (int d = 0; d < 3; ++d)
    for (int tp : {2, 4}) layouts.push_back(ck::TpLayout{shape, d, tp});
  for (const ck::TpLayout& src : layouts) {
    // The stored entry: stacked pieces.
    std::vector<at::Tensor> pieces;
    if (src.is_split()) {
      for (at::Tensor p : logical.chunk(src.tp_size, src.split_dim)) pieces.push_back(p.contiguous().view({-1}));
    } else {
      pieces.push_back(logical.reshape({-1}));
    }
    int reads = 0;
    ck::PieceReader read = [&](int j, int64_t a, int64_t b) {
      ++reads;
      return pieces.at(static_cast<size_t>(j)).narrow(0, a, b - a).clone();
    };
    for (const ck::TpLayout& dst : layouts) {
      const int n = dst.is_split() ? dst.tp_size : 1;
      for (int r = 0; r < n; ++r) {
        at::Tensor want = (dst.is_split() ? logical.chunk(dst.tp_size, dst.split_dim)[r] : logical).contiguous().view({-1});
        const int64_t pn = dst.piece_numel();
        for (auto [a, b] : std::vector<std::pair<int64_t, int64_t>>{{0, pn}, {5, pn / 2 + 3}, {pn - 7, pn}, {3, 4}}) {
          at::Tensor got = ck::assemble_piece_range(src, dst, r, a, b, at::kFloat, read);
          EXPECT_TRUE(at::equal(got, want.narrow(0, a, b - a)))
              << src.describe() << " -> " << dst.describe() << " piece " << r << " [" << a << ", " << b << ")";
          if (!dst.is_split()) {
            auto span = ck::logical_span(dst, r, a, b);
            EXPECT_LE(span.first, a);
            EXPECT_GE(span.second, b);
          }
        }
      }
    }
    EXPECT_GT(reads, 0);
  }
  // Inconsistent attributes are clear errors.
  EXPECT_THROW(ck::entry_tp_layout("k", {2, 8, 8}, {{"tp_split_dim", "1"}, {"tp_size", "2"}, {"logical_shape", "8,8"}}),
               bmt::core::Error);
  EXPECT_THROW(ck::entry_tp_layout("k", {2, 4}, {{"tp_split_dim", "3"}, {"tp_size", "2"}, {"logical_shape", "8"}}),
               bmt::core::Error);
  EXPECT_EQ(ck::entry_tp_layout("k", {2, 8, 8}, {{"tp_split_dim", "1"}, {"tp_size", "2"}, {"logical_shape", "8,16"}})
                .describe(), "[8, 16] (split along dim 1 over tp 2)");
}
