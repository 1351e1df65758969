// train_gpt outside the happy path (issue 36), end to end with the real bmtrun and train_gpt on 2 CPU ranks:
//  * a fresh run refuses a save folder holding another run's checkpoints (and --resume one whose `latest` is
//    gone), naming the folder and the ways on; --overwrite-checkpoints deletes them; --keep-last deletes only
//    this run's checkpoints (the run id in each checkpoint's metadata, kept across --resume);
//  * --metrics on a full disk (a file-size limit) is an error naming the file, the log keeps whole lines only;
//  * ranks launched by hand (no launcher): killing rank 0, which hosts the rendezvous store, gives the survivor one
//    line naming rank 0, without torch's backtraces;
//  * a finite divergence (--lr 3: loss in the hundreds) is stopped by the divergence guard without saving, `latest` stays on the last
//    good checkpoint;
//  * smaller messages: a NUL byte in `latest`, --data naming a directory, --save-dir without --save-every (one
//    checkpoint at the end), the held-out loss of a resumed run's summary.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "train_gpt_cli_util.h"

using namespace cli_test;

namespace {

std::string run_id_of(const std::string& ckpt_dir) {
  const bmt::checkpoint::CheckpointReader reader(ckpt_dir);
  auto it = reader.metadata().user_metadata.find("trainer.run_id");
  return it == reader.metadata().user_metadata.end() ? "" : it->second;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST(TrainGptReliability, AFreshRunRefusesAnotherRunsCheckpoints) {
  const std::string root = temp_root("claim");
  Result a = train(2, "--steps 4 --save-every 2 --save-dir " + root);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::string id_a = run_id_of(root + "/step_00000004");
  EXPECT_EQ(id_a.size(), 15u);
  EXPECT_EQ(run_id_of(root + "/step_00000002"), id_a);

  Result b = train(2, "--steps 2 --save-every 2 --save-dir " + root);
  EXPECT_EQ(b.exit_code, 1) << b.output;
  EXPECT_EQ(count(b.output, "train_gpt: error: "), 2) << "every rank stops, one line each\n" << b.output;
  EXPECT_TRUE(contains(b.output, "the save folder " + root + " already holds checkpoints (step_00000002, "
                                 "step_00000004, latest) of another run")) << b.output;
  EXPECT_TRUE(contains(b.output, "--resume") && contains(b.output, "new --save-dir") &&
              contains(b.output, "--overwrite-checkpoints")) << b.output;
  expect_no_backtrace(b.output);
  EXPECT_EQ(step_folders(root), (std::vector<std::string>{"step_00000002", "step_00000004"}));
  EXPECT_EQ(latest_of(root), "step_00000004");
  EXPECT_EQ(run_id_of(root + "/step_00000002"), id_a) << "the other run's checkpoint was overwritten";

  // --resume after `latest` was deleted: refused too, saying how to name the checkpoint to resume from.
  ASSERT_EQ(::unlink((root + "/latest").c_str()), 0);
  Result c = train(2, "--steps 6 --save-every 2 --resume --save-dir " + root);
  EXPECT_EQ(c.exit_code, 1) << c.output;
  EXPECT_TRUE(contains(c.output, "--resume found no " + root + "/latest but " + root + " holds checkpoints"))
      << c.output;
  EXPECT_TRUE(contains(c.output, "echo step_00000004 > " + root + "/latest")) << c.output;
  EXPECT_EQ(step_folders(root).size(), 2u);

  // The explicit way: --overwrite-checkpoints deletes them and starts a new run.
  Result d = train(2, "--steps 2 --save-every 2 --overwrite-checkpoints --save-dir " + root);
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_TRUE(contains(d.output, "--overwrite-checkpoints: deleted step_00000002, step_00000004 from " + root))
      << d.output;
  EXPECT_EQ(step_folders(root), std::vector<std::string>{"step_00000002"});
  EXPECT_NE(run_id_of(root + "/step_00000002"), id_a);
  remove_root(root);
}

TEST(TrainGptReliability, KeepLastDeletesOnlyThisRunsCheckpointsAndAResumeKeepsTheRunId) {
  const std::string root = temp_root("keep_ours"), other = temp_root("keep_other");
  // Another run's checkpoint at a later step, copied into this run's folder.
  ASSERT_EQ(train(2, "--steps 10 --save-every 10 --save-dir " + other).exit_code, 0);
  Result mine = train(2, "--steps 8 --stop-at 4 --save-every 2 --keep-last 1 --save-dir " + root);
  ASSERT_EQ(mine.exit_code, 0) << mine.output;
  const std::string id = run_id_of(root + "/step_00000004");
  ASSERT_EQ(run_shell("cp -a " + quote(other + "/step_00000010") + " " + quote(root)).exit_code, 0);
  Result resumed = train(2, "--steps 8 --save-every 2 --keep-last 1 --resume --save-dir " + root);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(step_folders(root), (std::vector<std::string>{"step_00000008", "step_00000010"})) << resumed.output;
  EXPECT_EQ(run_id_of(root + "/step_00000008"), id) << "a resumed run keeps its run id";
  EXPECT_NE(run_id_of(root + "/step_00000010"), id);
  EXPECT_EQ(run_shell(kCkpt + " verify " + quote(root + "/step_00000010")).exit_code, 0);
  EXPECT_EQ(latest_of(root), "step_00000008");
  remove_root(root);
  remove_root(other);
}

TEST(TrainGptReliability, MetricsOnAFullDiskIsAnErrorAndKeepsWholeLines) {
  const std::string root = temp_root("metrics");
  const std::string metrics = root + "/m.jsonl";
  // ulimit -f counts 1 KiB blocks: writes past 4 KiB fail with EFBIG (train_gpt ignores SIGXFSZ).
  Result r = train(2, "--steps 60 --metrics " + metrics, "ulimit -f 4; ");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "cannot write the metrics file '" + metrics + "'")) << r.output;
  EXPECT_TRUE(contains(r.output, "File too large") && contains(r.output, "ulimit -f")) << r.output;
  expect_no_backtrace(r.output);
  const std::string log = read_all(metrics);
  ASSERT_FALSE(log.empty());
  EXPECT_LE(log.size(), 4096u);
  EXPECT_EQ(log.back(), '\n') << "a cut line was left in the log";
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);)
    EXPECT_TRUE(line.front() == '{' && line.back() == '}') << "not a whole JSON object: " << line;
  remove_root(root);
}

