// GEMMs with a fused epilogue: what a GPT block's MLP and residual adds cost in separate elementwise passes
// (bias + GELU after c_fc, GELU's backward and c_fc's bias gradient after c_proj's input-gradient GEMM, the
// residual add after c_proj) done by the GEMM as it writes its output. CUDA: cuBLASLt's BIAS, GELU_AUX_BIAS and
// DGELU_BGRAD epilogues. Torch-free. Why: on the 1.3B step these passes are ~12 ms of 267 ms of kernels
// (H200 profile, 2026-12-01: GELU backward 5.6 ms, residual adds 4.5 ms).
//
// Layout: every matrix is row-major and contiguous, the problem is torch's
//   out[rows, cols] = a[rows, inner] . op(b),  op(b) = b[cols, inner]^T (b_transposed, a Linear's weight) or
//                                                       b[inner, cols]   (not transposed: an input gradient)
// GELU is the tanh approximation (GPT-2's gelu_new; torch's gelu(approximate="tanh")).
//
// FP8 operands (args.fp8 set): a and b hold E4M3 / E5M2 bytes (nn::fp8_cast's layout), each dequantised by one
// float, its per-tensor inverse scale: the product is (a_inv · b_inv) a.op(b), accumulated in fp32, and the epilogue
// runs on it before the one rounding into dtype (the FP8 MLP's GELU, its gradient and the residual add, which
// otherwise cost separate passes over bf16 activations).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "bmt/core/dtype.h"
#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels {

enum class GemmEpilogue : int8_t {
  kBias,         // out = a.op(b) + bias [+ residual]
  kGeluAuxBias,  // aux = a.op(b) + bias (the pre-activation, kept for the backward), out = gelu(aux)
  kDGeluBGrad,   // out = a.op(b) * gelu'(aux) (aux: the forward's pre-activation), bias = sum over rows of out
  kDGelu,        // out = a.op(b) * gelu'(aux), no bias gradient
};
const char* gemm_epilogue_name(GemmEpilogue e);

struct Fp8GemmOperands {
  Fp8Format a_format = Fp8Format::kE4M3, b_format = Fp8Format::kE4M3;
  const float* a_inv_scale = nullptr;  // one float, in the operands' memory (device for CUDA, host for the twin)
  const float* b_inv_scale = nullptr;
  bool fast_accum = false;  // Hopper's faster, coarser accumulation (forward GEMMs; the twin ignores it)
  // FP8 output (out_scale set; kBias without a residual, or kGeluAuxBias): out holds out_format bytes,
  //   out = fp8(saturate(*out_scale * v)),  *out_amax = max |v| over the matrix (before the scale),
  // v the epilogue's value (gelu(aux) for kGeluAuxBias; aux stays in dtype). The scale is known before the GEMM
  // (delayed scaling: nn::Fp8DelayedScale), so the producer writes the FP8 bytes the next GEMM reads and no cast
  // pass reads the bf16 matrix. *out_amax must hold 0 on entry (the CUDA GEMM may fold its tiles' maxima into it).
  const float* out_scale = nullptr;
  float* out_amax = nullptr;
  Fp8Format out_format = Fp8Format::kE4M3;
};

struct GemmEpilogueArgs {
  int64_t rows = 0, cols = 0, inner = 0;
  const void* a = nullptr;  // [rows, inner]
  const void* b = nullptr;  // [cols, inner] if b_transposed, else [inner, cols]
  bool b_transposed = true;
  void* out = nullptr;  // [rows, cols] (FP8 bytes with fp8->out_scale)
  DType dtype = DType::kBFloat16;  // of every matrix and vector here (but FP8 operands and an FP8 out)
  GemmEpilogue epilogue = GemmEpilogue::kBias;
  void* bias = nullptr;            // [cols]: read (kBias, kGeluAuxBias; may be null for kBias) or written (kDGeluBGrad)
  void* aux = nullptr;             // [rows, cols]: written (kGeluAuxBias) or read (kDGeluBGrad, kDGelu)
  const void* residual = nullptr;  // [rows, cols], added to the output (kBias only; may be null)
  const Fp8GemmOperands* fp8 = nullptr;  // set: a and b are FP8 (dtype is then the other matrices' and vectors')
  // CUDA, > 1: on a problem's first use, time up to this many of cuBLASLt's candidate algorithms on these operands
  // and keep the fastest for every later call (one host sync, once per problem; skipped while the stream is being
  // captured and when out is the residual, which a trial would add twice). 0 or 1: the heuristic's first choice.
  int autotune_candidates = 0;
};

// Checks shapes, pointers and the epilogue's operands; throws naming what is missing.
void check_gemm_epilogue_args(const GemmEpilogueArgs& args, const char* op);

float gelu_tanh(float x);
float gelu_tanh_grad(float x);  // d gelu_tanh / dx

// CPU twin (the test reference): fp64 dot products, the epilogue in fp64 on the unrounded sum, each output rounded
// into dtype (through fp32: rarely one ulp from a single rounding); the pre-activation is rounded to dtype when stored in aux, and DGELU reads aux as stored.
// kDGeluBGrad's bias is the fp64 sum of the unrounded outputs. fp32, bf16 and fp16.
void gemm_epilogue_cpu(const GemmEpilogueArgs& args);

// CUDA variant (builds with BMT_WITH_CUDA): bf16 and fp16, fp32 accumulation, asynchronous on `stream`.
// Returns false, having done nothing, when cuBLASLt has no algorithm for the problem (or the operands' alignment,
// or cols % 8 != 0 with an aux matrix; with FP8 operands: b not transposed, a dimension not a multiple of 16, both
// E5M2): the caller computes it another way. Throws on a cuBLASLt error.
// `workspace`: device memory of workspace_nbytes (kGemmEpilogueWorkspaceNbytes is plenty), free for the call.
constexpr size_t kGemmEpilogueWorkspaceNbytes = size_t{32} << 20;
bool gemm_epilogue_cuda(const GemmEpilogueArgs& args, void* workspace, size_t workspace_nbytes, void* stream);

}  // namespace bmt::core::kernels
