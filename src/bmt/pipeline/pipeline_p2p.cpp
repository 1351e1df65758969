#include "bmt/pipeline/pipeline_p2p_internal.h"

#include <c10/core/StreamGuard.h>

#include "bmt/core/error.h"
#include "bmt/runtime/stream_sync.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace bmt::detail {
namespace {

constexpr int64_t kMaxDims = 16;
constexpr int64_t kMetaNumel = kMaxDims + 2;  // [ndim, dtype code, shape...] per tensor

core::P2POp op_of(bool is_send, const at::Tensor& t, int peer) {
  return core::P2POp{is_send, t.data_ptr(), static_cast<size_t>(t.numel()), to_core_dtype(t.scalar_type()), peer};
}

}  // namespace

std::vector<at::Tensor> pipe_transfer(const PipeLink& link, PipeTransfer& t) {
  core::Communicator& comm = *link.comm;
  const at::Device& device = link.device;
  const bool any = (!t.send_acts.empty() && t.act_to >= 0) || (!t.send_grads.empty() && t.grad_to >= 0) ||
                   (t.recv_acts > 0 && t.act_from >= 0) || (!t.recv_grads.empty() && t.grad_from >= 0);
  if (!any) return {};
  const std::optional<c10::Stream> calc = calc_stream();
  const std::optional<c10::Stream> pp = link.stream;
  // Payloads must be complete before the comm stream reads them.
  for (auto& x : t.send_acts) x = x.contiguous();
  for (auto& x : t.send_grads) x = x.contiguous();
  // A pure receive lands in buffers allocated on the comm stream: it need not wait for queued compute (which would
  // make the host's metadata read below wait for it too).
  if (!t.send_acts.empty() || !t.send_grads.empty() || !t.recv_grads.empty()) stream_wait(pp, calc);
  std::optional<c10::StreamGuard> guard;
  if (pp) guard.emplace(*pp);
  const auto long_opts = at::TensorOptions().dtype(at::kLong);

  // Round 1: activation metadata (both ways) and gradients.
  std::vector<core::P2POp> ops;
  at::Tensor send_meta, recv_meta;
  if (!t.send_acts.empty() && t.act_to >= 0) {
    send_meta = at::zeros({static_cast<int64_t>(t.send_acts.size()), kMetaNumel}, long_opts);
    auto m = send_meta.accessor<int64_t, 2>();
    for (size_t i = 0; i < t.send_acts.size(); ++i) {
      const at::Tensor& x = t.send_acts[i];
      BMT_CHECK(x.dim() <= kMaxDims, "pipeline: an activation has ", x.dim(), " dims (at most ", kMaxDims, ")");
      m[i][0] = x.dim();
      m[i][1] = static_cast<int64_t>(to_core_dtype(x.scalar_type()));
      for (int64_t d = 0; d < x.dim(); ++d) m[i][d + 2] = x.size(d);
    }
    send_meta = send_meta.to(device);
    ops.push_back(op_of(true, send_meta, t.act_to));
  }
  if (t.recv_acts > 0 && t.act_from >= 0) {
    recv_meta = at::empty({t.recv_acts, kMetaNumel}, long_opts.device(device));
    ops.push_back(op_of(false, recv_meta, t.act_from));
  }
  if (t.grad_to >= 0)
    for (const auto& g : t.send_grads) ops.push_back(op_of(true, g, t.grad_to));
  if (t.grad_from >= 0)
    for (const auto& g : t.recv_grads) ops.push_back(op_of(false, g, t.grad_from));
  core::StreamHandle stream = current_stream_handle(send_meta.defined() ? send_meta
                                                    : recv_meta.defined() ? recv_meta
                                                    : !t.send_grads.empty() ? t.send_grads[0] : t.recv_grads[0]);
  comm.batch_p2p(ops, stream);

  // Round 2: activation payloads (the receiver needed the metadata to allocate).
  ops.clear();
  std::vector<at::Tensor> received;
  if (send_meta.defined())
    for (const auto& x : t.send_acts) ops.push_back(op_of(true, x, t.act_to));
  if (recv_meta.defined()) {
    comm.synchronize(stream);
    at::Tensor meta = recv_meta.to(at::kCPU);
    auto m = meta.accessor<int64_t, 2>();
    for (int64_t i = 0; i < t.recv_acts; ++i) {
      BMT_CHECK(m[i][0] >= 0 && m[i][0] <= kMaxDims && m[i][1] >= 0 &&
                    m[i][1] <= static_cast<int64_t>(core::DType::kFloat64),
                "pipeline: corrupt activation metadata from pipe rank ", t.act_from,
                " (the stages disagree on the schedule or on num_hidden)");
      std::vector<int64_t> shape(&m[i][2], &m[i][2] + m[i][0]);
      received.push_back(at::empty(shape, at::TensorOptions()
                                              .dtype(to_scalar_type(static_cast<core::DType>(m[i][1])))
                                              .device(device)));
      ops.push_back(op_of(false, received.back(), t.act_from));
    }
  }
  if (!ops.empty()) comm.batch_p2p(ops, stream);

  if (pp) {
    for (auto& x : t.send_acts) x.record_stream(*pp);
    for (auto& x : t.send_grads) x.record_stream(*pp);
    for (auto& x : received) x.record_stream(*calc);
    for (auto& x : t.recv_grads) x.record_stream(*pp);
    guard.reset();
    stream_wait(calc, pp);  // later compute sees the received tensors
  }
  return received;
}

}  // namespace bmt::detail
