// TorchStore: core::Store over c10d's Store (TCPStore for rendezvous, PrefixStore for namespacing).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "bmt/core/store.h"

namespace bmt {

class TorchStore final : public core::Store {
 public:
  // quiet: torch's logging is muted during this connection's operations (the heartbeat's: a dead store host makes
  // every operation fail, and torch logs each failure with a C++ backtrace; the monitor reports it in one line).
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store, bool quiet = false)
      : store_(std::move(store)), quiet_(quiet) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  const c10::intrusive_ptr<c10d::Store>& c10d_store() const { return store_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  bool quiet_ = false;
};

// Connects to (or, when is_server, hosts) the rendezvous TCPStore at host:port.
// With use_agent_store (torchrun's TORCHELASTIC_USE_AGENT_STORE) every rank is a client of the agent's store,
// under torchrun's "/worker/attempt_<restart_count>" prefix. `client_only` makes a second connection to a store
// that is already up (the heartbeat's own, so that it never waits behind a blocking get of the main thread).
c10::intrusive_ptr<c10d::Store> connect_tcp_store(const std::string& host, int port, int rank, int world_size,
                                                  bool use_agent_store, int restart_count,
                                                  std::chrono::milliseconds timeout, bool client_only = false);

}  // namespace bmt
