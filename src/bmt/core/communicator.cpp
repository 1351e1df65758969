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

std::string Communicator::dead_peer_suffix() const {
  if (!peer_monitor_) return "";
  // A collective usually fails (connection reset) before the heartbeat has been read: wait one more poll, which
  // finds a killed peer on this host. Not longer: when nobody died (a stalled peer) the wait only delays the error.
  return peer_verdict_suffix(peer_monitor_.get(), peer_monitor_->options().interval_ms + 500);
}

}  // namespace bmt::core
