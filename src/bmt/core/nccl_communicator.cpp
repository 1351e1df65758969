#include "bmt/core/nccl_communicator_internal.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace bmt::core {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t to_nccl(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt64: return ncclInt64;
    case DType::kInt32: return ncclInt32;
    case DType::kUInt8: return ncclUint8;
    case DType::kFloat64: return ncclFloat64;
  }
  BMT_ASSERT(false, "unmapped dtype");
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kProd: return ncclProd;
  }
  BMT_ASSERT(false, "unmapped reduce op");
}

cudaStream_t as_stream(StreamHandle s) { return static_cast<cudaStream_t>(s); }

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// Polls a freshly created non-blocking communicator until its initialisation finished.
void wait_comm_ready(ncclComm_t comm, int64_t timeout_ms, const std::string& what) {
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm, &state);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      ncclCommAbort(comm);
      throw DistError(concat(what, " failed: ", ncclGetErrorString(state), " (", ncclGetLastError(comm), ")"));
    }
    if (Clock::now() > deadline) {
      ncclCommAbort(comm);
      throw DistError(concat(what, " timed out after ", timeout_ms,
                             " ms: some rank did not join (did every rank start? check the launcher's output)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(Store& store, const std::string& store_key, int rank,
                                                           int size, int64_t timeout_ms, const std::string& name) {
  BMT_CHECK(size >= 1 && rank >= 0 && rank < size, "NCCL communicator '", name, "': rank ", rank,
            " is out of range for size ", size);
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) throw DistError(concat("ncclGetUniqueId for '", name, "' failed: ", ncclGetErrorString(r)));
    std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id));
    store.set(store_key, bytes);
  } else {
    std::vector<uint8_t> bytes = store.get(store_key);
    BMT_CHECK(bytes.size() == sizeof(id), "NCCL unique id under key '", store_key, "' has ", bytes.size(),
              " bytes, expected ", sizeof(id), " (a different NCCL version on another rank?)");
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclComm_t comm = nullptr;
  ncclConfig_t config = nonblocking_config();
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    throw DistError(concat("ncclCommInitRankConfig for '", name, "' (rank ", rank, " of ", size,
                           ") failed: ", ncclGetErrorString(r)));
  wait_comm_ready(comm, timeout_ms, concat("NCCL init of communicator '", name, "' on rank ", rank, " of ", size));
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(comm, rank, size, timeout_ms, name, nullptr));
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int rank, int size, int64_t timeout_ms, std::string name,
                                   std::shared_ptr<PeerMonitor> monitor)
    : state_(std::make_shared<NcclCommState>()), rank_(rank), size_(size), timeout_ms_(timeout_ms), name_(name) {
  state_->comm = comm;
  state_->name = std::move(name);
  state_->rank = rank;
  state_->size = size;
  state_->timeout_ms = timeout_ms;
  state_->monitor = monitor;
  peer_monitor_ = std::move(monitor);
  int device = 0;
  cudaGetDevice(&device);
  watchdog_ = std::make_unique<NcclWatchdog>(state_, device);
}

NcclCommunicator::~NcclCommunicator() {
  watchdog_.reset();  // joins: no abort can race with the teardown below
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->comm || state_->aborted) return;
  // A dead peer would make the finalize wait for the whole timeout: abort at once.
  if (state_->monitor && !state_->monitor->verdict().empty()) {
    ncclCommAbort(state_->comm);
    return;
  }
  // Finalize flushes outstanding work; bounded so a dead peer cannot hang shutdown, abort otherwise.
  ncclComm_t comm = state_->comm;
  ncclResult_t r = ncclCommFinalize(comm);
  if (r == ncclSuccess || r == ncclInProgress) {
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
    ncclResult_t st = ncclInProgress;
    while (Clock::now() < deadline) {
      ncclCommGetAsyncError(comm, &st);
      if (st != ncclInProgress) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (st == ncclSuccess) {
      ncclCommDestroy(comm);
      return;
    }
  }
  ncclCommAbort(comm);
}

void NcclCommunicator::set_peer_monitor(std::shared_ptr<PeerMonitor> monitor) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->monitor = monitor;
  peer_monitor_ = std::move(monitor);
}

