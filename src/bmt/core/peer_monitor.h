// PeerMonitor: tells every living rank which rank died or stopped, through the rendezvous store.
// Torch-free and NCCL-free. Each rank runs one thread that
//  - beats: increments its own counter key once per interval;
//  - watches one neighbour, rank (r + 1) % world: a counter that has not moved for `stale_ms` (the job's timeout)
//    means the neighbour is dead, stopped or hung; when the neighbour runs on this host (same hostname and pid
//    namespace) its process is also looked up in /proc, so a killed rank is seen within one interval;
//  - publishes a verdict naming the dead rank under one store key, which every rank polls (O(1) store operations
//    per rank and interval, whatever the world size).
// A rank that leaves cleanly (destructor) says so first and is never reported. The store itself going silent for
// `stale_ms` (the process hosting it died or stopped) is a verdict too; when a rank hosts the store
// (store_host_rank) and its process on this host is gone, the first failed store operation names it. Communicators use the verdict to abort
// (NCCL watchdog) and to name the dead rank in their DistError (NCCL and Gloo).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "bmt/core/store.h"

namespace bmt::core {

struct PeerMonitorOptions {
  int64_t interval_ms = 1000;  // heartbeat and polling period
  int64_t stale_ms = 600000;   // a neighbour silent this long is dead (init uses the job's timeout)
  // The rank whose process hosts the store (rank 0 without a launcher's agent store), -1 for none. When the store
  // stops answering, that rank is named: at once when its process on this host is gone, after stale_ms otherwise.
  int store_host_rank = -1;
};

class PeerMonitor {
 public:
  // `store` should be a connection of its own: a blocking get() of the main thread must not delay the beats.
  // Every rank of the world must construct one (after the world communicator is up).
  PeerMonitor(std::shared_ptr<Store> store, std::string prefix, int rank, int world_size, PeerMonitorOptions options);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  int rank() const;
  int world_size() const;
  const PeerMonitorOptions& options() const;
  // Empty while no rank is known dead; otherwise one sentence naming the dead rank and how it was seen, e.g.
  // "rank 1 is dead: its process (pid 4242 on this host) is gone (killed or crashed)". Cheap: no store access.
  std::string verdict() const;
  // verdict(), waiting up to wait_ms for one (errors of a collective often arrive before the heartbeat notices).
  std::string wait_for_verdict(int64_t wait_ms) const;
  // The dead rank of the verdict, -1 if none.
  int dead_rank() const;

  struct State;  // shared with the monitor's thread (opaque)

 private:
  std::shared_ptr<State> state_;
};

// " (rank R is dead: ...)" when `monitor` has a verdict within wait_ms, "" otherwise: appended to DistErrors.
std::string peer_verdict_suffix(const PeerMonitor* monitor, int64_t wait_ms);

}  // namespace bmt::core
