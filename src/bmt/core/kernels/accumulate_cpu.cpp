// CPU twin of accumulate_fp32_cuda: a plain loop (the test reference; CPU Blocks use at::add_).
#include "bmt/core/error.h"
#include "bmt/core/kernels/accumulate_internal.h"

namespace bmt::core::kernels {

void accumulate_fp32_cpu(float* dst, const void* src, DType src_dtype, int64_t numel) {
  BMT_CHECK(src_dtype == DType::kFloat32 || src_dtype == DType::kBFloat16 || src_dtype == DType::kFloat16,
            "accumulate_fp32_cpu: source dtype ", dtype_name(src_dtype), " is not fp32, bf16 or fp16");
  BMT_CHECK(numel >= 0 && (numel == 0 || (dst != nullptr && src != nullptr)), "accumulate_fp32_cpu: bad buffers");
  const auto* half = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < numel; ++i) {
    if (src_dtype == DType::kFloat32) dst[i] += static_cast<const float*>(src)[i];
    else if (src_dtype == DType::kBFloat16) dst[i] += bf16_bits_to_float(half[i]);
    else dst[i] += fp16_bits_to_float(half[i]);
  }
}

}  // namespace bmt::core::kernels