ncclComm_t NcclCommunicator::raw() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->aborted ? nullptr : state_->comm;
}

bool NcclCommunicator::aborted() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->aborted;
}

void NcclCommunicator::fail(const char* op, const std::string& why) {
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->abort_locked(why);  // keeps the first reason when the watchdog was faster
    reason = state_->abort_reason;
  }
  // Name the dead rank when the heartbeat can tell and the reason does not already.
  std::string dead;
  if (peer_monitor_ && reason.find(" is dead: ") == std::string::npos) dead = dead_peer_suffix();
  throw DistError(concat("NCCL ", op, " ", state_->where(), " failed: ", reason, dead,
                         ". The communicator was aborted: every later call on it fails (a peer rank probably "
                         "died or hung; see also the launcher's report)."));
}

void NcclCommunicator::throw_if_aborted(const char* op) {
  bool aborted = false;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    aborted = state_->aborted;
  }
  if (aborted) fail(op, "");
}

void NcclCommunicator::wait_enqueued(const char* op, ncclResult_t launched) {
  if (launched == ncclSuccess) return;
  if (launched != ncclInProgress) fail(op, ncclGetErrorString(launched));
  if (group_depth_ > 0) return;  // inside a group the launch happens at group_end
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (true) {
    ncclResult_t state = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->aborted) state = ncclInternalError;
      else ncclCommGetAsyncError(state_->comm, &state);
    }
    throw_if_aborted(op);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail(op, ncclGetErrorString(state));
    if (Clock::now() > deadline) fail(op, concat("enqueue timed out after ", timeout_ms_, " ms"));
    std::this_thread::yield();
  }
}

template <typename Launch>
void NcclCommunicator::enqueue(const char* op, StreamHandle stream, Launch&& launch) {
  ncclResult_t r = ncclSuccess;
  bool aborted = false;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    aborted = state_->aborted;
    if (!aborted) r = launch(state_->comm);
  }
  if (aborted) throw_if_aborted(op);
  wait_enqueued(op, r);
  if (group_depth_ > 0) group_ops_.emplace_back(op, stream);
  else watchdog_->track(op, as_stream(stream));
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t send_numel, DType dtype, StreamHandle stream) {
  enqueue("all_gather", stream, [&](ncclComm_t c) {
    return ncclAllGather(send, recv, send_numel, to_nccl(dtype), c, as_stream(stream));
  });
}

void NcclCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_numel, DType dtype, ReduceOp op,
                                      StreamHandle stream) {
  enqueue("reduce_scatter", stream, [&](ncclComm_t c) {
    return ncclReduceScatter(send, recv, recv_numel, to_nccl(dtype), to_nccl(op), c, as_stream(stream));
  });
}

void NcclCommunicator::all_reduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                  StreamHandle stream) {
  enqueue("all_reduce", stream, [&](ncclComm_t c) {
    return ncclAllReduce(send, recv, numel, to_nccl(dtype), to_nccl(op), c, as_stream(stream));
  });
}

void NcclCommunicator::broadcast(const void* send, void* recv, size_t numel, DType dtype, int root,
                                 StreamHandle stream) {
  check_root("broadcast", root);
  enqueue("broadcast", stream, [&](ncclComm_t c) {
    return ncclBroadcast(send, recv, numel, to_nccl(dtype), root, c, as_stream(stream));
  });
}

void NcclCommunicator::send(const void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) {
  check_peer("send", peer);
  enqueue("send", stream, [&](ncclComm_t c) { return ncclSend(buf, numel, to_nccl(dtype), peer, c, as_stream(stream)); });
}

void NcclCommunicator::recv(void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) {
  check_peer("recv", peer);
  enqueue("recv", stream, [&](ncclComm_t c) { return ncclRecv(buf, numel, to_nccl(dtype), peer, c, as_stream(stream)); });
}

void NcclCommunicator::group_start() {
  throw_if_aborted("group_start");
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) fail("group_start", ncclGetErrorString(r));
  ++group_depth_;
}

