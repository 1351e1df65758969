#include "bmt/checkpoint/tensor_info.h"

#include <limits>

#include "bmt/core/error.h"

namespace bmt::checkpoint {

int64_t dtype_element_nbytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "U8" || dtype == "I8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
  return 0;
}

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& ctx) {
  int64_t n = 1;
  for (int64_t d : shape) {
    BMT_CHECK(d >= 0, ctx, ": negative dimension in shape ", shape_string(shape));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) BMT_ERROR(ctx, ": shape ", shape_string(shape), " overflows int64");
    n *= d;
  }
  return n;
}

int64_t checked_nbytes(const std::string& dtype, const std::vector<int64_t>& shape, const std::string& ctx) {
  const int64_t elem = dtype_element_nbytes(dtype);
  BMT_CHECK(elem > 0, ctx, ": unknown dtype \"", dtype, "\"");
  const int64_t n = checked_numel(shape, ctx);
  BMT_CHECK(n <= std::numeric_limits<int64_t>::max() / elem, ctx, ": shape ", shape_string(shape), " of ", dtype,
            " overflows int64 bytes");
  return n * elem;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace bmt::checkpoint
