// CPU twin of the FP8 byte transpose (fp8_cast_internal.h): the CUDA kernel's test reference.
#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels {

void fp8_transpose_cpu(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt) {
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_transpose_cpu: negative shape ", rows, "x", cols);
  BMT_CHECK(rows * cols == 0 || (q && qt), "fp8_transpose_cpu: null buffer for a ", rows, "x", cols, " matrix");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) qt[c * rows + r] = q[r * cols + c];
}

}  // namespace bmt::core::kernels
