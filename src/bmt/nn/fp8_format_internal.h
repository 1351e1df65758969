// The core kernels' FP8 format of an nn format (the core's header is not installed, so neither is this one).
#pragma once

#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/nn/fp8_format.h"

namespace bmt::nn {

core::kernels::Fp8Format core_format(Fp8Format f);

}  // namespace bmt::nn
