#include "bmt/runtime/gloo_communicator_internal.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstring>

#include "bmt/core/error.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt {

using core::DType;
using core::ReduceOp;

struct GlooCommunicator::Impl {
  // Held as c10d's abstract Backend: only the construction below touches ProcessGroupGloo (and gloo's headers).
  c10::intrusive_ptr<c10d::Backend> pg;
};

namespace {

at::Tensor wrap(const void* ptr, size_t numel, DType dtype) {
  return at::from_blob(const_cast<void*>(ptr), {static_cast<int64_t>(numel)},
                       at::TensorOptions().dtype(to_scalar_type(dtype)).device(at::kCPU));
}

// Gloo moves bytes without caring about their type: half types travel as uint8 for data movement.
at::Tensor wrap_bytes(const void* ptr, size_t numel, DType dtype) {
  return wrap(ptr, numel * core::dtype_nbytes(dtype), DType::kUInt8);
}

// c10::Error::what() carries a C++ backtrace of dozens of lines; our messages keep only its text.
std::string describe(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

bool gloo_has_arithmetic(DType t) { return !core::dtype_is_half(t) && t != DType::kUInt8; }

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kProd: return c10d::ReduceOp::PRODUCT;
  }
  BMT_ASSERT(false, "unmapped reduce op");
}

}  // namespace

GlooCommunicator::GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                   std::chrono::milliseconds timeout, std::string name, std::string hostname)
    : impl_(std::make_unique<Impl>()),
      store_(std::move(store)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      name_(std::move(name)),
      hostname_(std::move(hostname)) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  try {
    opts->devices.push_back(hostname_.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                              : c10d::ProcessGroupGloo::createDeviceForHostname(hostname_));
    opts->threads = 2;
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("bmt/gloo/" + name_, store_);
    impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank_, size_, opts);
  } catch (const std::exception& e) {
    throw core::DistError(core::concat("Gloo communicator '", name_, "' (rank ", rank_, " of ", size_,
                                       ") could not connect within ", timeout.count(), " ms: ", describe(e),
                                       " (did every rank start? see the launcher's report)"));
  }
}

GlooCommunicator::~GlooCommunicator() = default;

#define BMT_GLOO_WAIT(opname, work_expr)                                                                     \
  do {                                                                                                       \
    try {                                                                                                    \
      auto _work = (work_expr);                                                                              \
      _work->wait(timeout_);                                                                                 \
    } catch (const core::Error&) {                                                                           \
      throw;                                                                                                 \
    } catch (const std::exception& e) {                                                                      \
      throw core::DistError(core::concat("gloo ", opname, " on communicator '", name_, "' (rank ", rank_,     \
                                         " of ", size_, ") failed or timed out after ", timeout_.count(),     \
                                         " ms: ", describe(e),                                               \
                                         ". A peer rank probably died or stalled (see the launcher's "       \
                                         "report).", dead_peer_suffix()));                                  \
    }                                                                                                        \
  } while (false)

void GlooCommunicator::all_gather(const void* send, void* recv, size_t send_numel, DType dtype,
                                  core::StreamHandle) {
  size_t nbytes = send_numel * core::dtype_nbytes(dtype);
  // Gloo wants distinct input and outputs; copy the input first when it aliases our own output slot.
  at::Tensor in = wrap_bytes(send, send_numel, dtype);
  uint8_t* my_slot = static_cast<uint8_t*>(recv) + rank_ * nbytes;
  if (send == my_slot) in = in.clone();
  std::vector<at::Tensor> outs;
  outs.reserve(size_);
  for (int r = 0; r < size_; ++r) outs.push_back(wrap(static_cast<uint8_t*>(recv) + r * nbytes, nbytes, DType::kUInt8));
  std::vector<std::vector<at::Tensor>> outputs{outs};
  std::vector<at::Tensor> inputs{in};
  BMT_GLOO_WAIT("all_gather", impl_->pg->allgather(outputs, inputs));
}

