// Failure behaviour on real processes over real Gloo: a rank that exits, is killed or stalls mid-collective
// makes the others fail with a DistError naming the operation and the communicator, within the communicator
// timeout (never a silent hang); bad topology / backend / double init give clear bmt::core::Error messages.
//
// Fault runs use RankRunOptions{kill_on_first_failure = false, expect_failure = true}. A surviving rank catches
// the exception, checks it, prints it and leaves with std::_Exit(code) (no finalize: its peers are gone); the
// parent then reads every rank's exit status from the report:
//   42 = DistError caught, message names the operation and the communicator, within timeout + slack
//   43 = wrong exception type or message, 44 = no exception at all, 45 = too slow (or, for a stall, too fast)
// Time bounds: these tests run alone (RUN_SERIAL), yet a loaded machine still delays process start and detection
// by seconds; lower bounds come from the communicator timeout (a timeout never fires early), upper bounds leave
// kSlackS of scheduling slack and only have to tell "detected" from "hung until the 120 s wall timeout".
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <thread>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "run_ranks.h"

namespace {

using bmt::core::DType;
using bmt::core::ReduceOp;
using Clock = std::chrono::steady_clock;

constexpr int kCaughtOk = 42;
constexpr int kWrongError = 43;
constexpr int kNoError = 44;
constexpr int kBadTiming = 45;
constexpr int kDiedOnPurpose = 7;
constexpr auto kTimeout = std::chrono::seconds(5);
constexpr double kSlackS = 15.0;

bmt::InitOptions fault_init() {
  bmt::InitOptions o = bmt::testing::test_init();
  o.timeout = kTimeout;
  return o;
}

bmt::testing::RankRunOptions fault_run() {
  bmt::testing::RankRunOptions run;
  run.kill_on_first_failure = false;
  run.expect_failure = true;
  run.wall_timeout = std::chrono::seconds(120);
  return run;
}

// Runs `op`, which must fail with a DistError whose message contains every fragment (and no C++ backtrace),
// after between min_s and max_s seconds; exits the process with a code saying how it went.
[[noreturn]] void survive(const std::function<void()>& op, const std::vector<std::string>& fragments, double min_s,
                          double max_s) {
  auto t0 = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  int code = kCaughtOk;
  try {
    op();
    std::printf("survivor rank %d: the operation completed; a DistError was expected\n", bmt::rank());
    code = kNoError;
  } catch (const bmt::core::DistError& e) {
    double s = elapsed();
    std::printf("survivor rank %d: DistError after %.3f s: %s\n", bmt::rank(), s, e.what());
    for (const auto& f : fragments)
      if (std::string(e.what()).find(f) == std::string::npos) {
        std::printf("survivor rank %d: the message lacks '%s'\n", bmt::rank(), f.c_str());
        code = kWrongError;
      }
    if (std::string(e.what()).find("frame #") != std::string::npos) {
      std::printf("survivor rank %d: the message carries a C++ backtrace\n", bmt::rank());
      code = kWrongError;
    }
    if (code == kCaughtOk && (s < min_s || s > max_s)) {
      std::printf("survivor rank %d: %.3f s is outside [%.1f, %.1f] s\n", bmt::rank(), s, min_s, max_s);
      code = kBadTiming;
    }
  } catch (const std::exception& e) {
    std::printf("survivor rank %d: not a DistError: %s\n", bmt::rank(), e.what());
    code = kWrongError;
  }
  std::fflush(stdout);
  std::_Exit(code);
}

// "exit code 42" or "signal Killed" for rank r, "ok" when it is not in the report (exit code 0).
std::string status_of(const bmt::testing::RankRunReport& report, int r, int world) {
  std::string head = "rank " + std::to_string(r) + " of " + std::to_string(world) + " failed (";
  auto pos = report.summary.find(head);
  if (pos == std::string::npos) return "ok";
  pos += head.size();
  auto end = report.summary.find_first_of(";,)", pos);
  return report.summary.substr(pos, end - pos);
}

std::string exit_code(int code) { return "exit code " + std::to_string(code); }

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const double kTimeoutS = std::chrono::duration<double>(kTimeout).count();

}  // namespace

