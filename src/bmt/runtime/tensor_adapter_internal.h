// Bridges at::Tensor and the torch-free core: dtype mapping, raw pointers, the stream a collective runs on.
#pragma once

#include <ATen/ATen.h>

#include "bmt/core/communicator.h"
#include "bmt/core/dtype.h"

namespace bmt {

core::DType to_core_dtype(at::ScalarType t);
at::ScalarType to_scalar_type(core::DType t);

// The stream collectives on `t` are enqueued on by default: the current CUDA stream of t's device, or nullptr
// on CPU.
core::StreamHandle current_stream_handle(const at::Tensor& t);

// Checks that t can be handed to `comm` (contiguous, on the communicator's kind of device); names the operation.
void check_comm_tensor(const at::Tensor& t, const core::Communicator& comm, const char* op, const char* what);

}  // namespace bmt
