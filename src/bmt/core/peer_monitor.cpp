#include "bmt/core/peer_monitor.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "bmt/core/error.h"

namespace bmt::core {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string fixed1(double v) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << v;
  return os.str();
}

// Who a rank is, enough for a peer on the same host to find its process: "host pidns pid starttime".
struct Identity {
  std::string host, pid_ns;
  long pid = 0;
  unsigned long long start_ticks = 0;
};

enum class ProcState { kRunning, kStopped, kGone };

// State letter and start time (field 22, clock ticks since boot) of /proc/<pid>/stat; false if unreadable.
bool read_proc_stat(long pid, char* state, unsigned long long* start_ticks) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!in || !std::getline(in, line)) return false;
  size_t close = line.rfind(')');  // the command name may contain spaces and parentheses
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  rest >> field;
  *state = field.empty() ? '?' : field[0];
  for (int i = 4; i <= 22 && rest >> field; ++i)
    if (i == 22) *start_ticks = std::stoull(field);
  return true;
}

Identity self_identity() {
  Identity id;
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) == 0) id.host = host;
  char ns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  id.pid_ns = n > 0 ? std::string(ns, static_cast<size_t>(n)) : "unknown";
  id.pid = static_cast<long>(getpid());
  char state = 0;
  read_proc_stat(id.pid, &state, &id.start_ticks);
  return id;
}

std::string encode(const Identity& id) {
  return concat(id.host, " ", id.pid_ns, " ", id.pid, " ", id.start_ticks);
}

Identity decode(const std::string& s) {
  Identity id;
  std::istringstream in(s);
  in >> id.host >> id.pid_ns >> id.pid >> id.start_ticks;
  return id;
}

ProcState proc_state(const Identity& id) {
  char state = 0;
  unsigned long long start = 0;
  if (!read_proc_stat(id.pid, &state, &start)) return ProcState::kGone;
  if (start != id.start_ticks) return ProcState::kGone;  // the pid was reused by another process
  if (state == 'Z' || state == 'X') return ProcState::kGone;  // killed, not yet reaped by its parent
  if (state == 'T' || state == 't') return ProcState::kStopped;
  return ProcState::kRunning;
}

std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string text(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

}  // namespace

struct PeerMonitor::State {
  std::shared_ptr<Store> store;
  std::string prefix;
  int rank = 0;
  int world = 1;
  PeerMonitorOptions options;

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool exited = false;
  std::string verdict;
  int dead_rank = -1;
  Clock::time_point last_store_ok = Clock::now();
  std::string last_store_error;
  // The store host's process when it runs on this host (found by the thread). verdict() looks it up too, so that a
  // store operation blocked on the dead host does not delay the verdict.
  bool store_host_known = false;
  Identity store_host;
  std::thread thread;

  std::string key(const char* what, int r) const { return concat(prefix, "/", what, "/", r); }
  std::string key(const char* what) const { return concat(prefix, "/", what); }
  void set_verdict(int r, const std::string& v) {
    std::lock_guard<std::mutex> lock(mu);
    if (!verdict.empty()) return;
    verdict = v;
    dead_rank = r;
  }
  bool has_verdict() const {
    std::lock_guard<std::mutex> lock(mu);
    return !verdict.empty();
  }
  // Sets the verdict when the store host's process on this host is gone while the store fails or hangs (a store
  // host that finished cleanly is gone too, but then nothing here is still waiting on the store).
  void check_store_host() {
    Identity id;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!store_host_known || !verdict.empty()) return;
      const bool store_trouble = !last_store_error.empty() ||
                                 seconds_since(last_store_ok) * 1000.0 > 2.0 * static_cast<double>(options.interval_ms);
      if (!store_trouble) return;
      id = store_host;
    }
    if (proc_state(id) != ProcState::kGone) return;
    set_verdict(options.store_host_rank, concat("rank ", options.store_host_rank, " is dead: its process (pid ", id.pid,
                                                " on this host) is gone (killed or crashed); it hosted the rendezvous "
                                                "store (seen by rank ", rank, ")"));
  }
};