// Two ranks started by hand with torchrun's variables, as a user without a launcher does; rank 0 (the store's
// host) is killed with SIGKILL once training runs.
TEST(TrainGptReliability, KillingTheStoreHostGivesTheSurvivorOneLineNamingIt) {
  const std::string root = temp_root("storehost");
  const std::string env = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                          std::to_string(21000 + (::getpid() * 7) % 20000) + " BMT_TIMEOUT_S=60 ";
  const std::string args = " --batch 8 --seq 40 --eval-batches 1 --task-rows 16 --eval-every 1000 --samples 0 "
                           "--progress lines --log-every 1 --steps 100000";
  const std::string r0 = root + "/r0.log", r1 = root + "/r1.log";
  Result r = run_shell("RANK=0 LOCAL_RANK=0 " + env + kTrain + args + " > " + r0 + " 2>&1 & p0=$!; "
                       "RANK=1 LOCAL_RANK=1 " + env + kTrain + args + " > " + r1 + " 2>&1 & p1=$!; "
                       "n=0; until grep -q 'step 3/' " + r0 + " || [ $n -ge 600 ]; do sleep 0.1; n=$((n+1)); done; "
                       "kill -9 $p0; t0=$(date +%s.%N); wait $p1; rc=$?; "
                       "echo \"rank 1 exit $rc after $(echo \"$(date +%s.%N) - $t0\" | bc) s\"", 120);
  const std::string out1 = read_all(r1);
  EXPECT_TRUE(contains(read_all(r0), "step 3/")) << read_all(r0);
  EXPECT_TRUE(contains(r.output, "rank 1 exit 1 ")) << r.output << "\nrank 1:\n" << out1;
  EXPECT_EQ(count(out1, "train_gpt: error: "), 1) << out1;
  EXPECT_TRUE(contains(out1, "rank 0 is dead")) << out1;
  expect_no_backtrace(out1);
  EXPECT_LE(count(out1, "\n"), 3) << "the survivor prints more than its error line\n" << out1;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(after ([0-9.]+) s)"))) << r.output;
  EXPECT_LT(std::stod(m[1]), 15.0) << r.output;
  remove_root(root);
}

