// Delayed scaling's bookkeeping (TransformerEngine's recipe) for a tensor whose producer writes it in FP8 itself, so
// its scale must be known before it exists: the FP8 MLP's GELU output, written by c_fc's GEMM. Torch-free.
//
// State, all float32 in device memory (the host never reads it: no sync, CUDA graphs capture the calls):
//   history[len]   the amaxes of the last len calls, newest first (0: none yet)
//   scale, inv     the scale the next producer writes with and its inverse: fp8_scale_of(max(history))
//   amax           where the producer folds the max |v| of its output (0 on entry: the record leaves it so)
// One record, after each producer call:
//   call_inv = amax finite ? inv : NaN   the inverse scale this call's bytes were written with, for their consumers;
//                                        NaN for a non-finite output (its bytes saturated: inf is not an FP8 value),
//                                        so that the consumers' products are NaN and the step's inf/NaN check skips
//                                        the step, as a dynamic cast's NaN scale does
//   history  = [amax finite ? amax : 0, history[0 .. len-2]]   (a non-finite amax would poison len steps' scales)
//   scale, inv = fp8_scale_of(max(history)),  amax = 0
// Values above fp8_max / scale saturate: the recipe's bet is that an amax moves little from step to step.
#pragma once

#include <cstdint>

#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels {

struct Fp8DelayedState {
  float* history = nullptr;
  int64_t len = 0;
  float* scale = nullptr;
  float* inv = nullptr;
  float* amax = nullptr;
  Fp8Format format = Fp8Format::kE4M3;
};

void fp8_delayed_record_cpu(const Fp8DelayedState& s, float* call_inv);
// One single-block kernel on `stream`; every pointer is device memory.
void fp8_delayed_record_cuda(const Fp8DelayedState& s, float* call_inv, void* stream);

}  // namespace bmt::core::kernels
