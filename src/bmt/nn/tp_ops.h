// Differentiable tensor-parallel communication over config().tp_comm (identity when tp_size == 1).
//
// Gradient convention (unlike bmt::distributed's sum-over-ranks one): the objective is ONE loss that every rank of
// the tp group computes identically (a replicated loss, as after the vocab-parallel cross-entropy), so a tensor
// that is replicated over the group carries the same, complete gradient on every rank, and a tensor whose copies
// each feed only part of the computation (a column-parallel GEMM's input) carries a partial gradient to be summed.
//
//   Megatron layout (activations replicated over tp):
//     copy_to_tp        forward identity               backward all_reduce(sum)    (entry of a column-parallel GEMM)
//     reduce_from_tp    forward all_reduce(sum)        backward identity           (exit of a row-parallel GEMM)
//     gather_last_dim   forward all_gather, cat dim -1 backward keep own slice     (column-parallel gather_output)
//     split_last_dim    forward keep own slice dim -1  backward all_gather, cat    (row-parallel split_input)
//   Sequence-parallel layout (activations split along dim 0 over tp, rank r holding chunk r):
//     gather_rows         forward all_gather, cat dim 0  backward reduce_scatter(sum) along dim 0
//     reduce_scatter_rows forward reduce_scatter(sum)    backward all_gather along dim 0
//     split_rows          forward keep own chunk         backward all_gather along dim 0
//     gather_rows_replicated  forward all_gather, cat dim 0  backward keep own chunk (the gathered tensor is used
//                         identically on every rank, so each rank's gradient is already complete: BMTrain's
//                         all_gather backward; VPEmbedding's table when the ids are replicated over tp)
// Every op runs on the current stream; dim 0 must be divisible by tp_size where rows are split (clear error).
#pragma once

#include <ATen/ATen.h>

namespace bmt::tp {

at::Tensor copy_to_tp(const at::Tensor& x);
at::Tensor reduce_from_tp(const at::Tensor& x);
at::Tensor gather_last_dim(const at::Tensor& x);
at::Tensor split_last_dim(const at::Tensor& x);
at::Tensor gather_rows(const at::Tensor& x);
at::Tensor reduce_scatter_rows(const at::Tensor& x);
at::Tensor split_rows(const at::Tensor& x);
at::Tensor gather_rows_replicated(const at::Tensor& x);

}  // namespace bmt::tp
