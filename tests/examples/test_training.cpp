// train_gpt's loop (examples/train/trainer.h) on 2 real ranks over Gloo: the tiny preset on the synthetic task
// learns (train and held-out loss fall); a run interrupted by a checkpoint and resumed continues exactly where
// the uninterrupted run is (same data, same optimizer state); the metrics log has one object per step.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "bmt/runtime/distributed.h"
#include "run_ranks.h"
#include "train/trainer.h"

namespace fs = std::filesystem;

namespace {

examples::TrainArgs quick_args() {
  examples::TrainArgs a;
  a.progress = "off";
  a.samples = 0;
  a.batch = 8;
  a.seq = 40;
  a.eval_batches = 2;
  a.task_rows = 32;
  return a;
}

// The same path on every rank of one run_ranks call, unique per call (run_ranks' own folder, removed on success).
std::string temp_dir(const std::string& name) { return (fs::path(bmt::testing::run_dir()) / name).string(); }

}  // namespace

TEST(Training, TinyPresetLossDecreasesOnTwoRanks) {
  bmt::testing::run_ranks(2, [] {
    examples::TrainArgs a = quick_args();
    a.steps = 120;
    a.eval_every = 60;
    a.samples = 1;
    a.sample_tokens = 5;
    const std::string dir = temp_dir("train");
    a.metrics_path = dir + "_metrics.jsonl";
    examples::TrainResult r = examples::run_training(a);
    EXPECT_EQ(r.end_step, 120);
    EXPECT_LT(r.last_loss, r.first_loss - 0.8) << "train loss " << r.first_loss << " -> " << r.last_loss;
    ASSERT_TRUE(r.first_eval_loss && r.last_eval_loss);
    EXPECT_LT(*r.last_eval_loss, *r.first_eval_loss - 0.8);
    ASSERT_TRUE(r.first_task_acc && r.last_task_acc);  // the synthetic data has a task
    ASSERT_EQ(r.samples.size(), 1u);
    if (bmt::rank() == 0) {
      std::ifstream f(a.metrics_path);
      std::string line;
      int lines = 0, with_eval = 0;
      while (std::getline(f, line)) {
        ++lines;
        EXPECT_NE(line.find("\"step\": "), std::string::npos) << line;
        if (line.find("\"eval_loss\": null") == std::string::npos) ++with_eval;
      }
      EXPECT_EQ(lines, 121);  // step 0 (initial eval) + one per step
      EXPECT_EQ(with_eval, 3);
      fs::remove(a.metrics_path);
    }
  });
}

TEST(Training, ResumeContinuesTheSameRun) {
  bmt::testing::run_ranks(2, [] {
    const std::string root = temp_dir("ckpt");
    examples::TrainArgs a = quick_args();
    a.eval_every = 1000;
    a.steps = 12;
    a.save_dir = root + "/straight";
    const examples::TrainResult straight = examples::run_training(a);

    a.save_dir = root + "/resumed";
    a.stop_at = 8;  // interrupted after step 8 (same 12-step schedule), checkpointed at steps 4 and 8
    a.save_every = 4;
    EXPECT_EQ(examples::run_training(a).end_step, 8);
    EXPECT_TRUE(fs::exists(a.save_dir + "/step_00000004/checkpoint.meta"));  // bmtrain's sharded format
    EXPECT_TRUE(fs::exists(a.save_dir + "/step_00000008/rank-00001.bin"));
    a.stop_at = -1;
    a.resume = true;
    a.save_every = 0;
    const examples::TrainResult resumed = examples::run_training(a);
    EXPECT_EQ(resumed.start_step, 8);
    EXPECT_NEAR(resumed.last_eval_loss.value(), straight.last_eval_loss.value(), 1e-5);

    a.save_dir = root + "/empty";  // --resume without a checkpoint starts from scratch
    a.steps = 1;
    EXPECT_EQ(examples::run_training(a).start_step, 0);
    bmt::synchronize();
    // Not fs::remove_all: libtorch.so exports an incompatible std::filesystem::remove_all that crashes here.
    if (bmt::rank() == 0) {
      EXPECT_EQ(std::system(("rm -rf '" + root + "'").c_str()), 0);
    }
  });
}
