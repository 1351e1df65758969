// Crash and resume of the main job as a user meets it: the real bmtrun and train_gpt (2 CPU ranks over Gloo), one
// rank SIGKILLed, then `--resume`. The resumed run must be the uninterrupted run, bit for bit: every step's loss,
// gradient norm and learning rate (the --metrics file prints doubles exactly) and every tensor of the final
// checkpoint (parameters, Adam moments, LR schedule, RNG states). After every kill `latest` must name a complete
// checkpoint whose every byte verifies.
//  * kills at named points, chosen by a seeded generator (BMT_TEST_SEED overrides the seed; it is printed):
//    mid-step, during a sharded save's shard write, during an --async-save write (on the background writer thread,
//    training going on), and between a checkpoint's commit and the move of `latest`. train_gpt's test hook
//    BMT_TRAIN_TEST_KILL (examples/train/test_kill.h) makes the chosen rank SIGKILL itself there, so "during a save"
//    is hit every time instead of by a lucky timer;
//  * the soak (issue 36): 20 cycles of a run killed from the outside (kill -9 of a random rank after a random
//    delay, sync or async saves every 2 steps), each followed by --resume; then the run is finished and compared.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <random>
#include <thread>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "train_gpt_cli_util.h"

using namespace cli_test;

namespace {

using Clock = std::chrono::steady_clock;

uint32_t test_seed() {
  const char* env = std::getenv("BMT_TEST_SEED");
  const uint32_t seed = env ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : 20261204u;
  std::cout << "[ seed " << seed << " (BMT_TEST_SEED) ]\n";
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

// A run's save folder and metrics file (the metrics file outside the save folder: a save folder holds only
// checkpoints).
struct RunPaths {
  std::string ckpt, metrics;
};

std::string run_options(const RunPaths& p, int64_t steps, int64_t save_every, bool async, int64_t keep_last = 0) {
  return "--keep-last " + std::to_string(keep_last) + " --steps " + std::to_string(steps) + " --save-every " + std::to_string(save_every) + " --save-dir " +
         quote(p.ckpt) + " --metrics " + quote(p.metrics) + (async ? " --async-save" : "");
}

// Both checkpoints hold the same entries with the same bytes.
void expect_same_checkpoint(const std::string& expected_dir, const std::string& dir) {
  bmt::checkpoint::CheckpointReader a(expected_dir), b(dir);
  EXPECT_EQ(a.metadata().step, b.metadata().step);
  ASSERT_EQ(a.metadata().entries.size(), b.metadata().entries.size()) << dir;
  for (size_t i = 0; i < a.metadata().entries.size(); ++i) {
    const auto& ea = a.metadata().entries[i];
    const auto& eb = b.metadata().entries[i];
    ASSERT_EQ(ea.key, eb.key) << dir;
    at::Tensor ta = a.read_full(ea), tb = b.read_full(eb);
    EXPECT_TRUE(ta.sizes() == tb.sizes() && ta.dtype() == tb.dtype() && at::equal(ta, tb))
        << ea.key << " differs between " << expected_dir << " and " << dir;
  }
}

// The step `latest` names (0 without one), after checking that it names a complete checkpoint of that step whose
// every byte verifies.
int64_t sound_latest(const std::string& ckpt_root) {
  const std::string name = latest_of(ckpt_root);
  if (name.empty()) return 0;
  EXPECT_EQ(name.rfind("step_", 0), 0u) << name;
  const int64_t step = std::stoll(name.substr(5));
  try {
    bmt::checkpoint::CheckpointReader r(ckpt_root + "/" + name);
    EXPECT_EQ(r.metadata().step, step) << ckpt_root << "/latest names " << name;
    const std::vector<std::string> bad = r.verify_all();
    EXPECT_TRUE(bad.empty()) << ckpt_root << "/latest names a damaged checkpoint: " << (bad.empty() ? "" : bad[0]);
  } catch (const std::exception& e) {
    ADD_FAILURE() << ckpt_root << "/latest names an unreadable checkpoint: " << e.what();
  }
  return step;
}

void expect_no_leftovers(const std::string& ckpt_root) {
  for (const std::string& n : step_folders(ckpt_root)) {
    EXPECT_FALSE(contains(n, ".tmp-")) << "a killed save's temporary folder outlived the next save: " << n;
    EXPECT_FALSE(contains(n, ".old-")) << n;
  }
}

// One test: the uninterrupted reference, a run whose `rank` kills itself at `point` of `step`, the resume.
void kill_then_resume(const std::string& point, int64_t step, int rank, bool async, int64_t expected_latest) {
  constexpr int64_t kSteps = 12, kSaveEvery = 3;
  const std::string root = temp_root("kill");
  const RunPaths ref{root + "/ref", root + "/ref.jsonl"}, run{root + "/run", root + "/run.jsonl"};
  Result r = train(2, run_options(ref, kSteps, kSaveEvery, /*async=*/false));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<StepMetrics> reference = read_step_metrics(ref.metrics);
  ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps)) << r.output;

