// The heartbeat monitor (bmt::core::PeerMonitor, started by init_distributed on its own store connection) on real
// processes: a killed rank is named by every survivor within a few heartbeats (its process is gone from /proc),
// a stopped rank (SIGSTOP) after the heartbeat timeout and not before, a rank that finalizes cleanly never, and a
// Gloo collective that fails because of the dead rank names it in its DistError. The NCCL watchdog acts on the
// same verdict (tests/cuda/nccl_fault_check.sh exercises it on two GPUs).
// No wall-clock windows: what the tests time is bounded only by the timeout under test (a killed rank must be named
// before its heartbeat could have gone stale, since the /proc check saw it; a stopped rank not before the stale
// time less one beat period, since its last beat was at most one period before it stopped).
// Exit codes of the surviving ranks (checked by the parent): 42 = as expected, 43 = wrong or missing verdict or
// message, 45 = a verdict earlier or later than the timeout under test allows.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "bmt/core/error.h"
#include "bmt/core/peer_monitor.h"
#include "bmt/runtime/distributed.h"
#include "run_ranks.h"

namespace {

using bmt::core::DType;
using bmt::core::ReduceOp;
using Clock = std::chrono::steady_clock;

constexpr int kOk = 42, kWrong = 43, kBadTiming = 45;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bmt::InitOptions init_with_timeout(int seconds) {
  bmt::InitOptions o = bmt::testing::test_init();
  o.timeout = std::chrono::seconds(seconds);
  return o;
}

bmt::testing::RankRunOptions fault_run() {
  bmt::testing::RankRunOptions run;
  run.kill_on_first_failure = false;
  run.expect_failure = true;
  run.wall_timeout = std::chrono::seconds(90);
  return run;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Waits for the monitor's verdict (up to twice the stale time); kOk when it names `dead` with every fragment, after
// at least min_s and (max_s > 0) before max_s, both derived by the caller from the timeout under test.
int check_verdict(int dead, const std::vector<std::string>& fragments, double min_s, double max_s,
                  Clock::time_point t0) {
  const bmt::core::PeerMonitor* m = bmt::config().peer_monitor.get();
  if (!m) return kWrong;
  std::string v = m->wait_for_verdict(2 * m->options().stale_ms + m->options().interval_ms);
  double s = since(t0);
  std::printf("rank %d: verdict after %.2f s: %s\n", bmt::rank(), s, v.c_str());
  int code = kOk;
  if (m->dead_rank() != dead) code = kWrong;
  for (const auto& f : fragments)
    if (!contains(v, f)) {
      std::printf("rank %d: the verdict lacks '%s'\n", bmt::rank(), f.c_str());
      code = kWrong;
    }
  if (code == kOk && (s < min_s || (max_s > 0 && s > max_s))) {
    std::printf("rank %d: %.2f s is outside [%.1f, %.1f] s\n", bmt::rank(), s, min_s, max_s);
    code = kBadTiming;
  }
  return code;
}

std::string status_of(const bmt::testing::RankRunReport& report, int r, int world) {
  std::string head = "rank " + std::to_string(r) + " of " + std::to_string(world) + " failed (";
  auto pos = report.summary.find(head);
  if (pos == std::string::npos) return "ok";
  pos += head.size();
  return report.summary.substr(pos, report.summary.find_first_of(";,)", pos) - pos);
}

const std::string kCaught = "exit code 42";

}  // namespace

// kill -9 of rank 2 of 3: both survivors name it as gone (the /proc check), before the 20 s timeout could have
// made its heartbeat stale, check_communicators_alive (asked before a CUDA graph replay) raises naming it, and a
// Gloo all_reduce that fails on the dead rank says which rank died.
TEST(Heartbeat, KilledRankIsNamedQuicklyAndInTheGlooError) {
  constexpr int kTimeoutS = 20;
  auto report = bmt::testing::run_ranks(3, [] {
    auto& comm = *bmt::config().comm;
    bmt::check_communicators_alive(bmt::config(), "the healthy step");  // every rank alive: no error
    comm.barrier();
    if (bmt::rank() == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      raise(SIGKILL);
    }
    auto t0 = Clock::now();
    int code = check_verdict(2, {"rank 2 is dead", "is gone"}, 0.0, kTimeoutS, t0);
    // What a replayed CUDA graph asks before it launches collectives the communicators do not see.
    try {
      bmt::check_communicators_alive(bmt::config(), "the graph step");
      std::printf("rank %d: check_communicators_alive passed with rank 2 dead\n", bmt::rank());
      code = kWrong;
    } catch (const bmt::core::DistError& e) {
      std::printf("rank %d: %s\n", bmt::rank(), e.what());
      if (!contains(e.what(), "the graph step") || !contains(e.what(), "rank 2 is dead")) code = kWrong;
    }
    std::vector<float> x(1000, 1.0f), y(1000);
    try {
      comm.all_reduce(x.data(), y.data(), x.size(), DType::kFloat32, ReduceOp::kSum, nullptr);
      std::printf("rank %d: all_reduce completed without rank 2\n", bmt::rank());
      code = kWrong;
    } catch (const bmt::core::DistError& e) {
      std::printf("rank %d: %s\n", bmt::rank(), e.what());
      if (!contains(e.what(), "all_reduce") || !contains(e.what(), "rank 2 is dead")) code = kWrong;
    }
    std::fflush(stdout);
    std::_Exit(code);
  }, init_with_timeout(kTimeoutS), fault_run());
  if (bmt::testing::in_rank_process()) return;
  EXPECT_EQ(status_of(report, 2, 3), "signal Killed") << report.summary;
  EXPECT_EQ(status_of(report, 0, 3), kCaught) << report.summary;
  EXPECT_EQ(status_of(report, 1, 3), kCaught) << report.summary;
}

// SIGSTOP of rank 2 of 3: its heartbeat stops but its process exists. The verdict comes after the heartbeat
// timeout (6 s), says the process is stopped, and reaches rank 0 too (which does not watch rank 2 itself).
// A Gloo barrier on the stopped rank times out with a DistError naming it.
// The barrier's timeout is twice the heartbeat's: with both equal, rank 0's barrier error came when the verdict
// (stale time + up to three polls: see, publish, adopt) was due, and the error's wait for it (three polls) left
// about a second for a loaded machine's delays.
TEST(Heartbeat, StoppedRankIsNamedAfterTheTimeoutNotBefore) {
  constexpr int kTimeoutS = 6;
  setenv("BMT_HEARTBEAT_TIMEOUT_S", std::to_string(kTimeoutS).c_str(), 1);  // the children inherit it
  auto report = bmt::testing::run_ranks(3, [] {
    auto& cfg = bmt::config();
    if (bmt::rank() == 2) {
      std::string pid = std::to_string(getpid());
      cfg.store->set("test/stopped_pid", std::vector<uint8_t>(pid.begin(), pid.end()));
    }
    // t0 before the barrier: rank 2 cannot leave it (and stop) before this rank entered it. Taken after, a survivor
    // delayed on a loaded machine would start its clock late and could see the verdict "too early".
    auto t0 = Clock::now();
    cfg.comm->barrier();
    if (bmt::rank() == 2) raise(SIGSTOP);
    int code = kOk;
    try {
      cfg.comm->barrier();
      code = kWrong;
    } catch (const bmt::core::DistError& e) {
      std::printf("rank %d: barrier after %.2f s: %s\n", bmt::rank(), since(t0), e.what());
      if (!contains(e.what(), "barrier") || !contains(e.what(), "rank 2 is dead")) code = kWrong;
    }
    // Rank 2 stopped after t0 and its last beat came at most one beat period before it stopped, so no verdict may
    // come before timeout - period. A period is an interval plus the store round trips of one loop, which a loaded
    // machine stretches: half an interval of allowance for those.
    const double interval_s = static_cast<double>(cfg.peer_monitor->options().interval_ms) / 1000.0;
    int verdict = check_verdict(2, {"rank 2 is dead", "stopped"}, kTimeoutS - 1.5 * interval_s, 0.0, t0);
    if (code == kOk) code = verdict;
    if (bmt::rank() == 0) {  // the stopped rank would outlive the test
      auto pid = cfg.store->get("test/stopped_pid");
      kill(std::atoi(std::string(pid.begin(), pid.end()).c_str()), SIGKILL);
    }
    std::fflush(stdout);
    std::_Exit(code);
  }, init_with_timeout(2 * kTimeoutS), fault_run());
  unsetenv("BMT_HEARTBEAT_TIMEOUT_S");
  if (bmt::testing::in_rank_process()) return;
  EXPECT_EQ(status_of(report, 2, 3), "signal Killed") << report.summary;
  EXPECT_EQ(status_of(report, 0, 3), kCaught) << report.summary;
  EXPECT_EQ(status_of(report, 1, 3), kCaught) << report.summary;
}

// Healthy ranks, one of which finalizes and leaves early: no verdict ever, even after twice the heartbeat timeout
// plus one interval.
TEST(Heartbeat, HealthyAndCleanlyFinishedRanksAreNeverReported) {
  setenv("BMT_HEARTBEAT_TIMEOUT_S", "4", 1);  // the children inherit it
  auto report = bmt::testing::run_ranks(3, [] {
    bmt::config().comm->barrier();
    if (bmt::rank() == 1) {
      bmt::finalize(false);
      std::_Exit(kOk);
    }
    const auto& o = bmt::config().peer_monitor->options();
    std::this_thread::sleep_for(std::chrono::milliseconds(2 * o.stale_ms + o.interval_ms));
    std::string v = bmt::config().peer_monitor->verdict();
    std::printf("rank %d: verdict '%s'\n", bmt::rank(), v.c_str());
    std::fflush(stdout);
    std::_Exit(v.empty() ? kOk : kWrong);
  }, init_with_timeout(30), fault_run());
  unsetenv("BMT_HEARTBEAT_TIMEOUT_S");
  if (bmt::testing::in_rank_process()) return;
  for (int r = 0; r < 3; ++r) EXPECT_EQ(status_of(report, r, 3), kCaught) << report.summary;
}

// kill -9 of rank 0 of 2, the rank hosting the rendezvous store (ranks launched without a launcher, as here):
// the survivor's heartbeat loses the store at once; it names rank 0 from its process being gone (not "the store
// did not answer"), within a few heartbeats, and nothing it prints carries torch's C++ backtraces (torch's TCPStore
// client errors used to reach stderr from the heartbeat thread as 4-5 backtraces).
TEST(Heartbeat, KilledStoreHostIsNamedWithoutBacktraces) {
  auto report = bmt::testing::run_ranks(2, [] {
    auto& comm = *bmt::config().comm;
    char log[] = "/tmp/bmt_heartbeat_stderr_XXXXXX";
    if (bmt::rank() == 1) {
      const int fd = ::mkstemp(log);
      if (fd < 0) std::_Exit(kWrong);
      ::dup2(fd, 2);  // everything this rank prints to stderr from now on
    }
    comm.barrier();
    if (bmt::rank() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      raise(SIGKILL);
    }
    auto t0 = Clock::now();
    int code = check_verdict(0, {"rank 0 is dead", "is gone", "hosted the rendezvous store"}, 0.0, 8.0, t0);
    std::vector<float> x(1000, 1.0f), y(1000);
    try {
      comm.all_reduce(x.data(), y.data(), x.size(), DType::kFloat32, ReduceOp::kSum, nullptr);
      code = kWrong;
    } catch (const bmt::core::DistError& e) {
      std::printf("rank 1: %s\n", e.what());
      if (!contains(e.what(), "rank 0 is dead")) code = kWrong;
    }
    std::this_thread::sleep_for(std::chrono::seconds(3));  // a few more heartbeats against the dead store
    std::fflush(stderr);
    std::string err;
    if (FILE* f = std::fopen(log, "r")) {
      char buf[4096];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) err.append(buf, n);
      std::fclose(f);
    }
    ::unlink(log);
    std::printf("rank 1: stderr was:\n%s(end)\n", err.c_str());
    if (contains(err, "Exception raised from") || contains(err, "frame #")) code = kWrong;
    std::fflush(stdout);
    std::_Exit(code);
  }, init_with_timeout(20), fault_run());
  if (bmt::testing::in_rank_process()) return;
  EXPECT_EQ(status_of(report, 0, 2), "signal Killed") << report.summary;
  EXPECT_EQ(status_of(report, 1, 2), kCaught) << report.summary;
}
