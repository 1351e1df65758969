#include "bmt/core/nccl_watchdog.h"

#include <sstream>

#include "bmt/core/error.h"

namespace bmt::core {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(100);

std::string age(Clock::time_point t) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << std::chrono::duration<double>(Clock::now() - t).count() << " s";
  return os.str();
}

}  // namespace

void NcclCommState::abort_locked(const std::string& why) {
  if (aborted) return;
  aborted = true;
  abort_reason = why;
  if (comm) ncclCommAbort(comm);  // NCCL's kernels see the abort flag and return: blocked syncs wake up
}

std::string NcclCommState::where() const {
  return concat("on communicator '", name, "' (rank ", rank, " of ", size, ")");
}

NcclWatchdog::NcclWatchdog(std::shared_ptr<NcclCommState> state, int device)
    : state_(std::move(state)), device_(device) {
  thread_ = std::thread([this] { loop(); });
}

NcclWatchdog::~NcclWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (auto& f : in_flight_) cudaEventDestroy(f.done);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
}

void NcclWatchdog::track(const char* op, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return;
  std::lock_guard<std::mutex> lock(mu_);
  cudaEvent_t ev = nullptr;
  if (!free_events_.empty()) {
    ev = free_events_.back();
    free_events_.pop_back();
  } else if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    return;  // untracked: the peer monitor and the async error still cover this operation
  }
  if (cudaEventRecord(ev, stream) != cudaSuccess) {
    free_events_.push_back(ev);
    return;
  }
  in_flight_.push_back({op, ev, Clock::now()});
}

std::string NcclWatchdog::oldest_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_flight_.empty()) return "";
  return concat(in_flight_.front().op, " enqueued ", age(in_flight_.front().enqueued), " ago");
}

std::string NcclWatchdog::check_in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!in_flight_.empty()) {
    cudaError_t q = cudaEventQuery(in_flight_.front().done);
    if (q == cudaErrorNotReady) break;
    if (q != cudaSuccess) {
      (void)cudaGetLastError();  // a sticky error shows up everywhere anyway; the operation is not ours to time
    }
    free_events_.push_back(in_flight_.front().done);
    in_flight_.pop_front();
  }
  if (in_flight_.empty()) return "";
  const InFlight& f = in_flight_.front();
  if (Clock::now() - f.enqueued <= std::chrono::milliseconds(state_->timeout_ms)) return "";
  return concat(f.op, " enqueued ", age(f.enqueued), " ago did not complete within the timeout (",
                state_->timeout_ms, " ms; BMT_TIMEOUT_S)");
}

void NcclWatchdog::loop() {
  cudaSetDevice(device_);
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kPoll, [this] { return stop_; });
      if (stop_) return;
    }
    std::string why;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->aborted) continue;  // nothing left to watch; wait for the stop
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(state_->comm, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        why = concat("NCCL reported ", ncclGetErrorString(async), " (", ncclGetLastError(state_->comm), ")");
    }
    std::shared_ptr<PeerMonitor> monitor;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      monitor = state_->monitor;
    }
    // A world of one has no peer to wait for: only its own async errors matter.
    if (why.empty() && state_->size > 1) why = check_in_flight();
    if (why.empty() && state_->size > 1 && monitor) why = monitor->verdict();
    if (why.empty()) continue;
    // Name the dead rank where the heartbeat can tell (a timeout or a network error usually comes first).
    if (monitor && monitor->verdict().empty()) why += peer_verdict_suffix(monitor.get(),
                                                                          3 * monitor->options().interval_ms + 500);
    std::string pending = oldest_pending();
    if (!pending.empty() && why.find(pending.substr(0, pending.find(' '))) == std::string::npos)
      why += concat("; ", pending, " had not completed");
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->abort_locked(concat("the watchdog aborted it: ", why));
  }
}

}  // namespace bmt::core
