// The forwards of the tensor-parallel layers as functions of their (gathered) tensors: one implementation for
// the C++ modules (parallel_layers.h, which pass gathered(weight)) and the Python package's bmt.nn layers (the
// same functions, bound in python/csrc/bind_tp.cpp, given the DistributedParameters a DistributedModule hands
// out). Semantics are BMTrain 1.0.1's (bmtrain/nn/*.py); activations in its sequence-parallel layout are split
// along dim 0 over tp, rank r holding chunk r (tp_ops.h), and gradients follow tp_ops.h's convention (one loss,
// computed identically on every tp rank). tp_size == 1: the dense ops.
//
//   column_parallel_linear  weight (out/tp, in), bias (out/tp) or undefined. gather_input: x's rows are split over
//                           tp and all-gathered first (output rows: tp · x's); else x is replicated. gather_output:
//                           all out features (gathered along the last dim), else this rank's out/tp.
//   row_parallel_linear     weight (out, in/tp), bias (out) replicated, added after the reduction. split_input
//                           (BMTrain's): x holds all in features in the sequence-parallel layout; its rows are
//                           all-gathered and this rank keeps its in/tp feature slice. Else x is this rank's in/tp
//                           features. Output: reduce-scattered along rows, or all-reduced (all_reduce_output).
//   vocab_parallel_lookup   BMTrain's VPEmbedding(ids): every tp rank looks up its OWN ids (any shape, they may
//                           differ per rank) in the whole table, whose vocabulary slices are all-gathered. The table
//                           gradient: sequence_parallel (each rank's ids are different tokens): every rank's table
//                           gradient is summed into the slice's owner (BMTrain keeps only the owner's, dropping the
//                           other ranks' tokens); otherwise (the ids are the same on every tp rank) the owner's own.
//   vocab_parallel_lookup_replicated_ids  the same rows without gathering the table, for ids that are the same on
//                           every tp rank (the C++ example models' token rows): each rank looks up its vocabulary
//                           range, the partial rows are reduce-scattered along dim 0 (sequence_parallel: this rank's
//                           rows) or all-reduced (every row).
//   vocab_parallel_projection  logits of this rank's vocabulary slice, weight (vocab/tp, dim). sequence_parallel:
//                           x's rows are split over tp and all-gathered; the logits keep BMTrain's shape
//                           (x.size(0), tp · x.size(1) · ..., vocab/tp) for x of 3 or more dims (the gathered rows in
//                           rank order; for batch 1 the whole sequence) and (tp · rows, vocab/tp) for 2-dim token
//                           rows. Otherwise x is replicated and keeps its shape.
//   op_parallel_linear      BMTrain's OpParallelLinear.apply: x → (gather_input: all-gather rows) → (split_input:
//                           own in-feature slice) → linear(x, w, b) → (gather_output) → (reduce: all-reduce or
//                           reduce-scatter of rows). The bias is added on every rank BEFORE the reduction, as in
//                           BMTrain (a reduced output then holds tp · bias).
// `overlap_chunks` > 0 runs the sequence-parallel GEMMs with their communication overlapped (tp_overlap.h) in that
// many chunks; 0: the separate ops (same values).
#pragma once

#include <ATen/ATen.h>

#include "bmt/params/parameter.h"

namespace bmt::nn {

struct Fp8LinearScales;
enum class TpReduce { kNone, kAllReduce, kReduceScatter };

// fp8: this rank's GEMM is nn::fp8_linear (nn::linear_or_fp8; per-tensor scales from this rank's shard and rows),
// the communication unchanged and not chunked (overlap_chunks is ignored); scales: the layer's delayed scales of its
// GEMM operands on this rank (used under fp8_delayed_inputs_enabled()).
at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                  bool gather_input, bool gather_output, int64_t overlap_chunks = 0, bool fp8 = false,
                                  Fp8LinearScales* scales = nullptr);
at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               bool split_input, bool all_reduce_output, int64_t overlap_chunks = 0, bool fp8 = false,
                               Fp8LinearScales* scales = nullptr);
at::Tensor vocab_parallel_lookup(const at::Tensor& ids, const at::Tensor& weight, bool sequence_parallel);
at::Tensor vocab_parallel_lookup_replicated_ids(const at::Tensor& ids, const at::Tensor& weight,
                                                bool sequence_parallel);
// fp8: this rank's GEMM through nn::linear_or_fp8, as column_parallel_linear's (scales: its delayed scales).
at::Tensor vocab_parallel_projection(const at::Tensor& x, const at::Tensor& weight, bool sequence_parallel,
                                     bool fp8 = false, Fp8LinearScales* scales = nullptr);
at::Tensor op_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                              bool gather_input, bool gather_output, bool split_input, TpReduce reduce,
                              int64_t overlap_chunks = 0);

// How the tp copies of a row-parallel bias combine their gradients: an all-reduced output gives every rank the same,
// complete gradient (averaged: unchanged); a reduce-scattered one gives each rank its rows' part (summed).
TpGradReduce row_parallel_bias_grad_reduce(bool all_reduce_output);

}  // namespace bmt::nn