// A rank leaves with std::_Exit(7) while the others are inside an all_reduce on the world communicator.
TEST(Faults, RankExitMidAllReduce) {
  auto report = bmt::testing::run_ranks(3, [] {
    auto& comm = *bmt::config().comm;
    comm.barrier();  // everyone connected and in step
    if (bmt::rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others are waiting in all_reduce now
      std::_Exit(kDiedOnPurpose);
    }
    std::vector<float> x(1000, 1.0f), y(1000);
    survive([&] { comm.all_reduce(x.data(), y.data(), x.size(), DType::kFloat32, ReduceOp::kSum, nullptr); },
            {"all_reduce", "'world'"}, 0.0, kTimeoutS + kSlackS);
  }, fault_init(), fault_run());
  if (bmt::testing::in_rank_process()) return;
  EXPECT_FALSE(report.all_ok);
  EXPECT_EQ(status_of(report, 1, 3), exit_code(kDiedOnPurpose)) << report.summary;
  EXPECT_EQ(status_of(report, 0, 3), exit_code(kCaughtOk)) << report.summary;
  EXPECT_EQ(status_of(report, 2, 3), exit_code(kCaughtOk)) << report.summary;
}

// A rank is killed (SIGKILL: no destructor, no exit handler) inside its tensor-parallel group at world 4,
// tp_size 2. Its partner fails in the tp broadcast with a DistError naming the tp communicator; the other tp
// group (ranks 0, 1) is unaffected and keeps working.
TEST(Faults, RankKilledMidTpBroadcastOtherGroupUnaffected) {
  bmt::InitOptions opts = fault_init();
  opts.tp_size = 2;
  auto report = bmt::testing::run_ranks(4, [] {
    const auto& cfg = bmt::config();
    cfg.comm->barrier();
    auto& tp = *cfg.tp_comm;
    std::vector<float> x(100000, static_cast<float>(cfg.rank)), y(100000);
    if (cfg.rank == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      raise(SIGKILL);
    }
    if (cfg.rank == 2) {
      // root 1 of the tp group = world rank 3, which dies
      survive([&] { tp.broadcast(x.data(), y.data(), x.size(), DType::kFloat32, 1, nullptr); },
              {"broadcast", "'" + tp.name() + "'", "tp"}, 0.0, kTimeoutS + kSlackS);
    }
    // Ranks 0 and 1: their group is healthy while rank 3 dies and after.
    for (int k = 0; k < 5; ++k) {
      tp.broadcast(x.data(), y.data(), x.size(), DType::kFloat32, 1, nullptr);
      EXPECT_EQ(y[0], 1.0f);
      EXPECT_EQ(y[99999], 1.0f);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    tp.barrier();
    std::fflush(stdout);
    std::_Exit(::testing::Test::HasFailure() ? 1 : 0);  // no world finalize: rank 3 is gone
  }, opts, fault_run());
  if (bmt::testing::in_rank_process()) return;
  EXPECT_EQ(status_of(report, 3, 4), "signal Killed") << report.summary;
  EXPECT_EQ(status_of(report, 2, 4), exit_code(kCaughtOk)) << report.summary;
  EXPECT_EQ(status_of(report, 0, 4), "ok") << report.summary;
  EXPECT_EQ(status_of(report, 1, 4), "ok") << report.summary;
}

// A rank stalls (alive, but never joins): the others time out after about the communicator timeout, in a
// point-to-point recv (rank 0) and in a barrier (rank 2), each error naming its operation.
TEST(Faults, StalledRankTimesOut) {
  auto report = bmt::testing::run_ranks(3, [] {
    auto& comm = *bmt::config().comm;
    comm.barrier();
    const double min_s = 0.8 * kTimeoutS, max_s = kTimeoutS + kSlackS;
    if (bmt::rank() == 1) {
      std::this_thread::sleep_for(kTimeout + std::chrono::seconds(static_cast<int>(kSlackS) + 2));  // past every bound
      std::_Exit(kDiedOnPurpose);
    }
    float buf[16] = {};
    if (bmt::rank() == 0)
      survive([&] { comm.recv(buf, 16, DType::kFloat32, 1, nullptr); }, {"recv", "'world'", "timed out"}, min_s,
              max_s);
    survive([&] { comm.barrier(); }, {"barrier", "'world'"}, min_s, max_s);
  }, fault_init(), fault_run());
  if (bmt::testing::in_rank_process()) return;
  EXPECT_EQ(status_of(report, 1, 3), exit_code(kDiedOnPurpose)) << report.summary;
  EXPECT_EQ(status_of(report, 0, 3), exit_code(kCaughtOk)) << report.summary;
  EXPECT_EQ(status_of(report, 2, 3), exit_code(kCaughtOk)) << report.summary;
}

// ---------------------------------------------------------------------------------------------------------
// Configuration errors.

namespace {

// Sets launch variables for the duration of a scope and restores the previous environment.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::vector<std::pair<std::string, std::string>> vars) {
    for (auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved_.push_back({k, old ? std::optional<std::string>(old) : std::nullopt});
      setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (auto& [k, v] : saved_) {
      if (v)
        setenv(k.c_str(), v->c_str(), 1);
      else
        unsetenv(k.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const bmt::core::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("NOT A bmt::core::Error: ") + e.what();
  }
  return "NO EXCEPTION";
}

void expect_contains(const std::string& msg, const std::vector<std::string>& fragments) {
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

}  // namespace

// In this (parent) process, as rank 0 of a pretended world of 4: every check fails before any network wait.
TEST(Faults, WrongTopologyAndBackendGiveClearErrors) {
  const bmt::testing::PortReservation port;  // held (bound, SO_REUSEADDR) until the test ends
  ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"},
                 {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port.port())}});
  unsetenv("BMT_TIMEOUT_S");
  auto init = [](auto&& tweak) {
    return error_message([&] {
      bmt::InitOptions o = bmt::testing::test_init();
      o.timeout = std::chrono::seconds(20);  // a missing check would wait this long: far above the bound below
      tweak(o);
      bmt::init_distributed(o);
      bmt::finalize(false);
    });
  };
  auto t0 = Clock::now();
  std::string tp3 = init([](bmt::InitOptions& o) { o.tp_size = 3; });
  expect_contains(tp3, {"tp_size (3)", "world size 4", "rank 0 of 4"});
  std::string tp2pp3 = init([](bmt::InitOptions& o) {
    o.tp_size = 2;
    o.pipe_size = 3;
  });
  expect_contains(tp2pp3, {"tp_size (2)", "pipe_size (3)", "6", "world size 4"});
  expect_contains(init([](bmt::InitOptions& o) { o.tp_size = 0; }), {"tp_size 0", ">= 1"});
  expect_contains(init([](bmt::InitOptions& o) { o.pipe_size = -2; }), {"pipe_size -2", ">= 1"});
  expect_contains(init([](bmt::InitOptions& o) { o.zero_level = 1; }), {"zero_level 1", "2", "3"});
  expect_contains(init([](bmt::InitOptions& o) { o.timeout = std::chrono::milliseconds(0); }), {"timeout"});
#ifndef BMT_WITH_CUDA
  expect_contains(init([](bmt::InitOptions& o) { o.backend = bmt::Backend::kNccl; }),
                  {"nccl", "without CUDA", "gloo"});
#endif
  // Seven failed inits: one that waited on the network would alone take the whole 20 s timeout.
  EXPECT_LT(seconds_since(t0), 20.0) << "a configuration error waited on the network (20 s timeout)";
  EXPECT_FALSE(bmt::is_initialized());

  std::string mpi = error_message([] { bmt::parse_backend("mpi"); });
  expect_contains(mpi, {"'mpi'", "auto", "nccl", "gloo"});
  expect_contains(error_message([] { bmt::parse_backend("NCCL "); }), {"'NCCL '"});
  EXPECT_EQ(bmt::parse_backend("auto"), bmt::Backend::kAuto);
  EXPECT_EQ(bmt::parse_backend("nccl"), bmt::Backend::kNccl);
  EXPECT_EQ(bmt::parse_backend("gloo"), bmt::Backend::kGloo);
  EXPECT_STREQ(bmt::backend_name(bmt::Backend::kGloo), "gloo");
  expect_contains(error_message([] { bmt::config(); }), {"not initialized", "init_distributed"});
}

