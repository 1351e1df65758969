#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace bmt {

core::DType to_core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return core::DType::kFloat32;
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    case at::kLong: return core::DType::kInt64;
    case at::kInt: return core::DType::kInt32;
    case at::kByte: return core::DType::kUInt8;
    case at::kDouble: return core::DType::kFloat64;
    default: BMT_ERROR("dtype ", c10::toString(t), " is not supported by bmtrain's communicators (use float32, "
                       "float16, bfloat16, float64, int64, int32 or uint8)");
  }
}

at::ScalarType to_scalar_type(core::DType t) {
  switch (t) {
    case core::DType::kFloat32: return at::kFloat;
    case core::DType::kFloat16: return at::kHalf;
    case core::DType::kBFloat16: return at::kBFloat16;
    case core::DType::kInt64: return at::kLong;
    case core::DType::kInt32: return at::kInt;
    case core::DType::kUInt8: return at::kByte;
    case core::DType::kFloat64: return at::kDouble;
  }
  BMT_ASSERT(false, "unmapped dtype");
}

core::StreamHandle current_stream_handle(const at::Tensor& t) {
#ifdef BMT_WITH_CUDA
  if (t.is_cuda()) return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
  (void)t;
  return nullptr;
}

void check_comm_tensor(const at::Tensor& t, const core::Communicator& comm, const char* op, const char* what) {
  BMT_CHECK(t.defined(), op, ": ", what, " tensor is undefined");
  BMT_CHECK(t.is_contiguous(), op, ": ", what, " tensor must be contiguous (call .contiguous() first)");
  bool want_cuda = comm.device_kind() == core::DeviceKind::kCUDA;
  BMT_CHECK(t.is_cuda() == want_cuda, op, " on communicator '", comm.name(), "' (", comm.backend_name(),
            ", rank ", comm.rank(), "): ", what, " tensor is on ", t.device().str(), " but this backend needs ",
            want_cuda ? "CUDA" : "CPU", " tensors; move it with .to(bmt::config().device)");
}

}  // namespace bmt
