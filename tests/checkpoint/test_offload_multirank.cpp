// Sharded checkpoints with the offloaded optimizer: AdamOffloadOptimizer with its asynchronous step and dynamic
// loss scaling on, saved while the Blocks' updates are still pending (the optimizer's pool is held closed, so they
// cannot have run before the save: the save must wait for them), then resumed
//   * at the same world size with the same optimizer: bit-identical losses, parameters and loss-scaler state;
//   * with the plain AdamOptimizer (same state dict, same CPU kernel): bit-identical;
//   * at world size 1: within fp32 tolerance (reduction orders differ).
// The uninterrupted asynchronous run itself must equal a synchronous plain-Adam run bit for bit.
#include "bmt/checkpoint/consolidated.h"
#include "bmt/checkpoint/tensor_file.h"
#include "bmt/params/pending_update.h"
#include "ckpt_test_util.h"
#include "gated_pool.h"

using namespace ckpt_test;
namespace ck = bmt::checkpoint;

namespace {

constexpr int kBefore = 3, kAfter = 3;

TrainerOptions offload_async_scaled() {
  TrainerOptions o;
  o.offload = true;
  o.async_step = true;
  o.loss_scale = 1024;
  return o;
}

// Losses of steps kBefore..kBefore+kAfter-1, the final scaler state {scale, good steps} and the final model.
void record_rest(Trainer& t, const SharedDir& dir, const std::string& tag) {
  std::vector<double> losses;
  for (int s = 0; s < kAfter; ++s) losses.push_back(t.step(kBefore + s));
  std::vector<double> scaler{t.manager->loss_scale(), static_cast<double>(t.manager->steps_since_last_scale())};
  if (bmt::rank() == 0) {
    write_doubles(dir / (tag + "_losses.txt"), losses);
    write_doubles(dir / (tag + "_scaler.txt"), scaler);
  }
  bmt::save(*t.model, dir / (tag + "_final.safetensors"));
}

void expect_same_run(const SharedDir& dir, const std::string& a, const std::string& b, bool exact) {
  auto la = read_doubles(dir / (a + "_losses.txt")), lb = read_doubles(dir / (b + "_losses.txt"));
  ASSERT_EQ(la.size(), static_cast<size_t>(kAfter));
  ASSERT_EQ(lb.size(), la.size());
  for (size_t i = 0; i < la.size(); ++i) {
    if (exact) EXPECT_EQ(la[i], lb[i]) << a << " vs " << b << " step " << kBefore + i;
    else EXPECT_NEAR(la[i], lb[i], 2e-5 * std::abs(la[i])) << a << " vs " << b << " step " << kBefore + i;
  }
  EXPECT_EQ(read_doubles(dir / (a + "_scaler.txt")), read_doubles(dir / (b + "_scaler.txt"))) << a << " vs " << b;
  auto fa = ck::open_tensor_file(dir / (a + "_final.safetensors"));
  auto fb = ck::open_tensor_file(dir / (b + "_final.safetensors"));
  ASSERT_EQ(fa->tensors().size(), fb->tensors().size());
  for (size_t i = 0; i < fa->tensors().size(); ++i) {
    at::Tensor x = at::empty(fa->tensors()[i].shape), y = at::empty(fb->tensors()[i].shape);
    fa->read(i, 0, static_cast<int64_t>(x.nbytes()), x.data_ptr());
    fb->read(i, 0, static_cast<int64_t>(y.nbytes()), y.data_ptr());
    if (exact) EXPECT_TRUE(at::equal(x, y)) << a << " vs " << b << ": " << fa->tensors()[i].name;
    else EXPECT_LT((x - y).abs().max().item<double>(), 2e-5) << a << " vs " << b << ": " << fa->tensors()[i].name;
  }
}

void resume(const SharedDir& dir, TrainerOptions o, const std::string& tag) {
  Trainer t(3, true, {}, o);
  t.step(100);  // a perturbation (optimizer state, scaler) the load must overwrite
  ck::TrainingState st = t.state(0);
  ck::LoadInfo info = ck::load(dir / "ckpt", st);
  EXPECT_EQ(info.step, kBefore);
  EXPECT_EQ(t.sched->num_iter(), kBefore);
  auto saved = read_doubles(dir / "saved_scaler.txt");
  ASSERT_EQ(saved.size(), 2u);
  EXPECT_EQ(t.manager->loss_scale(), saved[0]) << tag << ": loss scale not restored";
  EXPECT_EQ(t.manager->steps_since_last_scale(), static_cast<int64_t>(saved[1])) << tag;
  record_rest(t, dir, tag);
}

}  // namespace

TEST(ShardedCheckpointOffload, AsyncPendingUpdatesAndLossScalingRoundTrip) {
  SharedDir dir("offload");
  bmt::testing::run_ranks(2, [&] {
    bmt::testing::GatedPool gated;  // outlives the optimizer
    Trainer t(3, true, {}, offload_async_scaled());
    std::dynamic_pointer_cast<bmt::optim::AdamOffloadOptimizer>(t.adam)->set_thread_pool(gated.pool);
    for (int s = 0; s + 1 < kBefore; ++s) t.step(s);
    gated.close();  // the last step's Block updates cannot run on the pool before the save
    t.step(kBefore - 1, /*zero_grad_after=*/false);
    EXPECT_GT(bmt::num_pending_updates(), 0u) << "the asynchronous step left no Block update pending";
    ck::save(dir / "ckpt", t.state(kBefore)).wait();  // must apply the pending updates before reading shards
    gated.open();
    t.manager->zero_grad();
    std::vector<double> scaler{t.manager->loss_scale(), static_cast<double>(t.manager->steps_since_last_scale())};
    EXPECT_GT(scaler[0], 1024) << "the scale should have grown before the save";
    if (bmt::rank() == 0) write_doubles(dir / "saved_scaler.txt", scaler);
    record_rest(t, dir, "straight");
  });
  // The synchronous plain-Adam run of the same 6 steps.
  bmt::testing::run_ranks(2, [&] {
    TrainerOptions o;
    o.loss_scale = 1024;
    Trainer t(3, true, {}, o);
    for (int s = 0; s < kBefore; ++s) t.step(s);
    record_rest(t, dir, "sync");
  });
  bmt::testing::run_ranks(2, [&] { resume(dir, offload_async_scaled(), "resumed_offload"); });
  bmt::testing::run_ranks(2, [&] {
    TrainerOptions o;
    o.loss_scale = 1024;
    resume(dir, o, "resumed_plain");
  });
  bmt::testing::run_ranks(1, [&] { resume(dir, offload_async_scaled(), "resumed_world1"); });
  if (bmt::testing::in_rank_process()) return;
  expect_same_run(dir, "straight", "sync", true);
  expect_same_run(dir, "straight", "resumed_offload", true);
  expect_same_run(dir, "straight", "resumed_plain", true);
  expect_same_run(dir, "straight", "resumed_world1", false);
}
