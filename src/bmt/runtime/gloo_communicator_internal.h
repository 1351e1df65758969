// GlooCommunicator: the CPU implementation of Communicator over c10d's ProcessGroupGloo.
// The only file that includes ProcessGroupGloo (c10d API drift stays here). Operations are host-synchronous:
// each call returns when the result is in place, or throws DistError (timeout, dead peer).
// Gloo has no bf16/fp16 arithmetic on every torch version and no AVG: half-precision reductions run in fp32
// and are rounded back once; AVG = SUM / size (integers round toward zero, as NCCL). Reduce-scatter is an all-reduce plus a local slice (CPU only).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>

#include "bmt/core/communicator.h"

namespace c10d {
class ProcessGroupGloo;
}

namespace bmt {

class GlooCommunicator final : public core::Communicator {
 public:
  // Collective over `size` ranks sharing `store` (keys are prefixed with `name`).
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
                   std::string name, std::string hostname);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  core::DeviceKind device_kind() const override { return core::DeviceKind::kCPU; }
  const char* backend_name() const override { return "gloo"; }
  int64_t timeout_ms() const override { return timeout_.count(); }

  void all_gather(const void* send, void* recv, size_t send_numel, core::DType dtype,
                  core::StreamHandle stream) override;
  void reduce_scatter(const void* send, void* recv, size_t recv_numel, core::DType dtype, core::ReduceOp op,
                      core::StreamHandle stream) override;
  void all_reduce(const void* send, void* recv, size_t numel, core::DType dtype, core::ReduceOp op,
                  core::StreamHandle stream) override;
  void broadcast(const void* send, void* recv, size_t numel, core::DType dtype, int root,
                 core::StreamHandle stream) override;
  void send(const void* buf, size_t numel, core::DType dtype, int peer, core::StreamHandle stream) override;
  void recv(void* buf, size_t numel, core::DType dtype, int peer, core::StreamHandle stream) override;
  // Posts every op before waiting for any (Gloo's send may wait for the matching receive).
  void batch_p2p(const std::vector<core::P2POp>& ops, core::StreamHandle stream) override;
  void barrier() override;
  std::unique_ptr<core::Communicator> split(int color, int key, const std::string& name) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  std::string hostname_;
  int split_count_ = 0;
};

}  // namespace bmt
