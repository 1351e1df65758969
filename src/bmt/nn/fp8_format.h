// The FP8 formats and scalings the FP8 layers take (nn/fp8_linear.h, nn/fp8_delayed_scale.h), and their names in
// the torch-free core and in torch.
#pragma once

#include <c10/core/ScalarType.h>

#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::nn {

enum class Fp8Format { kE4M3, kE5M2 };
enum class Fp8Scaling { kTensor, kRow };

// The core kernels' FP8 format, and torch's float8 dtype, of a format.
core::kernels::Fp8Format core_format(Fp8Format f);
at::ScalarType fp8_dtype(Fp8Format f);

}  // namespace bmt::nn
