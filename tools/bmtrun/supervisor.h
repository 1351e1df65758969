// The supervisor: one poll() loop that relays the ranks' output, reaps them, and stops the job when a rank
// fails, bmtrun receives SIGINT/SIGTERM, or the --timeout-s limit passes (SIGTERM, then SIGKILL after a grace).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "bmtrun/child.h"
#include "bmtrun/output.h"

namespace bmtrun {

struct SupervisorOptions {
  bool rank0_only = false;
  double timeout_s = 0;  // 0: no limit
  std::chrono::milliseconds failure_grace{5000};  // SIGTERM -> SIGKILL after a rank failed or a timeout
  std::chrono::milliseconds signal_grace{10000};  // forwarded SIGINT/SIGTERM -> SIGKILL
};

class Supervisor {
 public:
  explicit Supervisor(SupervisorOptions options);

  void add(Child child);
  // Runs until every rank has ended; returns bmtrun's exit code.
  int run();
  // Kills and reaps what was started (used when a later rank could not be spawned).
  void kill_all_now();

 private:
  using Clock = std::chrono::steady_clock;
  struct Rank {
    Child child;
    std::unique_ptr<LineStream> out, err;
  };

  void poll_once();
  void read_from(int& fd, LineStream& stream);
  void reap();
  void on_exit(Rank& r);
  void begin_stop(int sig, std::chrono::milliseconds grace, int exit_code);
  void send_all(int sig);
  int running_count() const;
  void print_hidden_tails() const;

  SupervisorOptions options_;
  std::vector<Rank> ranks_;
  Clock::time_point started_ = Clock::now();
  bool stopping_ = false;
  bool killed_ = false;
  Clock::time_point kill_at_{};
  int exit_code_ = 0;
  std::vector<int> failed_ranks_;  // ranks that failed on their own, in order
};

}  // namespace bmtrun