TEST(TrainGptReliability, FiniteDivergenceStopsWithoutSavingAndLatestStaysGood) {
  const std::string root = temp_root("diverge");
  // --lr 3 without warm-up blows the loss up to hundreds while it stays finite (--lr 1e6 here goes to NaN, which
  // the skip counter handles): only the divergence guard sees it.
  Result r = train(2, "--steps 40 --lr 3 --warmup 0 --save-every 1 --save-dir " + root);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: "), 2) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(stayed above 3x its lowest value in this run .* for 10 )"
                                                        R"(steps in a row: the run diverged and was stopped without )"
                                                        R"(saving. The last good step was (\d+))")))
      << r.output;
  const int last_good = std::stoi(m[1]);
  EXPECT_GE(last_good, 1);
  for (const std::string& f : step_folders(root))
    EXPECT_LE(std::stoi(f.substr(5)), last_good) << "a checkpoint saved after the run went bad: " << f;
  char name[32];
  std::snprintf(name, sizeof name, "step_%08d", last_good);
  EXPECT_EQ(latest_of(root), name);
  EXPECT_TRUE(contains(r.output, "--divergence-factor")) << r.output;
  expect_no_backtrace(r.output);
  remove_root(root);
}

TEST(TrainGptReliability, SmallerMessages) {
  const std::string root = temp_root("small");
  // --save-dir without --save-every: one checkpoint at the end.
  Result end = train(2, "--steps 4 --stop-at 3 --save-dir " + root);
  ASSERT_EQ(end.exit_code, 0) << end.output;
  EXPECT_EQ(step_folders(root), std::vector<std::string>{"step_00000003"});
  EXPECT_EQ(latest_of(root), "step_00000003");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(end.output, m, std::regex(R"(eval @ step 3: held-out loss ([0-9.]+))"))) << end.output;
  const std::string loss_at_3 = m[1];

  // A resumed run's summary: held-out loss from where it started (the first run's last value) to its end.
  Result resumed = train(2, "--steps 4 --resume --save-dir " + root);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  ASSERT_TRUE(std::regex_search(resumed.output, m, std::regex(R"(held-out loss ([0-9.]+) -> ([0-9.]+))")))
      << resumed.output;
  EXPECT_EQ(m[1].str(), loss_at_3) << resumed.output;
  EXPECT_NE(m[2].str(), loss_at_3) << resumed.output;

  // A NUL byte in `latest`: the message shows it escaped, not cut at the path.
  std::ofstream(root + "/latest", std::ios::binary) << std::string("step_00000003\0junk", 18);
  Result nul = train(2, "--steps 6 --resume --save-dir " + root);
  EXPECT_EQ(nul.exit_code, 1) << nul.output;
  EXPECT_TRUE(contains(nul.output, "holds \"step_00000003\\x00junk\", not a checkpoint folder name")) << nul.output;
  EXPECT_TRUE(contains(nul.output, "delete " + root + "/latest to start over")) << nul.output;

  // --seq below what the held-out task's rows need: the model's own error came without a hint.
  Result seq = train(1, "--steps 1 --seq 4");
  EXPECT_EQ(seq.exit_code, 1) << seq.output;
  EXPECT_TRUE(std::regex_search(seq.output, std::regex(R"(--seq 4 is shorter than the \d+ tokens one row of the )"
                                                       R"(held-out task needs .*; use --seq \d+ or more)")))
      << seq.output;

  // --data naming a directory.
  Result dir = train(1, "--steps 1 --data " + root);
  EXPECT_EQ(dir.exit_code, 1) << dir.output;
  EXPECT_TRUE(contains(dir.output, "--data '" + root + "' is a directory")) << dir.output;
  EXPECT_FALSE(contains(dir.output, "No such device")) << dir.output;
  remove_root(root);
}