// The same wrong topology on 4 real ranks: every rank fails at once with the message (none hangs).
TEST(Faults, WrongTopologyFailsEveryRankQuickly) {
  bmt::InitOptions opts = fault_init();
  opts.tp_size = 3;
  opts.timeout = std::chrono::seconds(90);  // a rank that waited on the network would take this long
  auto t0 = Clock::now();
  auto report = bmt::testing::run_ranks(4, [] { ADD_FAILURE() << "init_distributed accepted tp_size 3 at world 4"; },
                                        opts, fault_run());
  if (bmt::testing::in_rank_process()) return;
  EXPECT_LT(seconds_since(t0), 90.0) << "ranks waited instead of failing at once (the 90 s timeout)";
  for (int r = 0; r < 4; ++r) EXPECT_EQ(status_of(report, r, 4), exit_code(1)) << report.summary;
  expect_contains(report.summary, {"tp_size (3)", "does not divide 4"});
}

// init_distributed twice: a clear error, and the first initialisation stays usable.
TEST(Faults, InitTwiceIsAnError) {
  bmt::testing::run_ranks(2, [] {
    std::string msg = error_message([] { bmt::init_distributed(bmt::testing::test_init()); });
    expect_contains(msg, {"init_distributed called twice", "finalize"});
    float one = 1, sum = 0;
    bmt::config().comm->all_reduce(&one, &sum, 1, DType::kFloat32, ReduceOp::kSum, nullptr);
    EXPECT_EQ(sum, 2.0f);
  });
}
