// Sequence-parallel linears whose tensor-parallel communication overlaps their GEMMs (issue 17 item 3).
//
//   gather_rows_linear(x, w, b)        == at::linear(tp::gather_rows(x), w, b)      (ColumnParallelLinear)
//     forward:  the all-gather of x runs on config().tp_comm_stream while this rank's own rows are multiplied,
//               then the other ranks' rows;
//     backward: dx = reduce_scatter_rows(dy . w) in `chunks` row chunks: chunk c's reduce-scatter runs on the
//               communication stream while chunk c + 1's GEMMs run; dw = dy^T . gathered x; db = our column sums.
//   linear_reduce_scatter_rows(x, w)   == tp::reduce_scatter_rows(at::linear(x, w)) (RowParallelLinear)
//     forward:  the chunked GEMM + reduce-scatter above;  backward: gather_rows(dy) overlapped with the GEMM of
//               this rank's own rows, dw = gathered dy^T . x.
// Same values as the separate ops up to GEMM blocking (each output row is one GEMM row either way), same memory
// (the gathered input is what the separate ops save too). On CPU ranks (Gloo, blocking) nothing overlaps; the
// results are the same. Rows (dim 0) split over tp as tp_ops.h's sequence-parallel layout.
//
// Off by default until measured on 2 GPUs: BMT_TP_OVERLAP_CHUNKS=<chunks> (or set_overlap_chunks) turns it on in
// ColumnParallelLinear (gather_input) and RowParallelLinear (reduce-scattered output); 0 = the separate ops.
#pragma once

#include <ATen/ATen.h>

namespace bmt::tp {

at::Tensor gather_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t chunks);
at::Tensor linear_reduce_scatter_rows(const at::Tensor& x, const at::Tensor& weight, int64_t chunks);

// The chunk count the parallel layers use; 0 (the default unless BMT_TP_OVERLAP_CHUNKS is set): no overlap.
int64_t overlap_chunks();
void set_overlap_chunks(int64_t chunks);

}  // namespace bmt::tp
