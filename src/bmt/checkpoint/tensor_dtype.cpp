#include "bmt/checkpoint/tensor_dtype.h"

#include <map>

#include "bmt/core/error.h"

namespace bmt::checkpoint {

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    case at::kFloat8_e4m3fn: return "F8_E4M3";
    case at::kFloat8_e5m2: return "F8_E5M2";
    default: BMT_ERROR("checkpoint: tensors of dtype ", c10::toString(t), " cannot be saved (supported: float64/32/16, "
                       "bfloat16, float8_e4m3fn/e5m2, int64/32/16/8, uint8, bool)");
  }
}

at::ScalarType scalar_type_of(const std::string& dtype) {
  static const std::map<std::string, at::ScalarType> map = {
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},  {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},   {"BOOL", at::kBool},  {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2}};
  auto it = map.find(dtype);
  BMT_CHECK(it != map.end(), "checkpoint: dtype \"", dtype, "\" has no torch equivalent in this build");
  return it->second;
}

}  // namespace bmt::checkpoint
