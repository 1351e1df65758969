#include "bmt/core/nccl_communicator_internal.h"

#include <cuda_runtime.h>

#include <chrono>
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
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(comm, rank, size, timeout_ms, name));
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int rank, int size, int64_t timeout_ms, std::string name)
    : comm_(comm), rank_(rank), size_(size), timeout_ms_(timeout_ms), name_(std::move(name)) {}

NcclCommunicator::~NcclCommunicator() {
  if (!comm_) return;
  if (aborted_) return;
  // Finalize flushes outstanding work; bounded so a dead peer cannot hang shutdown, abort otherwise.
  ncclResult_t r = ncclCommFinalize(comm_);
  if (r == ncclSuccess || r == ncclInProgress) {
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
    ncclResult_t state = ncclInProgress;
    while (Clock::now() < deadline) {
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclInProgress) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (state == ncclSuccess) {
      ncclCommDestroy(comm_);
      return;
    }
  }
  ncclCommAbort(comm_);
}

void NcclCommunicator::fail(const char* op, const std::string& why) {
  if (!aborted_) {
    ncclCommAbort(comm_);
    aborted_ = true;
  }
  throw DistError(concat("NCCL ", op, " on communicator '", name_, "' (rank ", rank_, " of ", size_, ") failed: ",
                         why, ". The communicator was aborted; a peer rank probably died or hung (see the "
                         "launcher's report for which rank)."));
}

void NcclCommunicator::wait_enqueued(const char* op, ncclResult_t launched) {
  if (aborted_) fail(op, "communicator already aborted by an earlier error");
  if (launched == ncclSuccess) return;
  if (launched != ncclInProgress) fail(op, ncclGetErrorString(launched));
  if (group_depth_ > 0) return;  // inside a group the launch happens at group_end
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail(op, ncclGetErrorString(state));
    if (Clock::now() > deadline) fail(op, concat("enqueue timed out after ", timeout_ms_, " ms"));
    std::this_thread::yield();
  }
}

void NcclCommunicator::all_gather(const void* send, void* recv, size_t send_numel, DType dtype, StreamHandle stream) {
  wait_enqueued("all_gather", ncclAllGather(send, recv, send_numel, to_nccl(dtype), comm_, as_stream(stream)));
}

void NcclCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_numel, DType dtype, ReduceOp op,
                                      StreamHandle stream) {
  wait_enqueued("reduce_scatter",
                ncclReduceScatter(send, recv, recv_numel, to_nccl(dtype), to_nccl(op), comm_, as_stream(stream)));
}

void NcclCommunicator::all_reduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                  StreamHandle stream) {
  wait_enqueued("all_reduce", ncclAllReduce(send, recv, numel, to_nccl(dtype), to_nccl(op), comm_, as_stream(stream)));
}

void NcclCommunicator::broadcast(const void* send, void* recv, size_t numel, DType dtype, int root,
                                 StreamHandle stream) {
  check_root("broadcast", root);
  wait_enqueued("broadcast", ncclBroadcast(send, recv, numel, to_nccl(dtype), root, comm_, as_stream(stream)));
}

void NcclCommunicator::send(const void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) {
  check_peer("send", peer);
  wait_enqueued("send", ncclSend(buf, numel, to_nccl(dtype), peer, comm_, as_stream(stream)));
}

void NcclCommunicator::recv(void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) {
  check_peer("recv", peer);
  wait_enqueued("recv", ncclRecv(buf, numel, to_nccl(dtype), peer, comm_, as_stream(stream)));
}

void NcclCommunicator::group_start() {
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) fail("group_start", ncclGetErrorString(r));
  ++group_depth_;
}

void NcclCommunicator::group_end() {
  BMT_ASSERT(group_depth_ > 0, "group_end without group_start on '", name_, "'");
  --group_depth_;
  wait_enqueued("group_end", ncclGroupEnd());
}

void NcclCommunicator::synchronize(StreamHandle stream) {
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (true) {
    cudaError_t q = cudaStreamQuery(as_stream(stream));
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) fail("synchronize", concat("CUDA error ", cudaGetErrorString(q)));
    check_async_error();
    if (Clock::now() > deadline)
      fail("synchronize", concat("work on the stream did not finish within ", timeout_ms_, " ms"));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  check_async_error();
}

void NcclCommunicator::check_async_error() {
  if (aborted_) fail("check_async_error", "communicator already aborted by an earlier error");
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) fail("check_async_error", ncclGetErrorString(r));
  if (state != ncclSuccess && state != ncclInProgress)
    fail("asynchronous operation", concat(ncclGetErrorString(state), " (", ncclGetLastError(comm_), ")"));
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
  if (aborted_) fail("split", "communicator already aborted by an earlier error");
  BMT_CHECK(color >= 0, "split of NCCL communicator '", name_, "' into '", name, "' (rank ", rank_, " of ", size_,
            "): color ", color, " must be >= 0");
  ncclComm_t child = nullptr;
  ncclConfig_t config = nonblocking_config();
  ncclResult_t r = ncclCommSplit(comm_, color, key, &child, &config);
  if (r != ncclSuccess && r != ncclInProgress) fail("split", ncclGetErrorString(r));
  // Wait for the parent through fail(), not wait_comm_ready(): the parent is owned by this object, and an abort
  // must mark it aborted (the destructor would otherwise finalize an aborted communicator).
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
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
  return std::unique_ptr<Communicator>(new NcclCommunicator(child, child_rank, child_size, timeout_ms_, name));
}

}  // namespace bmt::core
