// NcclCommunicator: the GPU implementation of Communicator over NCCL (CUDA builds only).
// Owns its ncclComm_t (destroyed in the destructor, aborted on error); owns no stream: every call enqueues on
// the stream it is given and returns at once. The communicator is created non-blocking so that init, split and
// every host-side wait can be bounded by the timeout and aborted; asynchronous errors (a dead peer, a network
// failure) are polled with ncclCommGetAsyncError and reported as DistError naming the operation and the ranks.
#pragma once

#include <nccl.h>

#include <memory>
#include <string>

#include "bmt/core/communicator.h"
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

  ncclComm_t raw() const { return comm_; }

 private:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int64_t timeout_ms, std::string name);
  // Waits (bounded by the timeout) until a non-blocking NCCL call has been enqueued or failed.
  void wait_enqueued(const char* op, ncclResult_t launched);
  [[noreturn]] void fail(const char* op, const std::string& why);

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  int64_t timeout_ms_ = 0;
  std::string name_;
  int group_depth_ = 0;
  bool aborted_ = false;
};

}  // namespace bmt::core
