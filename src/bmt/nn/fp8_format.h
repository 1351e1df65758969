// The FP8 formats and scalings the FP8 layers take (nn/fp8_linear.h, nn/fp8_delayed_scale.h), and their torch dtype
// (the core kernels' name of a format: fp8_format_internal.h).
#pragma once

#include <c10/core/ScalarType.h>

namespace bmt::nn {

enum class Fp8Format { kE4M3, kE5M2 };
enum class Fp8Scaling { kTensor, kRow };
// How per-tensor scales are found (nn::fp8_recipe): kCurrent, each cast from its tensor's own amax (a pass over the
// tensor first); kDelayed, from the amaxes of the tensor's last calls (TransformerEngine's recipe: no such pass).
enum class Fp8Recipe { kCurrent, kDelayed };

// torch's float8 dtype of a format.
at::ScalarType fp8_dtype(Fp8Format f);

}  // namespace bmt::nn
