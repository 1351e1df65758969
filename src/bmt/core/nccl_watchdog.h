// NcclWatchdog: one thread per NCCL communicator that turns a dead or stopped peer into an aborted communicator
// instead of a hang. Every poll (100 ms) it
//  - reads ncclCommGetAsyncError (a network error, a peer's socket closed),
//  - checks the operations in flight: each enqueued operation is followed by a CUDA event; an operation not
//    complete `timeout_ms` after it was enqueued has timed out,
//  - asks the job's PeerMonitor for a verdict (a rank whose heartbeat stopped or whose process is gone),
// and on any of them calls ncclCommAbort. The abort makes NCCL's kernels return, so a host blocked in a stream or
// event synchronise (ours, or torch's .item()/.cpu()) wakes up; the communicator then throws DistError with the
// recorded reason from its next call, naming the operation, the communicator and the dead rank.
// NcclCommState is what the communicator and its watchdog share; `mu` serialises NCCL calls against the abort.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bmt/core/peer_monitor.h"

namespace bmt::core {

struct NcclCommState {
  std::mutex mu;  // held around every use of `comm`
  ncclComm_t comm = nullptr;
  bool aborted = false;
  std::string abort_reason;  // why the communicator was aborted (kept for every later call)
  std::shared_ptr<PeerMonitor> monitor;
  std::string name;
  int rank = 0;
  int size = 1;
  int64_t timeout_ms = 0;

  // Caller holds mu. Aborts the communicator once and records why.
  void abort_locked(const std::string& why);
  // "on communicator 'world' (rank 0 of 2)".
  std::string where() const;
};

class NcclWatchdog {
 public:
  NcclWatchdog(std::shared_ptr<NcclCommState> state, int device);
  ~NcclWatchdog();  // stops and joins the thread, frees the events
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;

  // Call after `op` was enqueued on `stream` (not inside a group, not while the stream is being captured).
  void track(const char* op, cudaStream_t stream);
  // "all_gather enqueued 3.1 s ago", the oldest operation not known complete, or "" when none.
  std::string oldest_pending() const;

 private:
  struct InFlight {
    const char* op;
    cudaEvent_t done;
    std::chrono::steady_clock::time_point enqueued;
  };
  void loop();
  // Pops completed operations; returns why the oldest one is late, or "".
  std::string check_in_flight();

  std::shared_ptr<NcclCommState> state_;
  int device_;
  mutable std::mutex mu_;  // in_flight_, free_events_, stop_
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<InFlight> in_flight_;
  std::vector<cudaEvent_t> free_events_;
  std::thread thread_;
};

}  // namespace bmt::core
