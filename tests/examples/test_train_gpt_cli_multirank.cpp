// train_gpt end to end: the real bmtrun and train_gpt binaries on CPU ranks (Gloo), checked from the outside as
// a user sees them: exit status, messages, the checkpoint folders.
//  * checkpoints are integrity-checked: 64 flipped bytes inside a model tensor or an optimizer tensor of a shard
//    file make --resume fail on every rank, naming the file, before any step runs;
//  * resuming at another world size keeps the optimizer state (Adam's step count and second moments continue);
//  * --keep-last, the divergence stop (--max-skipped-steps), a full disk (small tmpfs, or `ulimit -f` where
//    mounting is not allowed), and the messages for bad options, a missing or truncated shard file, an absurd
//    --seq and a lone rank whose rank 0 never starts.
// Every command runs under coreutils `timeout`, so a hang fails a test instead of blocking the suite.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "train_gpt_cli_util.h"

namespace {

using namespace cli_test;

int64_t dtype_nbytes(const std::string& dtype) {
  if (dtype == "F32" || dtype == "float32") return 4;
  if (dtype == "F64" || dtype == "float64" || dtype == "I64" || dtype == "int64") return 8;
  if (dtype == "BF16" || dtype == "bfloat16" || dtype == "F16" || dtype == "float16") return 2;
  ADD_FAILURE() << "unknown dtype " << dtype;
  return 1;
}

// Flips 64 bytes in the middle of the largest tensor whose key starts with `prefix` stored in rank-00000.bin
// (a sharded checkpoint keeps model and optimizer tensors in the same per-rank file).
void flip_bytes_in(const std::string& ckpt_dir, const std::string& prefix) {
  bmt::checkpoint::CheckpointReader reader(ckpt_dir);
  int64_t best_offset = -1, best_nbytes = 0;
  std::string best_key;
  for (const auto& e : reader.metadata().entries) {
    if (e.key.rfind(prefix, 0) != 0) continue;
    for (const auto& p : e.pieces) {
      const int64_t nbytes = (p.elem_end - p.elem_begin) * dtype_nbytes(e.dtype);
      if (p.file == 0 && nbytes > best_nbytes) best_offset = p.byte_offset, best_nbytes = nbytes, best_key = e.key;
    }
  }
  EXPECT_GE(best_nbytes, 256) << "no tensor under " << prefix << " in " << ckpt_dir;
  const std::string path = ckpt_dir + "/rank-00000.bin";
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  const int64_t at = best_offset + best_nbytes / 2 - 32;
  char buf[64];
  f.seekg(at);
  f.read(buf, 64);
  for (char& c : buf) c = static_cast<char>(~c);
  f.seekp(at);
  f.write(buf, 64);
  EXPECT_TRUE(f.good()) << path;
}

// The resume after damage must fail on every rank (one line each), name the file, run no step.
void expect_resume_refused(const std::string& root, const std::string& why, const std::string& file) {
  Result r = train(2, "--steps 6 --save-every 2 --resume --save-dir " + root);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: "), 2) << "one line per rank\n" << r.output;
  EXPECT_EQ(count(r.output, "cannot resume from " + root + "/step_00000004"), 2) << r.output;
  EXPECT_TRUE(contains(r.output, file)) << r.output;
  EXPECT_TRUE(contains(r.output, why)) << r.output;
  EXPECT_TRUE(contains(r.output, root + "/latest")) << "the way out (an earlier step) is named\n" << r.output;
  EXPECT_FALSE(contains(r.output, "step 5/")) << "no step may run after a failed resume\n" << r.output;
  expect_no_backtrace(r.output);
  EXPECT_EQ(latest_of(root), "step_00000004");
}

}  // namespace

