// FP8 casts of 2-D tensors (the kernels' LibTorch face: core/kernels/fp8_cast*, raw pointers and a stream beneath):
// the dynamic per-tensor and per-row casts, the delayed-scale casts of GEMM inputs and of gradients (with the bias
// gradient's column sums from the same read), each writing the row-major copy, the transposed copy or both. The FP8
// linears (nn/fp8_linear.h) and the FP8 MLP (nn/fp8_mlp.h) cast their GEMM operands with these; exposed for tests.
#pragma once

#include <ATen/ATen.h>

#include "bmt/nn/fp8_format.h"

namespace bmt::nn {

class Fp8DelayedScale;

// A 2-D tensor cast to FP8.
struct Fp8Tensor {
  at::Tensor data;    // [rows, cols] float8 (undefined unless asked for)
  at::Tensor data_t;  // [cols, rows] float8, the transposed copy (undefined unless asked for)
  at::Tensor stats;   // float32 [3] on the tensor's device: amax, scale, inverse scale
  // The inverse scale in an allocation of its own (0-dim float32, same device): what _scaled_mm reads. A view into
  // `stats` (a 4-byte-aligned pointer inside another allocation) is suspected of the CUBLAS_STATUS_NOT_SUPPORTED
  // an H200 gave; a one-element copy rules it out.
  at::Tensor inv;
  // Rowwise scaling (fp8_cast_rowwise): inv is float32 [rows], data's inverse scale per row, and inv_t [cols],
  // data_t's per row (a column of the matrix); stats is undefined.
  at::Tensor inv_t;
  const at::Tensor& inv_scale() const { return inv; }
  const at::Tensor& inv_scale_t() const { return inv_t.defined() ? inv_t : inv; }
};
Fp8Tensor fp8_cast(const at::Tensor& matrix, Fp8Format format, bool rowwise, bool transposed);
// Per-row scales: `row_major` asks for data (each row by its own amax), `transposed` for data_t (each column of the
// matrix by its own amax).
Fp8Tensor fp8_cast_rowwise(const at::Tensor& matrix, Fp8Format format, bool row_major, bool transposed);

// A GEMM input cast to FP8 with a delayed scale (nn/fp8_delayed_scale.h; per-tensor scaling): the cast kernel takes
// state.scale() and folds the tensor's amax into the state in the same pass, so the dynamic cast's amax pass over the
// bf16 tensor is gone; the call's inverse scale is state.record()'s. Before the state's first record: a dynamic cast
// whose amax is recorded. The FP8 linears' operands use it when given their states (Fp8LinearScales) and
// fp8_delayed_inputs_enabled().
Fp8Tensor fp8_cast_delayed(const at::Tensor& matrix, Fp8DelayedScale& state, bool row_major, bool transposed);

// A gradient's cast with its delayed scale (state: of the gradient's format), with its column sums in *db (sum_dtype;
// db null: none): g = dy, or with pre defined g = gelu_backward(dy, pre, "tanh") (the tanh-GELU MLP's d pre). On CUDA
// one kernel reads dy (and pre) once and writes the FP8 copies asked for and the sums
// (core/kernels/fp8_cast_grad_internal.h): no amax pass, and d pre never exists in dtype. Before the state's first
// record: the dynamic cast (fp8_cast_grad's), its amax recorded. The FP8 linears' backward uses it for dy when given
// their Fp8LinearScales and fp8_delayed_grads_enabled().
Fp8Tensor fp8_cast_grad_delayed(const at::Tensor& dy, const at::Tensor& pre, Fp8DelayedScale& state, bool row_major,
                                bool transposed, at::Tensor* db, at::ScalarType sum_dtype);
// fp8_cast_grad_delayed of dy = cat(pieces, 1) (2-D pieces of one row count and equal widths), read in place on CUDA
// where the kernel takes them (fp8_cast_grad_parts_cuda_applies), else concatenated first.
Fp8Tensor fp8_cast_grad_delayed_parts(at::TensorList pieces, Fp8DelayedScale& state, bool row_major,
                                      bool transposed, at::Tensor* db, at::ScalarType sum_dtype);

// The FP8 MLP's GELU gradient, c_fc's bias gradient and d pre's amax in one kernel (docs/design.md, "FP8 linears"):
// BMT_FP8_DGELU_FUSED=1 (the default) | 0 (torch's gelu_backward, then the column sum), or set here.
bool fp8_dgelu_fused_enabled();
void set_fp8_dgelu_fused_enabled(bool enabled);

}  // namespace bmt::nn
