// Communicator: the collective interface the ZeRO engine, optimizers and tensor parallelism talk to.
// Torch-free: buffers are raw pointers + element counts (numel) + DType, in the communicator's device memory.
//
// Streams: GPU backends (NCCL) enqueue on the `stream` argument (a cudaStream_t passed as void*) and return
// without waiting; ordering against other streams is the caller's job (events). CPU backends (Gloo) ignore the
// stream and return only when the operation has completed (or throw DistError on failure / timeout).
//
// Every blocking call honours timeout_ms(): a dead peer turns into a DistError naming the operation, the
// communicator and the ranks, never a silent hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bmt/core/dtype.h"

namespace bmt::core {

class PeerMonitor;

enum class ReduceOp { kSum, kAvg, kMax, kMin, kProd };
const char* reduce_op_name(ReduceOp op);

enum class DeviceKind { kCPU, kCUDA };

using StreamHandle = void*;  // cudaStream_t on CUDA backends, nullptr (unused) on CPU backends

// One point-to-point transfer of a batch_p2p call.
struct P2POp {
  bool is_send = true;
  void* buf = nullptr;  // read when sending, written when receiving
  size_t numel = 0;
  DType dtype = DType::kFloat32;
  int peer = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Name of the group ("world", "tp", "zero", ...) used in error messages.
  virtual const std::string& name() const = 0;
  virtual DeviceKind device_kind() const = 0;
  virtual const char* backend_name() const = 0;
  virtual int64_t timeout_ms() const = 0;

  // recv holds size() * send_numel elements in rank order. send may alias recv + rank() * send_numel.
  virtual void all_gather(const void* send, void* recv, size_t send_numel, DType dtype, StreamHandle stream) = 0;
  // send holds size() * recv_numel elements; rank r receives the reduction of chunk r.
  virtual void reduce_scatter(const void* send, void* recv, size_t recv_numel, DType dtype, ReduceOp op,
                              StreamHandle stream) = 0;
  // send may equal recv (in place).
  virtual void all_reduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                          StreamHandle stream) = 0;
  // On root, send is read; everywhere recv is written (send may equal recv).
  virtual void broadcast(const void* send, void* recv, size_t numel, DType dtype, int root, StreamHandle stream) = 0;
  virtual void send(const void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) = 0;
  virtual void recv(void* buf, size_t numel, DType dtype, int peer, StreamHandle stream) = 0;

  // Runs the sends and receives concurrently and returns when all are done (CPU) or enqueued (GPU): two ranks may
  // both send to each other in one call without deadlocking, whatever the transport buffers. Messages between
  // one pair of ranks are matched in call order. Default: the ops inside group_start/group_end (NCCL semantics).
  virtual void batch_p2p(const std::vector<P2POp>& ops, StreamHandle stream);

  // Groups several operations into one launch (NCCL); a no-op on CPU backends.
  virtual void group_start() {}
  virtual void group_end() {}

  // Blocks the host until every rank reached the barrier, within the timeout.
  virtual void barrier() = 0;
  // Blocks the host until the work enqueued on `stream` is done, polling for asynchronous communicator errors
  // and the timeout. A no-op on CPU backends.
  virtual void synchronize(StreamHandle stream) { (void)stream; }
  // Raises DistError if an asynchronous error (e.g. a dead peer) was detected. Cheap; no host sync.
  virtual void check_async_error() {}

  // Collective over this communicator: ranks with the same color form a new communicator, ordered by key.
  // The new communicator shares this one's peer monitor.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  // The job's heartbeat monitor (init_distributed sets it on the world communicator before any split): a
  // DistError names the dead rank it saw; the NCCL watchdog also aborts the communicator on its verdict.
  virtual void set_peer_monitor(std::shared_ptr<PeerMonitor> monitor) { peer_monitor_ = std::move(monitor); }
  std::shared_ptr<PeerMonitor> peer_monitor() const { return peer_monitor_; }

 protected:
  // " [rank R is dead: ...]" when the peer monitor names a dead rank within one more heartbeat, else "".
  std::string dead_peer_suffix() const;

  std::shared_ptr<PeerMonitor> peer_monitor_;
  // Common argument validation; throws Error naming the op and the offending value.
  void check_peer(const char* op, int peer) const;
  void check_root(const char* op, int root) const;
};

}  // namespace bmt::core