TEST(TrainGptCli, DamagedCheckpointIsRefusedNamingTheFile) {
  const std::string root = temp_root("damaged");
  Result first = train(2, "--steps 4 --save-every 2 --save-dir " + root);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(latest_of(root), "step_00000004");
  const std::string step4 = root + "/step_00000004";
  ASSERT_EQ(run_shell("cp -a " + quote(step4) + " " + quote(root + "/pristine")).exit_code, 0);
  ASSERT_EQ(run_shell(kCkpt + " verify " + quote(step4)).exit_code, 0);

  flip_bytes_in(step4, "model/");
  expect_resume_refused(root, "the checkpoint is damaged", "checksum mismatch in rank-00000.bin");
  Result verify = run_shell(kCkpt + " verify " + quote(step4));
  EXPECT_NE(verify.exit_code, 0) << "bmt-ckpt must see the damage too\n" << verify.output;

  ASSERT_EQ(run_shell("rm -rf " + quote(step4) + " && cp -a " + quote(root + "/pristine") + " " + quote(step4)).exit_code, 0);
  flip_bytes_in(step4, "optim/");
  expect_resume_refused(root, "the checkpoint is damaged", "checksum mismatch in rank-00000.bin");

  // A missing and a truncated shard file: named, with the fix; still no step runs.
  ASSERT_EQ(run_shell("rm -rf " + quote(step4) + " && cp -a " + quote(root + "/pristine") + " " + quote(step4) +
                      " && rm " + quote(step4 + "/rank-00001.bin")).exit_code, 0);
  expect_resume_refused(root, "missing shard file", step4 + "/rank-00001.bin");
  ASSERT_EQ(run_shell("rm -rf " + quote(step4) + " && cp -a " + quote(root + "/pristine") + " " + quote(step4) +
                      " && truncate -s 1000 " + quote(step4 + "/rank-00001.bin")).exit_code, 0);
  expect_resume_refused(root, "truncated", step4 + "/rank-00001.bin");

  // The pristine copy resumes and continues.
  ASSERT_EQ(run_shell("rm -rf " + quote(step4) + " && cp -a " + quote(root + "/pristine") + " " + quote(step4)).exit_code, 0);
  Result ok = train(2, "--steps 6 --resume --save-dir " + root);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(contains(ok.output, "resumed from " + step4 + " at step 4")) << ok.output;
  remove_root(root);
}

// Adam's per-parameter step count and second moments, read from a checkpoint.
struct AdamState {
  double step = -1;
  at::Tensor exp_avg_sq;  // every exp_avg_sq entry, flattened and concatenated (checkpoint entry order)
};
AdamState adam_state(const std::string& dir) {
  bmt::checkpoint::CheckpointReader reader(dir);
  AdamState s;
  std::vector<at::Tensor> parts;
  for (const auto& e : reader.metadata().entries) {
    if (e.key.rfind("optim/", 0) != 0) continue;
    const std::string tail = e.key.substr(e.key.rfind('/') + 1);
    if (tail == "exp_avg_sq") parts.push_back(reader.read_full(e).to(at::kDouble).reshape({-1}));
    if (tail == "step" && s.step < 0) s.step = reader.read_full(e).to(at::kDouble).item<double>();
  }
  if (!parts.empty()) s.exp_avg_sq = at::cat(parts);
  return s;
}

