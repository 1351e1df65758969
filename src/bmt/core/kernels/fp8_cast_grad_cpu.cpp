// CPU twin of the fused gradient cast (fp8_cast_grad_internal.h): the separate twins composed.
#include <cstdint>
#include <cstring>
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

void fp8_cast_grad_parts_delayed_cpu(const void* const* dy_parts, int parts, DType dtype, int64_t rows, int64_t cols,
                                     const float* scale, float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt,
                                     void* col_sum, DType sum_dtype) {
  BMT_CHECK(parts >= 1 && parts <= kFp8CastGradMaxParts && cols % parts == 0, "fp8_cast_grad_parts_delayed_cpu: ",
            cols, " columns in ", parts, " parts (1 to ", kFp8CastGradMaxParts, ", dividing the columns)");
  if (parts == 1) {
    fp8_cast_grad_delayed_cpu(dy_parts[0], nullptr, dtype, rows, cols, scale, amax_io, format, q, qt, col_sum,
                              sum_dtype);
    return;
  }
  // (the twin: the pieces concatenated, then the one-piece twin)
  const size_t elem = dtype_nbytes(dtype), piece = static_cast<size_t>(cols / parts) * elem;
  std::vector<uint8_t> dy(static_cast<size_t>(rows * cols) * elem);
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < parts; ++p)
      std::memcpy(dy.data() + static_cast<size_t>(r) * parts * piece + p * piece,
                  static_cast<const uint8_t*>(dy_parts[p]) + static_cast<size_t>(r) * piece, piece);
  fp8_cast_grad_delayed_cpu(dy.data(), nullptr, dtype, rows, cols, scale, amax_io, format, q, qt, col_sum, sum_dtype);
}

bool fp8_cast_grad_parts_cuda_applies(int64_t rows, int64_t cols, const void* const* dy_parts, int parts,
                                      const uint8_t* q, const uint8_t* qt) {
  if (parts < 1 || parts > kFp8CastGradMaxParts || cols % parts != 0 || (cols / parts) % 8 != 0) return false;
  for (int p = 0; p < parts; ++p)
    if (!fp8_cast_grad_cuda_applies(rows, cols, dy_parts[p], nullptr, q, qt)) return false;
  return true;
}

bool fp8_cast_grad_cuda_applies(int64_t rows, int64_t cols, const void* dy, const void* pre, const uint8_t* q,
                                const uint8_t* qt) {
  const auto aligned = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; };
  return rows > 0 && cols > 0 && rows % 8 == 0 && cols % 8 == 0 && (rows + 63) / 64 <= 65535 && aligned(dy, 16) &&
         aligned(pre, 16) && aligned(q, 8) && aligned(qt, 8);
}

int64_t fp8_cast_grad_workspace_numel(int64_t rows, int64_t cols) { return (rows + 63) / 64 * cols; }

}  // namespace bmt::core::kernels
