// NcclCommunicator: the GPU implementation of Communicator over NCCL (CUDA builds only).
// Owns its ncclComm_t (destroyed in the destructor, aborted on error); owns no stream: every call enqueues on
// the stream it is given and returns at once. The communicator is created non-blocking so that init, split and
// every host-side wait can be bounded by the timeout and aborted. Its NcclWatchdog thread aborts it when an
// enqueued operation outlives the timeout, NCCL reports an asynchronous error, or the peer monitor sees a rank
// die; the next call then throws DistError naming the operation, the communicator and the dead rank.
#pragma once

#include <nccl.h>

#include <memory>
#include <utility>
#include <vector>
#include <string>

#include "bmt/core/communicator.h"
#include "bmt/core/nccl_watchdog.h"
#include "bmt/core/store.h"

namespace bmt::core {

class NcclCommunicator final : public Communicator {
 public:
  // Collective over `size` ranks: rank 0 creates the unique id and publishes it under `store_key`.
  // The current CUDA device must already be set.
  static std::unique_ptr<NcclCommunicator> create(Store& store, const std::string& store_key, int rank, int size,
                                                  int64_t timeout_ms, const std::string& name);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  DeviceKind device_kind() const override { return DeviceKind::kCUDA; }
  const char* backend_name() const override { return "nccl"; }
  int64_t timeout_ms() const override { return timeout_ms_; }

  void all_gather(const void* send, void* recv, size_t send_numel, DType dtype, StreamHandle stream) override;
  void reduce_scatter(const void* send, void* recv, size_t recv_numel, DType dtype, ReduceOp op,
                      StreamHandle stream) override;
  void all_reduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op, StreamHandle stream) override;
  void broadcast(const void* send, void* recv, size_t numel, DType dtype, int root, StreamHandle stream) override;
  void send(const void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) override;
  void recv(void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) override;
  void group_start() override;
  void group_end() override;
  void barrier() override;
  void synchronize(StreamHandle stream) override;
  void check_async_error() override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;
  void set_peer_monitor(std::shared_ptr<PeerMonitor> monitor) override;

  // The raw handle, for tests; null once aborted.
  ncclComm_t raw() const;
  bool aborted() const;

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int64_t timeout_ms, std::string name,
                   std::shared_ptr<PeerMonitor> monitor);
  // Runs `launch(comm)` under the state's lock (unless aborted), waits (bounded) until the non-blocking call is
  // enqueued, and lets the watchdog time the work it put on `stream`.
  template <typename Launch>
  void enqueue(const char* op, StreamHandle stream, Launch&& launch);
  // Waits (bounded by the timeout) until a non-blocking NCCL call has been enqueued or failed.
  void wait_enqueued(const char* op, ncclResult_t launched);
  // Throws the recorded abort reason if the watchdog aborted the communicator.
  void throw_if_aborted(const char* op);
  [[noreturn]] void fail(const char* op, const std::string& why);

  std::shared_ptr<NcclCommState> state_;
  std::unique_ptr<NcclWatchdog> watchdog_;
  int rank_ = 0;
  int size_ = 1;
  int64_t timeout_ms_ = 0;
  std::string name_;
  int group_depth_ = 0;
  std::vector<std::pair<const char*, StreamHandle>> group_ops_;  // tracked at group_end
};

}  // namespace bmt::core