TEST(TrainGptCli, ResumeAtAnotherWorldSizeKeepsOptimizerState) {
  const std::string root = temp_root("reshard");
  // The uninterrupted reference at world 2 (steps 1..12), and a run stopped at step 8 with a checkpoint there.
  Result ref = train(2, "--steps 12 --metrics " + root + "/ref.jsonl");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::vector<StepMetrics> reference = read_step_metrics(root + "/ref.jsonl");
  ASSERT_EQ(reference.size(), 12u) << ref.output;
  Result two = train(2, "--steps 12 --stop-at 8 --save-every 8 --save-dir " + root + "/ckpt --metrics " + root +
                            "/two.jsonl");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const AdamState at8 = adam_state(root + "/ckpt/step_00000008");
  ASSERT_EQ(at8.step, 8) << "Adam's step count (keys: optim/.../step)";
  ASSERT_TRUE(at8.exp_avg_sq.defined());
  expect_same_steps(reference, read_step_metrics(root + "/two.jsonl"), "steps 1..8 of the stopped run", 1, 8);
  ASSERT_EQ(run_shell("cp -a " + quote(root + "/ckpt") + " " + quote(root + "/same")).exit_code, 0);

  Result one = train(1, "--steps 12 --stop-at 9 --save-every 1 --resume --save-dir " + root + "/ckpt --metrics " +
                            root + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_TRUE(contains(one.output, "resumed from " + root + "/ckpt/step_00000008 at step 8 (saved at world 2"))
      << one.output;
  const AdamState at9 = adam_state(root + "/ckpt/step_00000009");
  EXPECT_EQ(at9.step, 9) << "a restarted optimizer would be at step 1";
  // v9 = 0.95 v8 + 0.05 g^2 >= 0.95 v8 everywhere; a restarted v (0.05 g^2) is far below it almost everywhere.
  ASSERT_EQ(at9.exp_avg_sq.numel(), at8.exp_avg_sq.numel());
  EXPECT_TRUE((at9.exp_avg_sq >= at8.exp_avg_sq * 0.95 * (1 - 1e-5)).all().item<bool>());
  // The schedule continues exactly: step 9's learning rate is the uninterrupted run's (a reset schedule would be
  // at its warm-up start). The loss differs by design (world 1 trains on one rank's batch).
  const std::vector<StepMetrics> at_one = read_step_metrics(root + "/one.jsonl");
  ASSERT_EQ(at_one.size(), 1u) << one.output;
  EXPECT_EQ(at_one[0].step, 9);
  EXPECT_EQ(at_one[0].lr, reference[8].lr);
  // At the saving world size the continuation is the uninterrupted run, bit for bit.
  Result same = train(2, "--steps 12 --resume --save-dir " + root + "/same --metrics " + root + "/same.jsonl");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  const std::vector<StepMetrics> cont = read_step_metrics(root + "/same.jsonl");
  ASSERT_EQ(cont.size(), 4u) << same.output;
  EXPECT_EQ(cont.front().step, 9);
  expect_same_steps(reference, cont, "steps 9..12 resumed at world 2", 9, 12);

  // And back: world 1 -> 2.
  Result back = train(2, "--steps 12 --save-every 12 --resume --save-dir " + root + "/ckpt");
  ASSERT_EQ(back.exit_code, 0) << back.output;
  EXPECT_EQ(adam_state(root + "/ckpt/step_00000012").step, 12);
  remove_root(root);
}

TEST(TrainGptCli, KeepLastDeletesOlderCheckpointsOnlyAfterTheNewOne) {
  const std::string root = temp_root("keep");
  Result r = train(2, "--steps 8 --save-every 2 --keep-last 2 --save-dir " + root);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(step_folders(root), (std::vector<std::string>{"step_00000006", "step_00000008"})) << r.output;
  EXPECT_EQ(latest_of(root), "step_00000008");
  EXPECT_EQ(run_shell(kCkpt + " verify " + quote(root + "/step_00000006")).exit_code, 0);
  EXPECT_TRUE(contains(r.output, "(removed 1 older)")) << r.output;
  // Without --keep-last every checkpoint stays.
  Result all = train(2, "--steps 12 --save-every 2 --resume --save-dir " + root);
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_EQ(step_folders(root).size(), 4u);
  remove_root(root);
}

TEST(TrainGptCli, DivergedRunStopsWithoutSavingBadState) {
  const std::string root = temp_root("nan");
  // A learning rate this large overflows the parameters to inf after the first updates: every later step is
  // inf/NaN and skipped.
  Result r = train(2, "--steps 40 --lr 1e30 --warmup 0 --save-every 1 --max-skipped-steps 3 --save-dir " + root);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: "), 2) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(3 steps in a row were skipped .* The last good step was (\d+))")))
      << r.output;
  const int last_good = std::stoi(m[1]);
  EXPECT_LT(last_good, 40);
  for (const std::string& f : step_folders(root))
    EXPECT_LE(std::stoi(f.substr(5)), last_good) << "a checkpoint saved after the run went bad: " << f;
  if (last_good > 0) {
    char name[32];
    std::snprintf(name, sizeof name, "step_%08d", last_good);
    EXPECT_EQ(latest_of(root), name);
  }
  expect_no_backtrace(r.output);
  remove_root(root);
}