void GlooCommunicator::all_reduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                  core::StreamHandle) {
  BMT_CHECK(dtype != DType::kUInt8, "all_reduce on '", name_, "': uint8 reductions are not supported");
  if (numel == 0) return;
  at::Tensor out = wrap(recv, numel, dtype);
  if (send != recv) out.copy_(wrap(send, numel, dtype));
  at::Tensor work_tensor = gloo_has_arithmetic(dtype) ? out : out.to(at::kFloat);
  std::vector<at::Tensor> tensors{work_tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  BMT_GLOO_WAIT("all_reduce", impl_->pg->allreduce(tensors, opts));
  if (op == ReduceOp::kAvg) {
    if (at::isIntegralType(work_tensor.scalar_type(), false))
      work_tensor.div_(size_, "trunc");  // like C++ integer division and NCCL's ncclAvg on integers
    else
      work_tensor.div_(size_);
  }
  if (!work_tensor.is_same(out)) out.copy_(work_tensor);
}

void GlooCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_numel, DType dtype, ReduceOp op,
                                      core::StreamHandle stream) {
  // CPU ranks only: reduce the whole buffer in a temporary, keep our chunk.
  if (recv_numel == 0) return;  // nothing to reduce; recv may be null (memcpy on null is undefined even for 0 bytes)
  at::Tensor full = wrap(send, recv_numel * size_, dtype).clone();
  all_reduce(full.data_ptr(), full.data_ptr(), full.numel(), dtype, op, stream);
  std::memcpy(recv, static_cast<uint8_t*>(full.data_ptr()) + rank_ * recv_numel * core::dtype_nbytes(dtype),
              recv_numel * core::dtype_nbytes(dtype));
}

void GlooCommunicator::broadcast(const void* send, void* recv, size_t numel, DType dtype, int root,
                                 core::StreamHandle) {
  check_root("broadcast", root);
  if (rank_ == root && send != recv) std::memcpy(recv, send, numel * core::dtype_nbytes(dtype));
  std::vector<at::Tensor> tensors{wrap_bytes(recv, numel, dtype)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  BMT_GLOO_WAIT("broadcast", impl_->pg->broadcast(tensors, opts));
}

void GlooCommunicator::send(const void* buf, size_t numel, DType dtype, int peer, core::StreamHandle) {
  check_peer("send", peer);
  std::vector<at::Tensor> tensors{wrap_bytes(buf, numel, dtype)};
  BMT_GLOO_WAIT("send", impl_->pg->send(tensors, peer, 0));
}

void GlooCommunicator::recv(void* buf, size_t numel, DType dtype, int peer, core::StreamHandle) {
  check_peer("recv", peer);
  std::vector<at::Tensor> tensors{wrap_bytes(buf, numel, dtype)};
  BMT_GLOO_WAIT("recv", impl_->pg->recv(tensors, peer, 0));
}

void GlooCommunicator::batch_p2p(const std::vector<core::P2POp>& ops, core::StreamHandle) {
  for (const core::P2POp& op : ops) check_peer(op.is_send ? "batch_p2p send" : "batch_p2p recv", op.peer);
  if (ops.empty()) return;
  std::vector<std::vector<at::Tensor>> tensors;  // alive until the waits are done
  tensors.reserve(ops.size());
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  auto post_all_wait_last = [&] {
    for (const core::P2POp& op : ops) {
      tensors.push_back({wrap_bytes(op.buf, op.numel, op.dtype)});
      works.push_back(op.is_send ? impl_->pg->send(tensors.back(), op.peer, 0)
                                 : impl_->pg->recv(tensors.back(), op.peer, 0));
    }
    for (size_t i = 0; i + 1 < works.size(); ++i) works[i]->wait(timeout_);
    return works.back();
  };
  BMT_GLOO_WAIT("batch_p2p", post_all_wait_last());
}

void GlooCommunicator::barrier() {
  // A one-element all-reduce (Gloo's own barrier takes no timeout on every torch version); a failure names
  // the barrier, the operation the caller asked for.
  float one = 1.0f;
  std::vector<at::Tensor> tensors{wrap(&one, 1, DType::kFloat32)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  BMT_GLOO_WAIT("barrier", impl_->pg->allreduce(tensors, opts));
}

std::unique_ptr<core::Communicator> GlooCommunicator::split(int color, int key, const std::string& name) {
  // Everyone learns every (color, key) so the members of each new group are known without a coordinator.
  std::vector<int64_t> mine{color, key};
  std::vector<int64_t> all(2 * size_);
  all_gather(mine.data(), all.data(), 2, DType::kInt64, nullptr);
  std::vector<std::pair<int64_t, int>> members;  // (key, old rank) of ranks with my color
  for (int r = 0; r < size_; ++r)
    if (all[2 * r] == color) members.emplace_back(all[2 * r + 1], r);
  std::sort(members.begin(), members.end());
  int new_rank = 0;
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].second == rank_) new_rank = static_cast<int>(i);
  std::string group_name = core::concat(name_, "/", split_count_++, "/", name, "/", color);
  auto child = std::make_unique<GlooCommunicator>(store_, new_rank, static_cast<int>(members.size()), timeout_,
                                                  group_name, hostname_);
  child->set_peer_monitor(peer_monitor_);
  return child;
}

}  // namespace bmt