void NcclCommunicator::group_end() {
  BMT_ASSERT(group_depth_ > 0, "group_end without group_start on '", name_, "'");
  --group_depth_;
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(state_->mu);  // the launch touches the communicator: no abort meanwhile
    r = ncclGroupEnd();
  }
  wait_enqueued("group_end", r);
  if (group_depth_ > 0) return;
  for (const auto& [op, stream] : group_ops_) watchdog_->track(op, as_stream(stream));
  group_ops_.clear();
}

void NcclCommunicator::synchronize(StreamHandle stream) {
  // A polling wait: a host blocked in cudaStreamSynchronize could not notice an abort or raise the error.
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (true) {
    check_async_error();
    cudaError_t q = cudaStreamQuery(as_stream(stream));
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) fail("synchronize", concat("CUDA error ", cudaGetErrorString(q)));
    if (Clock::now() > deadline) {
      std::string pending = watchdog_->oldest_pending();
      fail("synchronize", concat("work on the stream did not finish within ", timeout_ms_, " ms",
                                 pending.empty() ? "" : concat(" (", pending, ")")));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  check_async_error();
}

void NcclCommunicator::check_async_error() {
  throw_if_aborted("check_async_error");
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclSuccess;
  std::string last;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->aborted) {
      r = ncclInternalError;
    } else {
      r = ncclCommGetAsyncError(state_->comm, &state);
      if (state != ncclSuccess && state != ncclInProgress) last = ncclGetLastError(state_->comm);
    }
  }
  throw_if_aborted("check_async_error");
  if (r != ncclSuccess) fail("check_async_error", ncclGetErrorString(r));
  if (state != ncclSuccess && state != ncclInProgress)
    fail("asynchronous operation", concat(ncclGetErrorString(state), " (", last, ")"));
}

void NcclCommunicator::barrier() {
  // A one-element all-reduce on a private stream, waited for with the timeout.
  cudaStream_t stream = nullptr;
  float* scratch = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
      cudaMalloc(&scratch, sizeof(float)) != cudaSuccess)
    fail("barrier", "could not allocate its stream or scratch buffer");
  try {
    all_reduce(scratch, scratch, 1, DType::kFloat32, ReduceOp::kSum, stream);
    synchronize(stream);
  } catch (...) {
    cudaFree(scratch);
    cudaStreamDestroy(stream);
    throw;
  }
  cudaFree(scratch);
  cudaStreamDestroy(stream);
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name) {
  throw_if_aborted("split");
  BMT_CHECK(color >= 0, "split of NCCL communicator '", name_, "' into '", name, "' (rank ", rank_, " of ", size_,
            "): color ", color, " must be >= 0");
  ncclComm_t child = nullptr;
  ncclConfig_t config = nonblocking_config();
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    r = ncclCommSplit(state_->comm, color, key, &child, &config);
  }
  if (r != ncclSuccess && r != ncclInProgress) fail("split", ncclGetErrorString(r));
  // Wait for the parent through fail(), not wait_comm_ready(): the parent is owned by this object, and an abort
  // must mark it aborted (the destructor would otherwise finalize an aborted communicator).
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (true) {
    ncclResult_t state = ncclSuccess;
    bool aborted = false;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      aborted = state_->aborted;
      if (!aborted) ncclCommGetAsyncError(state_->comm, &state);
    }
    if (aborted && child) ncclCommAbort(child);
    throw_if_aborted("split");
    if (state == ncclSuccess) break;
    if (state != ncclInProgress || Clock::now() > deadline) {
      if (child) ncclCommAbort(child);
      fail("split", state != ncclInProgress
                        ? concat(ncclGetErrorString(state), " while splitting into '", name, "'")
                        : concat("splitting into '", name, "' timed out after ", timeout_ms_,
                                 " ms: some rank did not join"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  BMT_ASSERT(child != nullptr, "ncclCommSplit returned no communicator for color ", color);
  wait_comm_ready(child, timeout_ms_, concat("NCCL init of split communicator '", name, "'"));
  int child_rank = 0, child_size = 0;
  ncclCommUserRank(child, &child_rank);
  ncclCommCount(child, &child_size);
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(child, child_rank, child_size, timeout_ms_, name, peer_monitor_));
}

}  // namespace bmt::core