  const std::string what = point + " of step " + std::to_string(step) + " on rank " + std::to_string(rank) +
                           (async ? " (--async-save)" : "");
  std::cout << "[ kill at " << what << " ]\n";
  const std::string hook = "BMT_TRAIN_TEST_KILL=" + point + ":" + std::to_string(step) + ":" + std::to_string(rank);
  Result killed = train(2, run_options(run, kSteps, kSaveEvery, async), hook + " ");
  EXPECT_NE(killed.exit_code, 0) << killed.output;
  ASSERT_TRUE(contains(killed.output, "rank " + std::to_string(rank) + " kills itself at " + point + " of step " +
                                          std::to_string(step)))
      << "the kill point was never reached\n" << killed.output;
  EXPECT_FALSE(contains(killed.output, "done: steps")) << "the killed run must not finish\n" << killed.output;
  const int64_t latest = sound_latest(run.ckpt);
  EXPECT_EQ(latest, expected_latest) << killed.output;

  Result resumed = train(2, run_options(run, kSteps, kSaveEvery, async) + " --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  if (latest > 0) {
    EXPECT_TRUE(contains(resumed.output, "resumed from " + run.ckpt + "/" + step_name(latest) + " at step " +
                                             std::to_string(latest)))
        << resumed.output;
  }
  // Every step line of both runs (the killed run's and the resumed run's) is the reference's.
  expect_same_steps(reference, read_step_metrics(run.metrics), "killed at " + what + ", then resumed");
  EXPECT_EQ(sound_latest(run.ckpt), kSteps);
  expect_same_checkpoint(ref.ckpt + "/" + step_name(kSteps), run.ckpt + "/" + step_name(kSteps));
  expect_no_leftovers(run.ckpt);
  if (!::testing::Test::HasFailure()) remove_root(root);
}

}  // namespace

TEST(TrainGptKillResume, KillAtARandomStepThenResumeIsBitIdentical) {
  std::mt19937 rng(test_seed());
  const int64_t step = 2 + static_cast<int64_t>(rng() % 10);  // 2..11
  const int rank = static_cast<int>(rng() % 2);
  kill_then_resume("step", step, rank, /*async=*/false, (step - 1) / 3 * 3);
}

TEST(TrainGptKillResume, KillDuringAShardedSaveThenResumeIsBitIdentical) {
  std::mt19937 rng(test_seed() + 1);
  const int64_t step = 3 * (1 + static_cast<int64_t>(rng() % 3));  // 3, 6 or 9
  const int rank = static_cast<int>(rng() % 2);
  kill_then_resume("save", step, rank, /*async=*/false, step - 3);
}

// The write of an async save runs on a background thread while training goes on; `latest` moves onto a checkpoint
// only when it is committed (at the next save), so the kill leaves it on the save before.
TEST(TrainGptKillResume, KillDuringAnAsyncSaveThenResumeIsBitIdentical) {
  std::mt19937 rng(test_seed() + 2);
  const int64_t step = 3 * (2 + static_cast<int64_t>(rng() % 2));  // 6 or 9: an earlier async save was committed
  const int rank = static_cast<int>(rng() % 2);
  kill_then_resume("save", step, rank, /*async=*/true, step - 3);
}

// Rank 0 dies after the folder of step S is committed and before `latest` moves: the resume starts from S - 3 and
// saves S again over the complete folder.
// The first checkpoint committed, `latest` not yet written: --resume finds the folder's own run (root/run_id) and
// starts it over from step 0 instead of refusing the folder as another run's (the soak met this under load).
TEST(TrainGptKillResume, KillBetweenTheFirstCommitAndLatestThenResumeStartsTheRunOver) {
  kill_then_resume("commit", 3, /*rank=*/0, /*async=*/false, 0);
}