namespace {

// The watch over one neighbour; moves on to the next rank when the neighbour leaves cleanly.
struct Watch {
  int peer = -1;
  int64_t last_beat = -1;
  Clock::time_point last_change = Clock::now();
  bool have_identity = false;
  bool same_host = false;
  Identity identity;
};

// Takes the verdict another rank published, if any; true when there is one.
bool adopt_published_verdict(PeerMonitor::State& s) {
  if (s.has_verdict()) return true;
  if (s.store->add(s.key("verdicts"), 0) == 0) return false;
  std::string v = text(s.store->get(s.key("verdict")));
  size_t nl = v.find('\n');
  s.set_verdict(std::atoi(v.substr(0, nl).c_str()), v.substr(nl + 1));
  return true;
}

void run(const std::shared_ptr<PeerMonitor::State>& s) {
  const Identity me = self_identity();
  Watch w;
  w.peer = s->world > 1 ? (s->rank + 1) % s->world : -1;
  // The store host's identity (it publishes it before its first beat).
  const int host_rank = s->options.store_host_rank != s->rank ? s->options.store_host_rank : -1;
  bool host_read = false;
  bool announced = false;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(s->mu);
      if (announced) s->cv.wait_for(lock, std::chrono::milliseconds(s->options.interval_ms), [&] { return s->stop; });
      if (s->stop) break;
    }
    try {
      if (!announced) {
        s->store->set(s->key("id", s->rank), bytes(encode(me)));  // before the first beat: peers read it after
        announced = true;
      }
      s->store->add(s->key("beat", s->rank), 1);
      // A blocking get: the host publishes its identity first thing, so this waits only until its thread ran once
      // (and a host killed early must still be recognised).
      if (host_rank >= 0 && !host_read) {
        const Identity id = decode(text(s->store->get(s->key("id", host_rank))));
        host_read = true;
        std::lock_guard<std::mutex> lock(s->mu);
        s->store_host = id;
        s->store_host_known = id.host == me.host && id.pid_ns == me.pid_ns;  // /proc tells only on this host
      }
      // Another rank's verdict first: a rank that exits because of it must not be reported as the dead one.
      adopt_published_verdict(*s);
      if (w.peer >= 0 && !s->has_verdict()) {
        if (s->store->add(s->key("bye", w.peer), 0) > 0) {
          const int next = (w.peer + 1) % s->world;
          w = Watch{};
          w.peer = next == s->rank ? -1 : next;
        }
      }
      if (w.peer >= 0 && !s->has_verdict()) {
        int64_t beat = s->store->add(s->key("beat", w.peer), 0);
        if (beat != w.last_beat) {
          w.last_beat = beat;
          w.last_change = Clock::now();
        }
        if (!w.have_identity && beat > 0) {
          w.identity = decode(text(s->store->get(s->key("id", w.peer))));
          w.same_host = w.identity.host == me.host && w.identity.pid_ns == me.pid_ns;
          w.have_identity = true;
        }
        ProcState ps = w.same_host ? proc_state(w.identity) : ProcState::kRunning;
        const double silent_s = seconds_since(w.last_change);
        std::string why;
        if (ps == ProcState::kGone) {
          why = concat("its process (pid ", w.identity.pid, " on this host) is gone (killed or crashed)");
        } else if (silent_s * 1000.0 > static_cast<double>(s->options.stale_ms)) {
          why = concat("it sent no heartbeat for ", fixed1(silent_s), " s");
          why += ps == ProcState::kStopped
                     ? concat(" and its process (pid ", w.identity.pid, " on this host) is stopped (SIGSTOP or a "
                              "debugger)")
                     : " (killed, stopped or hung, or its host is unreachable)";
        }
        if (!why.empty() && s->store->add(s->key("bye", w.peer), 0) > 0) {
          why.clear();  // it said goodbye between our reads and then exited: a clean exit, not a death
          w.last_change = Clock::now();
        }
        if (!why.empty() && adopt_published_verdict(*s)) why.clear();
        if (!why.empty()) {
          std::string v = concat("rank ", w.peer, " is dead: ", why, " (seen by rank ", s->rank, ")");
          s->store->set(s->key("verdict"), bytes(concat(w.peer, "\n", v)));
          s->store->add(s->key("verdicts"), 1);
          s->set_verdict(w.peer, v);
        }
      }
      std::lock_guard<std::mutex> lock(s->mu);
      s->last_store_ok = Clock::now();
      s->last_store_error.clear();
    } catch (const std::exception& e) {
      // The store is unreachable: no verdict can be published or read. When its host's process on this host is
      // gone, that is the death to report (this rank's own verdict; every rank finds the same).
      s->check_store_host();
      std::lock_guard<std::mutex> lock(s->mu);
      s->last_store_error = e.what();
    }
  }
  try {
    if (announced) s->store->set(s->key("bye", s->rank), bytes("1"));  // a clean exit: peers stop watching us
  } catch (...) {
  }
  std::lock_guard<std::mutex> lock(s->mu);
  s->exited = true;
  s->cv.notify_all();
}

}  // namespace

