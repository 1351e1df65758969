#include "bmt/nn/fp8_format_internal.h"

namespace bmt::nn {

core::kernels::Fp8Format core_format(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? core::kernels::Fp8Format::kE4M3 : core::kernels::Fp8Format::kE5M2;
}

at::ScalarType fp8_dtype(Fp8Format f) { return f == Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2; }

}  // namespace bmt::nn