TEST(TrainGptKillResume, KillBetweenCommitAndLatestThenResumeIsBitIdentical) {
  std::mt19937 rng(test_seed() + 3);
  const int64_t step = 3 * (2 + static_cast<int64_t>(rng() % 2));  // 6 or 9
  kill_then_resume("commit", step, /*rank=*/0, /*async=*/false, step - 3);
}

namespace {

// bmtrun + train_gpt (through `sh -c exec`, so the pid is bmtrun's), output to `log`. Everything the child needs
// is prepared before fork(): this process has threads (checksum workers), so the child calls only async-signal-
// safe functions before exec.
pid_t spawn_train(const std::string& options, const std::string& log) {
  const std::string cmd = "exec " + kBmtrun + " --nproc 2 " + kTrain + small_run_options() + options;
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The rank processes bmtrun started: pid of each RANK found (-1 where not running yet).
std::vector<pid_t> rank_pids(pid_t launcher, int world) {
  std::vector<pid_t> out(static_cast<size_t>(world), -1);
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
    if (pid <= 0) continue;
    const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 2));
    std::string state;
    pid_t ppid = 0;
    fields >> state >> ppid;
    if (ppid != launcher) continue;
    const std::string env = read_file("/proc/" + std::to_string(pid) + "/environ");
    const size_t at = env.find(std::string("RANK=")) == 0 ? 0 : env.find(std::string("\0RANK=", 6));
    if (at == std::string::npos) continue;
    const int rank = std::atoi(env.c_str() + at + (at == 0 ? 5 : 6));
    if (rank >= 0 && rank < world) out[static_cast<size_t>(rank)] = pid;
  }
  ::closedir(d);
  return out;
}

// Waits up to limit for `pid` to exit; -1 (after killing it) when it did not.
int wait_exit(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = Clock::now() + limit;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The last step a run's log reports ("step N/<steps>"), 0 before its first.
int64_t last_logged_step(const std::string& log, int64_t steps) {
  const std::string tail = "/" + std::to_string(steps) + " ";
  int64_t last = 0;
  for (size_t at = log.find(tail); at != std::string::npos; at = log.find(tail, at + 1)) {
    size_t begin = at;
    while (begin > 0 && std::isdigit(static_cast<unsigned char>(log[begin - 1]))) --begin;
    if (begin == at || begin < 5 || log.compare(begin - 5, 5, "step ") != 0) continue;
    last = std::max<int64_t>(last, std::atoll(log.c_str() + begin));
  }
  return last;
}

}  // namespace

