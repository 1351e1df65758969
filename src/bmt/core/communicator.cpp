#include "bmt/core/communicator.h"

#include "bmt/core/peer_monitor.h"

namespace bmt::core {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kProd: return "prod";
  }
  return "unknown";
}

void Communicator::check_peer(const char* op, int peer) const {
  BMT_CHECK(peer >= 0 && peer < size() && peer != rank(), op, " on communicator '", name(), "' (rank ", rank(),
            " of ", size(), "): peer ", peer, " is not another rank of this communicator; pass 0 <= peer < ",
            size(), ", peer != ", rank());
}

void Communicator::check_root(const char* op, int root) const {
  BMT_CHECK(root >= 0 && root < size(), op, " on communicator '", name(), "' (rank ", rank(), " of ", size(),
            "): root ", root, " is out of range [0, ", size(), ")");
}

void Communicator::batch_p2p(const std::vector<P2POp>& ops, StreamHandle stream) {
  group_start();
  try {
    for (const P2POp& op : ops) {
      if (op.is_send) send(op.buf, op.numel, op.dtype, op.peer, stream);
      else recv(op.buf, op.numel, op.dtype, op.peer, stream);
    }
  } catch (...) {
    group_end();
    throw;
  }
  group_end();
}

std::string Communicator::dead_peer_suffix() const {
  if (!peer_monitor_) return "";
  // A collective usually fails (a reset, or its own timeout) before the heartbeat has been read: wait up to three
  // polls, the time the watcher needs to see a stopped peer's heartbeat go stale and publish it plus this rank's
  // next poll (one poll was too short under load: the verdict came 0.5 s after the error). When nobody died the
  // wait only delays the error.
  return peer_verdict_suffix(peer_monitor_.get(), 3 * peer_monitor_->options().interval_ms + 500);
}

}  // namespace bmt::core
