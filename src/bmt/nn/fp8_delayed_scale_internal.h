// The FP8 pieces of delayed scaling that the FP8 MLP runs (defined in fp8_delayed_scale.cpp).
#pragma once

#include <ATen/ATen.h>

#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/nn/fp8_delayed_scale.h"

namespace bmt::nn {

// fp8_gemm_epilogue writing FP8 (core's Fp8GemmOperands::out_scale): out8 (float8 of state.format()) gets the
// epilogue's values scaled by state.scale(), their amax folded into state.amax(); the caller then calls
// state.record(). kBias or kGeluAuxBias (aux in bias's dtype), no residual. False (nothing done) where cuBLASLt has
// no algorithm.
bool fp8_gemm_epilogue_to_fp8(core::kernels::GemmEpilogue epilogue, const at::Tensor& a, Fp8Format a_format,
                              const at::Tensor& a_inv, const at::Tensor& b, Fp8Format b_format,
                              const at::Tensor& b_inv, bool fast_accum, const at::Tensor& out8,
                              Fp8DelayedScale& state, const at::Tensor& bias, const at::Tensor& aux);

// An autograd node's handle on a delayed scale (a capsule for its saved_data): the node shares the state
// (Fp8DelayedScale::share), so its backward records into it even if the module that owns the state is gone first.
c10::IValue delayed_scale_capsule(const Fp8DelayedScale& state);
// The state a delayed_scale_capsule holds.
Fp8DelayedScale& delayed_scale_of(const c10::IValue& capsule);

// The transposed copy [cols, rows] of a 2-D float8 tensor, byte for byte (core's fp8_transpose).
at::Tensor fp8_transpose(const at::Tensor& q);

}  // namespace bmt::nn
