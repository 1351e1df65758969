// FP8 scaling and casting for FP8 GEMMs (per-tensor, dynamic). Torch-free.
//
//   amax  = max |x| over the tensor                          (NaN anywhere: amax is NaN; else inf if any inf)
//   scale = fp8_max / amax, inv_scale = 1 / scale            (amax 0: both 1; amax not finite: both NaN)
//   q     = fp8(saturate(x * scale))                         (round to nearest even, finite values clamped to
//                                                             +-fp8_max; NaN stays NaN)
// The three statistics live in one float[3] in device memory {amax, scale, inv_scale}: the host never reads them,
// so no step synchronises and CUDA graphs can capture the casts. A non-finite amax gives NaN scales on purpose:
// every product of that GEMM is NaN, the loss or gradients are non-finite and the step's inf/NaN check skips it.
//
// The cast writes the row-major copy q[r, c], the transposed copy qt[c, r], or both in one pass over x (the
// backward GEMMs need column-major operands). Bytes are the OCP FP8 encodings of torch's float8_e4m3fn (max 448,
// no inf) and float8_e5m2 (max 57344). Invariants: both variants give bit-identical bytes and statistics (the CUDA
// reduction is a max, independent of order); 64-bit indexing.
#pragma once

#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core::kernels {

enum class Fp8Format : int8_t { kE4M3 = 0, kE5M2 = 1 };

// Largest finite value: 448 (E4M3) or 57344 (E5M2).
float fp8_max(Fp8Format format);
const char* fp8_format_name(Fp8Format format);
// One value's encoding (saturating, round to nearest even) and decoding: the CPU twin's element ops, for tests.
uint8_t float_to_fp8(float x, Fp8Format format);
float fp8_to_float(uint8_t bits, Fp8Format format);

// Where the statistics live in the float[3].
constexpr int kFp8Amax = 0, kFp8Scale = 1, kFp8InvScale = 2;

// stats[0..2] = {amax, scale, inv_scale} of x (numel elements of fp32 / bf16 / fp16).
void fp8_scale_cpu(const void* x, DType dtype, int64_t numel, Fp8Format format, float* stats);
// q (rows x cols) and / or qt (cols x rows) from x (rows x cols, row-major) with stats[kFp8Scale]; either output
// may be null.
void fp8_cast_cpu(const void* x, DType dtype, int64_t rows, int64_t cols, const float* stats, Fp8Format format,
                  uint8_t* q, uint8_t* qt);

// scale and inv_scale of one amax, as the statistics above define them.
void fp8_scale_of(float amax, Fp8Format format, float* scale, float* inv_scale);

// Rowwise scaling: each row of q (rows x cols) cast with its own row's amax, q_inv[r] its inverse scale; each row
// of qt (cols x rows, the transposed copy: a column of x) with that column's amax, qt_inv[c]. Either pair may be
// null. Per row the statistics follow the per-tensor rules (a row with a NaN has NaN scales, a zero row scale 1).
void fp8_cast_rowwise_cpu(const void* x, DType dtype, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q,
                          float* q_inv, uint8_t* qt, float* qt_inv);

// Device memory (builds with BMT_WITH_CUDA); `stats` is device memory. `workspace`: fp8_scale_workspace_numel
// uint32 words (one per block of the first reduction stage). `inv_scale_copy` (may be null): one more float of
// device memory that also receives inv_scale, for a consumer that wants it in an allocation of its own (the GEMM).
int64_t fp8_scale_workspace_numel(int64_t numel);
void fp8_scale_cuda(const void* x, DType dtype, int64_t numel, Fp8Format format, float* stats, uint32_t* workspace,
                    void* stream, float* inv_scale_copy = nullptr);
// fp8_scale_cuda's second stage alone: the statistics from `n` partial maxima (bits of |x|, a NaN above every
// number) that a kernel which read x anyway wrote (column_sum_cuda's amax_partial); n = 0 is an all-zero tensor.
void fp8_scale_from_partials_cuda(const uint32_t* partial, int64_t n, Fp8Format format, float* stats, void* stream,
                                  float* inv_scale_copy = nullptr);
void fp8_cast_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, const float* stats, Fp8Format format,
                   uint8_t* q, uint8_t* qt, void* stream);
// fp8_cast_rowwise_cpu on the device; `workspace`: `cols` uint32 words (the column maxima, when qt is asked for).
void fp8_cast_rowwise_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q,
                           float* q_inv, uint8_t* qt, float* qt_inv, uint32_t* workspace, void* stream);

// Delayed scaling's cast (fp8_delayed_scale_internal.h): q and / or qt as fp8_cast_* write them, but with the scale
// *scale (device memory for the CUDA variant, known before x exists), and max |x| folded into *amax_io in the same
// pass over x (*amax_io = max(*amax_io, amax), a NaN above every number, as fp8_scale_* order them). The amax pass
// of a dynamic cast is gone; the delayed state's record then turns *amax_io into the next scale.
void fp8_cast_delayed_cpu(const void* x, DType dtype, int64_t rows, int64_t cols, const float* scale, float* amax_io,
                          Fp8Format format, uint8_t* q, uint8_t* qt);
void fp8_cast_delayed_cuda(const void* x, DType dtype, int64_t rows, int64_t cols, const float* scale,
                           float* amax_io, Fp8Format format, uint8_t* q, uint8_t* qt, void* stream);

// qt (cols x rows) = the transpose of q (rows x cols, row-major), byte for byte: the transposed copy of FP8 bytes a
// producer wrote itself (a GEMM's FP8 output), which the wgrad GEMM needs K-major.
void fp8_transpose_cpu(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt);
void fp8_transpose_cuda(const uint8_t* q, int64_t rows, int64_t cols, uint8_t* qt, void* stream);

}  // namespace bmt::core::kernels
