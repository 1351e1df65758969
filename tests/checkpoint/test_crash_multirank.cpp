// Crash safety: a child process saves a checkpoint over and over (each version v fills every parameter with v,
// with a write hook that slows writes down) and is killed with SIGKILL at random moments, including during the
// directory commit. After every kill the checkpoint must load, hold one consistent version (every parameter equals
// the step recorded in its metadata), and never go backwards. Both commit protocols are exercised: the atomic
// exchange, and the rename-away/rename-in protocol whose crash window is resolved by the reader.
#include <signal.h>
#include <sys/wait.h>

#include <iostream>
#include <random>
#include <thread>

#include "bmt/checkpoint/atomic_dir_internal.h"
#include "bmt/checkpoint/checkpoint_reader.h"
#include "ckpt_test_util.h"

using namespace ckpt_test;
namespace ck = bmt::checkpoint;

// The writer: runs only when started by the crash test (environment), as a one-rank job.
TEST(CheckpointCrashChild, Writer) {
  const char* dir = std::getenv("BMT_CKPT_CRASH_DIR");
  if (!dir) GTEST_SKIP() << "helper process of CheckpointCrash.KilledWriterLeavesLoadableCheckpoint";
  const bool exchange = std::string(std::getenv("BMT_CKPT_CRASH_MODE")) == "exchange";
  const int64_t base = std::atoll(std::getenv("BMT_CKPT_CRASH_BASE"));
  bmt::init_distributed(bmt::testing::test_init());
  tiny::Dims d;
  d.dim = 64;
  d.ff = 256;  // ~0.5 MB of parameters: several write calls per save
  tiny::Model model(d, {}, true);
  ck::set_write_hook([](const std::string&, int64_t, int64_t) { std::this_thread::sleep_for(std::chrono::milliseconds(1)); });
  ck::SaveOptions o;
  o.allow_exchange = exchange;
  o.checksum_block_nbytes = 64 << 10;
  ck::write_file_durable(std::string(dir) + "/alive-" + std::to_string(base), "");
  for (int64_t v = base;; ++v) {
    {
      at::NoGradGuard ng;
      for (auto& p : model.parameters()) p.detach().fill_(static_cast<double>(v));
    }
    ck::TrainingState st;
    st.model = &model;
    st.step = v;
    st.rng = false;
    ck::save(std::string(dir) + "/ckpt", st, o);
    if (v == base) ck::write_file_durable(std::string(dir) + "/saved-" + std::to_string(base), "");
  }
}

namespace {

// The version held by the checkpoint (after checking that it is complete and consistent).
int64_t checked_version(const std::string& ckpt) {
  ck::CheckpointReader r(ckpt);
  const int64_t v = r.metadata().step;
  EXPECT_TRUE(r.verify_all().empty());
  for (const auto& e : r.metadata().entries) {
    at::Tensor t = r.read_full(e);
    EXPECT_TRUE(at::equal(t, at::full_like(t, static_cast<double>(v)))) << e.key << " is not at version " << v;
  }
  return v;
}

// `port` stays reserved by the caller until the writer has exited.
pid_t spawn_writer(const std::string& dir, const char* mode, int64_t base, int port) {
  pid_t pid = fork();
  if (pid == 0) {
    setenv("BMT_CKPT_CRASH_DIR", dir.c_str(), 1);
    setenv("BMT_CKPT_CRASH_MODE", mode, 1);
    setenv("BMT_CKPT_CRASH_BASE", std::to_string(base).c_str(), 1);
    setenv("RANK", "0", 1);
    setenv("LOCAL_RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    setenv("LOCAL_WORLD_SIZE", "1", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    setenv("OMP_NUM_THREADS", "1", 1);
    FILE* f = std::freopen((dir + "/writer.log").c_str(), "a", stdout);
    (void)f;
    dup2(fileno(stdout), fileno(stderr));
    execl("/proc/self/exe", "/proc/self/exe", "--gtest_filter=CheckpointCrashChild.Writer", static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

}  // namespace

TEST(CheckpointCrash, KilledWriterLeavesLoadableCheckpoint) {
  if (bmt::testing::in_rank_process()) return;
  SharedDir dir("crash");
  std::mt19937 rng(12345);
  int64_t last = -1;
  int max_delay_us = 700'000;  // kill delay after the writer started saving: uniform in [0, max]
  int advanced = 0, mid_save = 0;  // rounds that committed new versions / were killed inside a save
  for (const char* mode : {"exchange", "rename"}) {
    for (int round = 0; round < 10; ++round) {
      const int64_t base = (last + 1000) / 1000 * 1000 + 1000;
      const bmt::testing::PortReservation port;
      pid_t pid = spawn_writer(dir.path, mode, base, port.port());
      // The first round waits until one checkpoint exists; later ones until the writer starts saving.
      const std::string marker = dir / ((last < 0 ? "saved-" : "alive-") + std::to_string(base));
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (!ck::path_exists(marker) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ASSERT_TRUE(ck::path_exists(marker)) << ck::read_file(dir / "writer.log", 1 << 20);
      std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, max_delay_us)(rng)));
      kill(pid, SIGKILL);
      int status = 0;
      waitpid(pid, &status, 0);
      ASSERT_TRUE(WIFSIGNALED(status)) << "the writer exited by itself: " << ck::read_file(dir / "writer.log", 1 << 20);
      const int64_t v = checked_version(dir / "ckpt");
      EXPECT_GE(v, last) << "the checkpoint went back in time (" << mode << ", round " << round << ")";
      if (v > last && last >= 0) ++advanced;
      if (v <= last) max_delay_us = std::min(max_delay_us * 3 / 2, 5'000'000);  // a slow machine: wait longer
      for (const std::string& name : ck::list_directory(dir.path))
        if (name.rfind("ckpt.tmp-", 0) == 0 || name.rfind("ckpt.old-", 0) == 0) {
          ++mid_save;  // killed inside a save (leftover temporary or old directory)
          break;
        }
      last = std::max(last, v);
    }
    // The next save repairs any crash state and cleans leftovers: only the checkpoint remains beside the logs.
    ck::repair_and_clean(dir / "ckpt");
    for (const std::string& name : ck::list_directory(dir.path))
      EXPECT_TRUE(name == "ckpt" || name == "writer.log" || name.rfind("saved-", 0) == 0 || name.rfind("alive-", 0) == 0)
          << name;
    EXPECT_GE(checked_version(dir / "ckpt"), last);
  }
  // The kills must have landed at varied points: some rounds committed new versions, some did not.
  std::cout << "crash test: " << advanced << " of 19 later rounds advanced the checkpoint, " << mid_save
            << " of 20 were killed inside a save\n";
  EXPECT_GE(advanced, 3);
  EXPECT_GE(mid_save, 3);
}