PeerMonitor::PeerMonitor(std::shared_ptr<Store> store, std::string prefix, int rank, int world_size,
                         PeerMonitorOptions options)
    : state_(std::make_shared<State>()) {
  BMT_CHECK(store != nullptr, "PeerMonitor needs a store");
  BMT_CHECK(rank >= 0 && rank < world_size, "PeerMonitor: rank ", rank, " out of range for world size ", world_size);
  BMT_CHECK(options.interval_ms > 0 && options.stale_ms > options.interval_ms, "PeerMonitor: interval_ms (",
            options.interval_ms, ") must be positive and below stale_ms (", options.stale_ms, ")");
  state_->store = std::move(store);
  state_->prefix = std::move(prefix);
  state_->rank = rank;
  state_->world = world_size;
  state_->options = options;
  state_->thread = std::thread(run, state_);
}

PeerMonitor::~PeerMonitor() {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->stop = true;
  state_->cv.notify_all();
  // A store op to a dead store host can block for the store's timeout: do not wait for it at shutdown.
  bool exited = state_->cv.wait_for(lock, std::chrono::milliseconds(2 * state_->options.interval_ms + 1000),
                                    [&] { return state_->exited; });
  lock.unlock();
  if (exited) state_->thread.join();
  else state_->thread.detach();  // it holds its own reference to the state
}

int PeerMonitor::rank() const { return state_->rank; }
int PeerMonitor::world_size() const { return state_->world; }
const PeerMonitorOptions& PeerMonitor::options() const { return state_->options; }

std::string PeerMonitor::verdict() const {
  state_->check_store_host();
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->verdict.empty()) return state_->verdict;
  const double silent_s = seconds_since(state_->last_store_ok);
  if (silent_s * 1000.0 > static_cast<double>(state_->options.stale_ms))
    return concat(state_->options.store_host_rank >= 0
                      ? concat("rank ", state_->options.store_host_rank, " is probably dead: ")
                      : std::string(),
                  "the rendezvous store did not answer for ", fixed1(silent_s), " s (",
                  state_->last_store_error.empty() ? "no reply" : state_->last_store_error, "): the process hosting it (",
                  state_->options.store_host_rank >= 0 ? concat("rank ", state_->options.store_host_rank)
                                                       : std::string("the launcher's agent"),
                  ") died, stopped or became unreachable");
  return "";
}

std::string PeerMonitor::wait_for_verdict(int64_t wait_ms) const {
  auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  while (true) {
    std::string v = verdict();
    if (!v.empty() || Clock::now() >= deadline) return v;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int PeerMonitor::dead_rank() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->dead_rank;
}

std::string peer_verdict_suffix(const PeerMonitor* monitor, int64_t wait_ms) {
  if (!monitor) return "";
  std::string v = monitor->wait_for_verdict(wait_ms);
  return v.empty() ? "" : concat(" [", v, "]");
}

}  // namespace bmt::core
