// run_ranks: runs a test body on N real processes over real Gloo.
// The parent re-executes this test binary once per rank, filtered to the current test, with the torchrun
// environment (RANK, WORLD_SIZE, MASTER_PORT=<free port>, ...). Each child calls bmt::init_distributed(options),
// runs `body`, finalizes and exits; gtest failures or exceptions make it exit non-zero. The parent waits (bounded),
// kills the others when one fails, and reports every failed rank with the tail of its output.
// A child whose test ends without reaching its run_ranks body (a condition that differs between the parent and the
// child, an early return) exits non-zero: otherwise it would pass without running anything.
// The rendezvous port stays reserved (bound, not listening) by the parent for the whole run, so parallel test jobs
// cannot be handed the same port between the pick and rank 0's bind.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "bmt/runtime/init.h"

namespace bmt::testing {

struct RankRunOptions {
  std::chrono::seconds wall_timeout{240};  // the whole run, in the parent
  bool kill_on_first_failure = true;
  bool expect_failure = false;  // fault tests: the parent returns the report instead of failing the test
};

struct RankRunReport {
  bool all_ok = true;
  std::string summary;  // one line per failed rank with its exit status and the tail of its output
};

// Gloo, quiet, 60 s timeout: the defaults of multi-rank tests.
bmt::InitOptions test_init();

// Returns (in the parent) a report; failures are reported with ADD_FAILURE unless expect_failure.
RankRunReport run_ranks(int world_size, const std::function<void()>& body, bmt::InitOptions init = test_init(),
                        RankRunOptions run = {});

// True inside a rank process started by run_ranks.
bool in_rank_process();

// A port bound (SO_REUSEADDR, not listening) for the lifetime of this object: the kernel hands it to no other
// bind(0) or outgoing connection meanwhile, while a child's TCPStore (which sets SO_REUSEADDR and listens) can
// still bind it.
class PortReservation {
 public:
  PortReservation();
  ~PortReservation();
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A folder private to the current run_ranks call, the same on every rank of it (created by the parent, removed
// with the logs when the run succeeds). Only valid inside a rank process.
std::string run_dir();

}  // namespace bmt::testing
