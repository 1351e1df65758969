// CPU twin of the fused gradient cast (fp8_cast_grad_internal.h): the separate twins composed.
#include <cstdint>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/core/kernels/fp8_cast_grad_internal.h"

namespace bmt::core::kernels {

void fp8_cast_grad_delayed_cpu(const void* dy, const void* pre, DType dtype, int64_t rows, int64_t cols,
                               const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                               void* col_sum, DType sum_dtype) {
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_grad_delayed_cpu: negative shape [", rows, ", ", cols, "]");
  BMT_CHECK(dy || rows * cols == 0, "fp8_cast_grad_delayed_cpu: null dy");
  const void* g = dy;
  std::vector<uint8_t> dpre, sums;
  if (pre) {  // d pre in dtype (the values the cast and the sums see), its sums into col_sum or a scratch
    dpre.resize(static_cast<size_t>(rows * cols) * dtype_nbytes(dtype));
    if (!col_sum) sums.resize(static_cast<size_t>(cols) * dtype_nbytes(sum_dtype));
    dgelu_column_sum_cpu(dy, pre, dtype, rows, cols, dpre.data(), col_sum ? col_sum : sums.data(), sum_dtype);
    g = dpre.data();
  } else if (col_sum) {
    column_sum_cpu(dy, dtype, rows, cols, col_sum, sum_dtype);
  }
  if (q || qt) fp8_cast_delayed_cpu(g, dtype, rows, cols, scale, amax_io, format, q, qt);
}

bool fp8_cast_grad_cuda_applies(int64_t rows, int64_t cols, const void* dy, const void* pre, const uint8_t* q,
                                const uint8_t* qt) {
  const auto aligned = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; };
  return rows > 0 && cols > 0 && rows % 8 == 0 && cols % 8 == 0 && (rows + 63) / 64 <= 65535 && aligned(dy, 16) &&
         aligned(pre, 16) && aligned(q, 8) && aligned(qt, 8);
}

int64_t fp8_cast_grad_workspace_numel(int64_t rows, int64_t cols) { return (rows + 63) / 64 * cols; }

}  // namespace bmt::core::kernels
