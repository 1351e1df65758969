// The casts nn::fp8_linear and nn::fp8_gelu_mlp share beyond the public ones (defined in fp8_cast.cpp).
#pragma once

#include <ATen/ATen.h>

#include "bmt/nn/fp8_cast.h"

namespace bmt::nn {

// fp32, bf16 and fp16: the dtypes the casts read
bool fp8_supported_dtype(at::ScalarType t);

// fp8_cast (per tensor, `format`) or fp8_cast_rowwise (kRow: E4M3 whatever `format` says, as _scaled_mm's rowwise
// GEMMs take).
Fp8Tensor fp8_cast_as(Fp8Scaling scaling, const at::Tensor& m, Fp8Format format, bool row_major, bool transposed);

// fp8_cast of a matrix whose values an earlier per-tensor cast (`earlier`, its stats and inv) already scaled: the cast
// alone, sharing those statistics (a weight's transposed copy in the backward: the forward took its amax). The same
// bytes as fp8_cast when the values are the same; the caller vouches for that.
Fp8Tensor fp8_cast_known_scale(const at::Tensor& matrix, Fp8Format format, bool rowwise, bool transposed,
                               const Fp8Tensor& earlier);

// A weight's transposed E4M3 copy for the backward's dgrad GEMM: with the forward cast's statistics where it kept them
// (forward.stats defined: fp8_cast_known_scale), else cast afresh (fp8_cast_as).
Fp8Tensor fp8_cast_weight_t(Fp8Scaling scaling, const at::Tensor& weight, const Fp8Tensor& forward);

// dy's FP8 copies as fp8_cast_as gives them and, with db, its column sums in sum_dtype (the bias gradient, what
// nn::column_sum gives). On CUDA with per-tensor scales the column-sum kernel also takes dy's amax, so the cast reads
// dy once instead of twice (amax pass, cast pass); the bytes, statistics and sums are the same either way. Neither
// copy asked for: no cast (an empty Fp8Tensor), only the sums.
Fp8Tensor fp8_cast_grad(Fp8Scaling scaling, const at::Tensor& dy, Fp8Format format, bool row_major, bool transposed,
                        at::Tensor* db, at::ScalarType sum_dtype);

// The tanh-GELU MLP's d pre = dmid * gelu'(pre) cast as fp8_cast_grad casts a gradient, with c_fc's bias gradient in
// db: on CUDA with per-tensor scales one kernel writes d pre, its column sums and its amax partials (nn::
// dgelu_column_sum), so d pre is read once more (the cast) instead of three times, when fp8_dgelu_fused_enabled();
// elsewhere at::gelu_backward then fp8_cast_grad. Same bytes and statistics either way (up to the
// rounding of gelu' in fp32).
Fp8Tensor fp8_cast_dgelu_grad(Fp8Scaling scaling, at::Tensor dmid, const at::Tensor& pre, Fp8Format format,
                              bool row_major, bool transposed, at::Tensor* db, at::ScalarType sum_dtype);

}  // namespace bmt::nn
