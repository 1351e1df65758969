// Reading and writing fp32 / bf16 / fp16 elements of raw byte buffers as float (round-to-nearest-even), for the
// kernel tests that drive the torch-free core directly (CPU and CUDA).
#pragma once

#include <cstdint>
#include <cstring>

#include "bmt/core/dtype.h"

namespace bmt::optim::testing {

inline void put_element(uint8_t* base, core::DType d, int64_t i, float x) {
  if (d == core::DType::kFloat32) {
    std::memcpy(base + 4 * i, &x, 4);
    return;
  }
  const uint16_t h = d == core::DType::kBFloat16 ? core::float_to_bf16_bits(x) : core::float_to_fp16_bits(x);
  std::memcpy(base + 2 * i, &h, 2);
}

inline float get_element(const uint8_t* base, core::DType d, int64_t i) {
  if (d == core::DType::kFloat32) {
    float x;
    std::memcpy(&x, base + 4 * i, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, base + 2 * i, 2);
  return d == core::DType::kBFloat16 ? core::bf16_bits_to_float(h) : core::fp16_bits_to_float(h);
}

}  // namespace bmt::optim::testing
