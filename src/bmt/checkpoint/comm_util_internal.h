// Small collectives the checkpoint code needs on top of core::Communicator: exchanging strings, agreeing on
// failure, and point-to-point raw bytes. Buffers travel through tensors on bmt::config().device (what the
// communicator needs: CPU for Gloo, CUDA for NCCL).
//
// Failure agreement: every rank of a collective checkpoint operation catches its own error, then all ranks call
// raise_if_any_failed; if any rank failed, every rank throws the same message listing each failed rank, so one
// rank's disk error never leaves the others hanging in a later collective.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "bmt/core/communicator.h"

namespace bmt::checkpoint::detail {

std::vector<std::string> all_gather_strings(core::Communicator& comm, const std::string& mine);
// The keys in every rank's list (collective). With pipeline stages each rank's model holds only some keys: a file
// key is unexpected only when no rank of the job wants it.
std::vector<std::string> keys_on_every_rank(core::Communicator& comm, const std::vector<std::string>& mine);
std::string broadcast_string(core::Communicator& comm, const std::string& s, int root);
void raise_if_any_failed(core::Communicator& comm, const std::string& my_error, const std::string& what);

// Sends the bytes of a contiguous tensor (any dtype, any device) to `peer`.
void send_tensor_bytes(core::Communicator& comm, const at::Tensor& t, int peer);
// Receives nbytes from `peer` into `dst_u8` (a contiguous uint8 tensor on the communicator's device, or any
// contiguous CPU uint8 tensor, which is staged through the device when needed).
void recv_tensor_bytes(core::Communicator& comm, at::Tensor& dst_u8, int peer);

// The flattened contiguous uint8 view of a tensor's elements [begin, end) (a copy only when not contiguous).
at::Tensor byte_view(const at::Tensor& t, int64_t begin, int64_t end);

// Runs fn, returning its exception message ("" when it succeeded); other exceptions are reported too.
template <typename F>
std::string capture_error(F&& fn) {
  try {
    fn();
    return {};
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace bmt::checkpoint::detail
