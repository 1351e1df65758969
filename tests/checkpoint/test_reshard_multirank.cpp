// Sharded checkpoints with resharding: save at world size 4 (ZeRO-3, TransformerBlockList) after 3 steps, then
// resume at world sizes 4, 2, 1 and 3 with ZeRO-2/3, with and without the block list. The next 3 losses and the
// final parameters must equal the uninterrupted run's: bit-identical at the same world size and ZeRO level, within
// fp32 tolerance otherwise (only reduction orders differ). Model, Adam moments and fp32 state, LR schedule and
// loss-scaler state all go through the checkpoint: the trainer runs with dynamic loss scaling (initial 1024,
// doubled every 2 good steps), and the resumed scale and good-step count must be the saved ones (losses alone
// cannot show it: power-of-two scales do not change fp32 results).
#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/consolidated.h"
#include "bmt/checkpoint/export.h"
#include "bmt/checkpoint/tensor_file.h"
#include "ckpt_test_util.h"

using namespace ckpt_test;
namespace ck = bmt::checkpoint;

namespace {

constexpr int kBefore = 3, kAfter = 3;

TrainerOptions scaled() {
  TrainerOptions o;
  o.loss_scale = 1024;
  o.loss_scale_steps = 2;
  return o;
}

void resume_and_compare(const SharedDir& dir, int zero, bool list, bool exact) {
  Trainer t(zero, list, {}, scaled());
  // A perturbation that the load must overwrite completely.
  t.step(100);
  // Saved scaler state: {scale, good steps} at the save, then after the kAfter more steps.
  std::vector<double> scaler = read_doubles(dir / "scaler.txt");
  ASSERT_EQ(scaler.size(), 4u);
  ASSERT_NE(t.manager->loss_scale(), scaler[0]) << "the perturbation should leave another scale than the saved one";
  ck::TrainingState st = t.state(0);
  ck::LoadInfo info = ck::load(dir / "ckpt", st);
  EXPECT_EQ(info.step, kBefore);
  EXPECT_EQ(st.step, kBefore);
  EXPECT_EQ(info.saved_world_size, 4);
  EXPECT_EQ(info.user_metadata.at("run"), "reshard");
  EXPECT_EQ(info.rng_restored, bmt::world_size() == 4);
  EXPECT_EQ(t.sched->num_iter(), kBefore);
  EXPECT_TRUE(t.manager->loss_scale_enabled());
  EXPECT_EQ(t.manager->loss_scale(), scaler[0]) << "loss scale not restored";
  EXPECT_EQ(t.manager->steps_since_last_scale(), static_cast<int64_t>(scaler[1])) << "good-step count not restored";
  std::vector<double> ref = read_doubles(dir / "losses.txt");
  ASSERT_EQ(ref.size(), static_cast<size_t>(kAfter));
  for (int s = 0; s < kAfter; ++s) {
    double loss = t.step(kBefore + s);
    if (exact) EXPECT_EQ(loss, ref[s]) << "step " << s << " world " << bmt::world_size();
    else EXPECT_NEAR(loss, ref[s], 2e-5 * std::abs(ref[s])) << "step " << s << " world " << bmt::world_size();
  }
  EXPECT_EQ(t.manager->loss_scale(), scaler[2]) << "the scale evolved differently after the resume";
  EXPECT_EQ(t.manager->steps_since_last_scale(), static_cast<int64_t>(scaler[3]));
  bmt::StateDict sd = bmt::state_dict(*t.model);
  auto final_ref = ck::open_tensor_file(dir / "final.safetensors");
  for (size_t i = 0; i < final_ref->tensors().size(); ++i) {
    const ck::TensorInfo& ti = final_ref->tensors()[i];
    at::Tensor want = at::empty(ti.shape);
    final_ref->read(i, 0, static_cast<int64_t>(want.nbytes()), want.data_ptr());
    ASSERT_TRUE(sd.count(ti.name)) << ti.name;
    if (exact) EXPECT_TRUE(at::equal(sd[ti.name], want)) << ti.name;
    else EXPECT_LT((sd[ti.name] - want).abs().max().item<double>(), 2e-5) << ti.name;
  }
}

}  // namespace

TEST(ShardedCheckpoint, ResumeAtOtherWorldSizesAndZeroLevels) {
  SharedDir dir("reshard");
  bmt::testing::run_ranks(4, [&] {
    Trainer t(3, true, {}, scaled());
    for (int s = 0; s < kBefore; ++s) t.step(s);
    ck::TrainingState st = t.state(kBefore);
    st.user_metadata = {{"run", "reshard"}};
    ck::SaveStats stats = ck::save(dir / "ckpt", st).wait();
    EXPECT_GT(stats.total_nbytes, 0);
    std::vector<double> scaler{t.manager->loss_scale(), static_cast<double>(t.manager->steps_since_last_scale())};
    EXPECT_GT(scaler[0], 1024) << "the scale should have grown before the save";
    std::vector<double> losses;
    for (int s = 0; s < kAfter; ++s) losses.push_back(t.step(kBefore + s));
    scaler.push_back(t.manager->loss_scale());
    scaler.push_back(static_cast<double>(t.manager->steps_since_last_scale()));
    if (bmt::rank() == 0) write_doubles(dir / "losses.txt", losses);
    if (bmt::rank() == 0) write_doubles(dir / "scaler.txt", scaler);
    bmt::save(*t.model, dir / "final.safetensors");
  });
  // Same world size and ZeRO level: bit-identical.
  bmt::testing::run_ranks(4, [&] { resume_and_compare(dir, 3, true, true); });
  // Other world sizes, ZeRO-2 <-> ZeRO-3, plain blocks vs block list.
  bmt::testing::run_ranks(2, [&] { resume_and_compare(dir, 2, false, false); });
  bmt::testing::run_ranks(1, [&] { resume_and_compare(dir, 3, true, false); });
  bmt::testing::run_ranks(3, [&] { resume_and_compare(dir, 2, true, false); });
  bmt::testing::run_ranks(4, [&] { resume_and_compare(dir, 2, false, false); });
}