// A full disk during a save: a small tmpfs (root may mount one), else a file-size limit (EFBIG), which the
// environment variable BMT_TEST_DISK_FULL=ulimit selects explicitly.
TEST(TrainGptCli, FullDiskIsAClearErrorAndKeepsThePreviousCheckpoint) {
  const std::string root = temp_root("disk");
  const std::string plain = root + "/plain", small = root + "/small";
  Result first = train(2, "--steps 4 --stop-at 2 --save-every 2 --save-dir " + plain);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const int64_t ckpt_kib = std::stoll(run_shell("du -sk " + quote(plain + "/step_00000002") + " | cut -f1").output);
  ASSERT_GT(ckpt_kib, 0);
  ::mkdir(small.c_str(), 0755);
  const char* mode_env = std::getenv("BMT_TEST_DISK_FULL");
  bool tmpfs = !(mode_env && std::string(mode_env) == "ulimit");
  if (tmpfs) {
    // Room for the first checkpoint and half of the second.
    const std::string opts = "size=" + std::to_string(ckpt_kib * 3 / 2 + 64) + "k";
    tmpfs = ::mount("tmpfs", small.c_str(), "tmpfs", 0, opts.c_str()) == 0;
  }
  std::cout << "[ disk full simulated with " << (tmpfs ? "a small tmpfs" : "ulimit -f (EFBIG)") << " ]\n";
  RecordProperty("disk_full_mode", tmpfs ? "tmpfs" : "ulimit");
  ASSERT_EQ(run_shell("cp -a " + quote(plain) + "/. " + quote(small)).exit_code, 0);
  const std::string prefix = tmpfs ? "" : "ulimit -f " + std::to_string(std::max<int64_t>(1, ckpt_kib / 4)) + "; ";
  Result r = train(2, "--steps 4 --save-every 2 --resume --save-dir " + small, prefix);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: "), 2) << "every rank stops, one line each\n" << r.output;
  EXPECT_EQ(count(r.output, "checkpoint of step 4 failed"), 2) << r.output;
  EXPECT_TRUE(contains(r.output, small + "/step_00000004.tmp-")) << "names the path\n" << r.output;
  if (tmpfs) {
    EXPECT_TRUE(contains(r.output, "No space left on device")) << r.output;
    EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(has [0-9.]+ MiB free of [0-9.]+ MiB)"))) << r.output;
  } else {
    EXPECT_TRUE(contains(r.output, "ulimit -f")) << r.output;
  }
  EXPECT_TRUE(contains(r.output, small + "/step_00000002 is intact")) << r.output;
  expect_no_backtrace(r.output);
  EXPECT_EQ(step_folders(small), std::vector<std::string>{"step_00000002"}) << "the partial folder is removed";
  EXPECT_EQ(latest_of(small), "step_00000002");
  EXPECT_EQ(run_shell(kCkpt + " verify " + quote(small + "/step_00000002")).exit_code, 0);
  if (tmpfs) {
    EXPECT_EQ(::umount(small.c_str()), 0);
  }
  remove_root(root);
}

TEST(TrainGptCli, BadOptionsAreRejected) {
  for (const std::string bad : {"--steps -5", "--steps 0", "--batch 0", "--batch -2", "--lr -1", "--lr 0",
                                "--seq 0", "--seq -64", "--keep-last -1", "--max-skipped-steps 0"}) {
    Result r = run_shell(kTrain + " " + bad, 30);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
    const std::string opt = bad.substr(0, bad.find(' '));
    EXPECT_TRUE(contains(r.output, "option " + opt + " must be")) << bad << "\n" << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1) << "one line\n" << r.output;
  }
}

TEST(TrainGptCli, AbsurdSeqIsRefusedBeforeAllocating) {
  Result r = train(1, "--seq 100000000 --steps 2", "");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "--seq 100000000 with --batch 8 needs at least")) << r.output;
  EXPECT_TRUE(contains(r.output, "lower --seq or --batch")) << r.output;
  EXPECT_LT(r.seconds, 60);
  expect_no_backtrace(r.output);
}

