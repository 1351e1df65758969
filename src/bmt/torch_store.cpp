#include "bmt/torch_store_internal.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "bmt/core/error.h"

namespace bmt {
namespace {

// c10::Error::what() carries a C++ backtrace of dozens of lines; our messages keep only its text.
std::string describe(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace

void TorchStore::set(const std::string& key, const std::vector<uint8_t>& value) { store_->set(key, value); }

std::vector<uint8_t> TorchStore::get(const std::string& key) {
  try {
    return store_->get(key);
  } catch (const std::exception& e) {
    throw core::DistError(core::concat("rendezvous store: waiting for key '", key, "' failed: ", describe(e),
                                       " (a rank did not start or died before publishing it)"));
  }
}

int64_t TorchStore::add(const std::string& key, int64_t delta) { return store_->add(key, delta); }

c10::intrusive_ptr<c10d::Store> connect_tcp_store(const std::string& host, int port, int rank, int world_size,
                                                  bool use_agent_store, int restart_count,
                                                  std::chrono::milliseconds timeout) {
  BMT_CHECK(port > 0 && port < 65536, "MASTER_PORT ", port, " is not a valid TCP port (1..65535)");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = !use_agent_store && rank == 0;
  opts.numWorkers = world_size;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, opts);
  } catch (const std::exception& e) {
    throw core::DistError(core::concat("rank ", rank, ": cannot ", opts.isServer ? "host" : "reach",
                                       " the rendezvous store at ", host, ":", port, " within ", timeout.count(),
                                       " ms: ", describe(e), ". Check MASTER_ADDR/MASTER_PORT and that rank 0 is up",
                                       opts.isServer ? " (is the port already in use?)" : ""));
  }
  if (use_agent_store)
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(restart_count), store);
  return store;
}

}  // namespace bmt
