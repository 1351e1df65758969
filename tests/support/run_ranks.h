// run_ranks: runs a test body on N real processes over real Gloo.
// The parent re-executes this test binary once per rank, filtered to the current test, with the torchrun
// environment (RANK, WORLD_SIZE, MASTER_PORT=<free port>, ...). Each child calls bmt::init_distributed(options),
// runs `body`, finalizes and exits; gtest failures or exceptions make it exit non-zero. The parent waits (bounded),
// kills the others when one fails, and reports every failed rank with the tail of its output.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "bmt/init.h"

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

// A TCP port that was free a moment ago on 127.0.0.1.
int free_port();

}  // namespace bmt::testing