TEST(TrainGptCli, LoneRankWithoutRankZeroGivesOneMessage) {
  // Rank 1 of 2 started by hand (as under Slurm); rank 0 never comes. The time includes train_gpt's start-up
  // (loading libtorch: seconds on a loaded machine), so the timeout is long enough for "one, not two" to hold a
  // start-up's worth of slack.
  constexpr int kTimeoutS = 8;
  const std::string env = "RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "
                          "MASTER_PORT=" + std::to_string(20000 + ::getpid() % 20000) + " BMT_TIMEOUT_S=" +
                          std::to_string(kTimeoutS) + " ";
  Result r = run_shell(env + kTrain + " --steps 2", 60);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: "), 1) << r.output;
  EXPECT_EQ(count(r.output, "\n"), 1) << "one line\n" << r.output;
  EXPECT_TRUE(contains(r.output, "rank 0")) << r.output;
  EXPECT_LT(r.seconds, 2 * kTimeoutS) << "waits one timeout, not two\n" << r.output;
  expect_no_backtrace(r.output);
}

// --inspect-every N: every N-th step's metrics line carries inspect_model's statistics of every parameter (gathered
// over the two ranks' shards), the other lines none; a gradient exists after the backward.
TEST(TrainGptCli, InspectEveryWritesParameterStatisticsToTheMetrics) {
  const std::string root = temp_root("inspect");
  const std::string metrics = root + "/m.jsonl";
  Result r = train(2, "--steps 4 --inspect-every 2 --metrics " + metrics);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(metrics);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (contains(line, "\"step\": ") && !contains(line, "\"step\": 0,")) lines.push_back(line);  // not the step-0 eval
  ASSERT_EQ(lines.size(), 4u) << r.output;
  for (size_t i = 0; i < lines.size(); ++i) {
    const bool due = (i + 1) % 2 == 0;
    EXPECT_EQ(contains(lines[i], "\"inspect.wte.weight.std\": "), due) << "step " << i + 1 << ": " << lines[i];
    if (!due) continue;
    EXPECT_TRUE(contains(lines[i], "\"inspect.layers.0.")) << lines[i];
    EXPECT_FALSE(contains(lines[i], "\"inspect.wte.weight.grad_std\": null")) << lines[i];
  }
  remove_root(root);
}

// Pipeline parallelism: --pp 2 (two stages of one rank, 1F1B over 4 micro-batches) trains, evaluates through the
// pipeline and saves; the checkpoint resumes at pp 1 on one rank (parameter names do not depend on the stage).
TEST(TrainGptCli, PipelineTrainsAndItsCheckpointResumesWithoutPipeline) {
  const std::string root = temp_root("pp");
  Result pp = train(2, "--pp 2 --micro-batches 4 --steps 40 --warmup 5 --lr 3e-3 --save-every 40 --save-dir " + root);
  ASSERT_EQ(pp.exit_code, 0) << pp.output;
  EXPECT_TRUE(contains(pp.output, "pp 2 stages x 4 1f1b micro-batches")) << pp.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(pp.output, m, std::regex(R"(train loss ([0-9.]+) -> ([0-9.]+))"))) << pp.output;
  EXPECT_LT(std::stod(m[2]), std::stod(m[1]) - 0.2) << pp.output;
  ASSERT_TRUE(std::regex_search(pp.output, m, std::regex(R"(held-out loss ([0-9.]+) -> ([0-9.]+))"))) << pp.output;
  EXPECT_LT(std::stod(m[2]), std::stod(m[1])) << pp.output;
  Result one = train(1, "--steps 42 --warmup 5 --lr 3e-3 --resume --save-dir " + root);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_TRUE(contains(one.output, "resumed from " + root + "/step_00000040 at step 40")) << one.output;
  Result bad = train(2, "--pp 3 --steps 1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(contains(bad.output, "pipe_size (3)")) << bad.output;
  remove_root(root);
}