// Issue 36's soak: 20 kill cycles, each a kill -9 of a random rank at a random moment (start-up, loading, a step, a
// sync or async save, a commit), then --resume; `latest` is sound and never goes back after any cycle, and the
// finished run equals the uninterrupted one bit for bit. The delays are drawn (seeded) from [0, start-up + 6
// steps] as measured on the uninterrupted run, so kills land in every phase on fast and slow machines alike.
TEST(TrainGptKillResume, SoakOfTwentyRandomKillsEachResumedEndsOnTheUninterruptedRun) {
  constexpr int64_t kSteps = 160, kSaveEvery = 2, kKeepLast = 3;  // --keep-last runs under the kills too
  constexpr int kCycles = 20;
  constexpr int64_t kStepsPerCycle = 4;  // the most steps a cycle waits for past its resume point (see the cut)
  const auto t_soak = Clock::now();
  std::mt19937 rng(test_seed() + 4);
  const std::string root = temp_root("soak");
  const RunPaths ref{root + "/ref", root + "/ref.jsonl"}, run{root + "/run", root + "/run.jsonl"};

  // The reference, timed: start-up (until its first step line) and the time per step.
  const auto t_ref = Clock::now();
  const pid_t ref_pid = spawn_train(run_options(ref, kSteps, kSaveEvery, false, kKeepLast), root + "/ref.log");
  double startup_s = -1;
  int status = 0;
  bool reaped = false;
  while (startup_s < 0 && !reaped && seconds_since(t_ref) < 120) {
    if (contains(read_file(root + "/ref.log"), "step 1/")) startup_s = seconds_since(t_ref);
    reaped = ::waitpid(ref_pid, &status, WNOHANG) == ref_pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!reaped) wait_exit(ref_pid, std::chrono::seconds(300));  // the exit is judged by the metrics below
  const double ref_s = seconds_since(t_ref);
  const std::vector<StepMetrics> reference = read_step_metrics(ref.metrics);
  ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps)) << read_file(root + "/ref.log");
  ASSERT_GT(startup_s, 0) << read_file(root + "/ref.log");
  const double step_s = std::max(1e-3, (ref_s - startup_s) / static_cast<double>(kSteps));
  const double max_delay_s = startup_s + 6 * step_s;
  std::printf("[ reference: start-up %.2f s, %.1f ms per step; kill delays drawn from [0, %.2f s] ]\n", startup_s,
              1e3 * step_s, max_delay_s);

  int64_t last_latest = 0;
  int kills = 0;
  for (int cycle = 1; cycle <= kCycles; ++cycle) {
    const bool async = rng() % 2 == 1;
    const int rank = static_cast<int>(rng() % 2);
    const double delay_s = std::uniform_real_distribution<double>(0.0, max_delay_s)(rng);
    const std::string log = root + "/cycle" + std::to_string(cycle) + ".log";
    const auto t0 = Clock::now();
    const pid_t pid = spawn_train(run_options(run, kSteps, kSaveEvery, async, kKeepLast) + " --resume", log);
    // The delay counts from the moment both ranks exist (bmtrun's own start-up is not the job's).
    std::vector<pid_t> ranks;
    for (;;) {
      ranks = rank_pids(pid, 2);
      if ((ranks[0] > 0 && ranks[1] > 0) || seconds_since(t0) > 60) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (ranks[static_cast<size_t>(rank)] <= 0) {
      ::kill(pid, SIGKILL);
      wait_exit(pid, std::chrono::seconds(30));
      FAIL() << "cycle " << cycle << ": rank " << rank << " never started\n" << read_file(log);
    }
    // The drawn delay, cut short once this run has done kStepsPerCycle steps past the checkpoint it resumed from: a
    // loaded machine's reference start-up can outlast a resumed one's by far, and cycles that each ran on until a
    // cut near the end would leave the later ones only a few steps, which a run can finish before the kill lands.
    // 20 cycles of a few steps each stay far below kSteps.
    const int64_t cut = std::min(last_latest + kStepsPerCycle, kSteps - 4);
    const auto t_kill = Clock::now();
    while (seconds_since(t_kill) < delay_s && last_logged_step(read_file(log), kSteps) < cut)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const bool sent = ::kill(ranks[static_cast<size_t>(rank)], SIGKILL) == 0;
    const int code = wait_exit(pid, std::chrono::seconds(120));
    ASSERT_NE(code, -1) << "cycle " << cycle << ": the job did not end after rank " << rank << " was killed\n"
                        << read_file(log);
    ASSERT_NE(code, 0) << "cycle " << cycle << ": the run finished before the kill (" << delay_s << " s)\n"
                       << read_file(log);
    kills += sent ? 1 : 0;
    const int64_t latest = sound_latest(run.ckpt);
    std::printf("[ cycle %2d: %s, rank %d killed after %.2f s, exit %d, latest step %ld ]\n", cycle,
                async ? "async saves" : "sync saves ", rank, delay_s, code, static_cast<long>(latest));
    EXPECT_GE(latest, last_latest) << "cycle " << cycle << ": latest went back\n" << read_file(log);
    last_latest = latest;
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_EQ(kills, kCycles);

  Result last = train(2, run_options(run, kSteps, kSaveEvery, false, kKeepLast) + " --resume");
  ASSERT_EQ(last.exit_code, 0) << last.output;
  expect_same_steps(reference, read_step_metrics(run.metrics), "the soak's runs");
  EXPECT_EQ(sound_latest(run.ckpt), kSteps);
  expect_same_checkpoint(ref.ckpt + "/" + step_name(kSteps), run.ckpt + "/" + step_name(kSteps));
  expect_no_leftovers(run.ckpt);
  std::printf("[ soak: %d kills in %.1f s ]\n", kills, seconds_since(t_soak));
  if (!::testing::Test::HasFailure()) remove_root(root);
}