TEST(ShardedCheckpoint, SaveAtTwoResumeBitIdenticalAndExportMatchesConsolidated) {
  SharedDir dir("same");
  bmt::testing::run_ranks(2, [&] {
    Trainer t(2, true);
    for (int s = 0; s < 2; ++s) t.step(s);
    ck::save(dir / "ckpt", t.state(2)).wait();
    bmt::save(*t.model, dir / "model.safetensors");
    std::vector<double> losses;
    for (int s = 2; s < 4; ++s) losses.push_back(t.step(s));
    if (bmt::rank() == 0) write_doubles(dir / "losses.txt", losses);
  });
  bmt::testing::run_ranks(2, [&] {
    Trainer t(2, true);
    ck::TrainingState st = t.state(0);
    ck::load(dir / "ckpt", st);
    std::vector<double> ref = read_doubles(dir / "losses.txt");
    for (int s = 2; s < 4; ++s) EXPECT_EQ(t.step(s), ref[static_cast<size_t>(s - 2)]) << "step " << s;
  });
  if (bmt::testing::in_rank_process()) return;
  // Offline export (what bmt-ckpt export runs) equals bmt::save's file byte for byte in every tensor.
  for (const char* out : {"export.safetensors", "export.pt"}) {
    ck::ExportStats es = ck::export_consolidated(dir / "ckpt", dir / out, "model/", 256);
    EXPECT_LE(es.peak_buffer_nbytes, 256 + (std::string(out).find(".pt") != std::string::npos ? 16 * 8 * 4 : 0));
    auto a = ck::open_tensor_file(dir / out), b = ck::open_tensor_file(dir / "model.safetensors");
    ASSERT_EQ(a->tensors().size(), b->tensors().size());
    for (size_t i = 0; i < a->tensors().size(); ++i) {
      EXPECT_EQ(a->tensors()[i].name, b->tensors()[i].name);
      const int64_t n = ck::checked_nbytes(a->tensors()[i].dtype, a->tensors()[i].shape, "t");
      std::vector<char> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
      a->read(i, 0, n, x.data());
      b->read(i, 0, n, y.data());
      EXPECT_EQ(x, y) << a->tensors()[i].name;
    }
  }
  std::string info = ck::describe_checkpoint(dir / "ckpt", true);
  EXPECT_NE(info.find("world size      2"), std::string::npos) << info;
  EXPECT_NE(info.find("optim/shard/optimizers.0.embed.weight/exp_avg"), std::string::npos) << info;
  EXPECT_TRUE(ck::CheckpointReader(dir / "ckpt").verify_all().empty());
}

// A resharding load reads only the checksum blocks its new shards need, for the optimizer state as for the model
// (both are read straight into place): saved at world 1 with small checksum blocks, loaded at world 2, each rank
// reads its own elements plus at most the two partial blocks at the ends of each tensor's range. bf16 parameters,
// so the fp32 master copies go the same way; the loaded state equals the checkpoint's elements.
TEST(ShardedCheckpoint, ReshardedLoadReadsOnlyTheBlocksOfItsShards) {
  SharedDir dir("share");
  tiny::Dims dims{64, 64, 256, 2};
  dims.dtype = at::kBFloat16;
  constexpr int64_t kBlock = 256;
  bmt::testing::run_ranks(1, [&] {
    Trainer t(3, true, dims);
    t.step(0);
    ck::SaveOptions o;
    o.checksum_block_nbytes = kBlock;
    ck::save(dir / "ckpt", t.state(1), o).wait();
  });
  bmt::testing::run_ranks(2, [&] {
    Trainer t(3, true, dims);
    ck::TrainingState st = t.state(0);
    const ck::LoadInfo info = ck::load(dir / "ckpt", st);
    int64_t numel = 0, num_params = 0;
    ck::CheckpointReader reader(dir / "ckpt");
    for (const auto& item : t.model->named_parameters(true)) {
      const at::Tensor& p = item.value();
      numel += p.numel();  // the local shard (or the whole replicated tensor)
      ++num_params;
      const bmt::optim::AdamState* s = t.adam->find_state(p);
      ASSERT_NE(s, nullptr) << item.key();
      const ck::ParamRange r = ck::param_range(p, item.key());
      for (auto [name, got] : {std::pair<const char*, at::Tensor>{"exp_avg", s->exp_avg}, {"exp_avg_sq", s->exp_avg_sq},
                               {"master", s->master}}) {
        const ck::EntryMeta* e = reader.find("optim/shard/optimizers.0." + item.key() + "/" + name);
        ASSERT_NE(e, nullptr) << item.key() << " " << name;
        EXPECT_TRUE(at::equal(got.reshape({-1}), reader.read(*e, r.begin, r.end))) << item.key() << " " << name;
      }
    }
    const int64_t model_need = 2 * numel, state_need = 3 * 4 * numel;  // bf16; exp_avg, exp_avg_sq, master fp32
    EXPECT_GE(info.model_bytes_read, model_need);
    EXPECT_LE(info.model_bytes_read, model_need + 2 * kBlock * num_params);
    EXPECT_GE(info.state_bytes_read, state_need);
    EXPECT_LE(info.state_bytes_read, state_need + 2 * kBlock * 3 * num_params);
  });
}
