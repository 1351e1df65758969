// Element access of the CPU twins: one fp32 / bf16 / fp16 element read as double, or written from double (through
// fp32, round to nearest even). `op` names the kernel in the error for any other dtype.
#pragma once

#include <cstdint>

#include "bmt/core/dtype.h"
#include "bmt/core/error.h"

namespace bmt::core::kernels {

inline double load_float_element(const void* p, DType dtype, int64_t i, const char* op) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16: return fp16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: BMT_ERROR(op, ": dtype ", dtype_name(dtype), " is not fp32, bf16 or fp16");
  }
}

inline void store_float_element(void* p, DType dtype, int64_t i, double v, const char* op) {
  const float f = static_cast<float>(v);
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(p)[i] = f; break;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(f); break;
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_fp16_bits(f); break;
    default: BMT_ERROR(op, ": output dtype ", dtype_name(dtype), " is not fp32, bf16 or fp16");
  }
}

}  // namespace bmt::core::kernels
