#include "bmt/runtime/torch_store_internal.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/util/Logging.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <thread>

#include "bmt/core/error.h"

namespace bmt {
namespace {

// c10::Error::what() carries a C++ backtrace of dozens of lines; our messages keep only its text.
std::string describe(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// torch's TCPStore client logs every failed operation as a warning carrying a C++ backtrace ("[c10d] recvValue
// failed ... Exception raised from recvBytes ... frame #0 ..."): a dead store host made the heartbeat print 4-5 of
// them. While a holder lives, c10's logging is raised to FATAL; the holders share one saved level, so overlapping
// holders on several threads restore it exactly once. Our errors report those failures in one line instead.
class QuietC10Logs {
 public:
  QuietC10Logs() {
    std::lock_guard<std::mutex> lock(mu());
    if (holders()++ == 0) {
      saved() = FLAGS_caffe2_log_level;
      FLAGS_caffe2_log_level = 3;  // fatal only
    }
  }
  ~QuietC10Logs() {
    std::lock_guard<std::mutex> lock(mu());
    if (--holders() == 0) FLAGS_caffe2_log_level = saved();
  }
  QuietC10Logs(const QuietC10Logs&) = delete;
  QuietC10Logs& operator=(const QuietC10Logs&) = delete;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static int& holders() {
    static int n = 0;
    return n;
  }
  static int& saved() {
    static int level = 0;
    return level;
  }
};

}  // namespace

// The store's own errors (its host died: "Broken pipe", "Connection reset") as one DistError line without torch's
// backtrace, naming the operation.
void TorchStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::optional<QuietC10Logs> quiet;
  if (quiet_) quiet.emplace();
  try {
    store_->set(key, value);
  } catch (const std::exception& e) {
    throw core::DistError(core::concat("rendezvous store: setting key '", key, "' failed: ", describe(e)));
  }
}

std::vector<uint8_t> TorchStore::get(const std::string& key) {
  std::optional<QuietC10Logs> quiet;
  if (quiet_) quiet.emplace();
  try {
    return store_->get(key);
  } catch (const std::exception& e) {
    throw core::DistError(core::concat("rendezvous store: waiting for key '", key, "' failed: ", describe(e),
                                       " (a rank did not start or died before publishing it)"));
  }
}

int64_t TorchStore::add(const std::string& key, int64_t delta) {
  std::optional<QuietC10Logs> quiet;
  if (quiet_) quiet.emplace();
  try {
    return store_->add(key, delta);
  } catch (const std::exception& e) {
    throw core::DistError(core::concat("rendezvous store: adding to key '", key, "' failed: ", describe(e)));
  }
}

c10::intrusive_ptr<c10d::Store> connect_tcp_store(const std::string& host, int port, int rank, int world_size,
                                                  bool use_agent_store, int restart_count,
                                                  std::chrono::milliseconds timeout, bool client_only) {
  BMT_CHECK(port > 0 && port < 65536, "MASTER_PORT ", port, " is not a valid TCP port (1..65535)");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = !client_only && !use_agent_store && rank == 0;
  opts.numWorkers = world_size;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  auto fail = [&](const std::string& why) {
    return core::DistError(core::concat("rank ", rank, ": cannot ", opts.isServer ? "host" : "reach",
                                        " the rendezvous store at ", host, ":", port, " within ", timeout.count(),
                                        " ms: ", why, ". Check MASTER_ADDR/MASTER_PORT and that rank 0 is up",
                                        opts.isServer ? " (is the port already in use?)" : ""));
  };
  if (opts.isServer) {
    try {
      store = c10::make_intrusive<c10d::TCPStore>(host, opts);
    } catch (const std::exception& e) {
      throw fail(describe(e));
    }
  } else {
    // torch's client retries internally and can wait about twice its timeout, logging every failed attempt with
    // a C++ backtrace: connect in short attempts up to one `timeout` overall, with torch's logging muted, then
    // give the store the real timeout for its later waits.
    std::optional<QuietC10Logs> quiet(std::in_place);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string last_error = "no attempt was made";
    while (!store) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      opts.timeout = std::min(left, std::chrono::milliseconds(300));  // torch may take ~3x this per attempt
      try {
        store = c10::make_intrusive<c10d::TCPStore>(host, opts);
      } catch (const std::exception& e) {
        last_error = describe(e);
        while (!last_error.empty() && (last_error.back() == '.' || last_error.back() == '\n')) last_error.pop_back();
        std::this_thread::sleep_for(std::min(std::chrono::milliseconds(100), left));
      }
    }
    quiet.reset();
    if (!store) throw fail("nothing answered (last attempt: " + last_error + ")");
    store->setTimeout(timeout);
  }
  if (use_agent_store)
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(restart_count), store);
  return store;
}

}  // namespace bmt
