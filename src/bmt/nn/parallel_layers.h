// Tensor-parallel layers (BMTrain's bmt.nn names and options) over the tp group of init_distributed(tp_size).
// Weights are TensorParallelParameters (split over tp, each piece ZeRO-sharded over tp_zero_comm), so
// bmt::state_dict returns the full unsplit tensors under the usual keys; replicated parameters (the row-parallel
// bias) have their gradients combined over tp (see parameter.h). Layouts and gradient conventions: tp_ops.h.
//
//   ColumnParallelLinear  weight (out/tp, in), bias (out/tp).  Input: gather_input = true (BMTrain's default,
//                         sequence parallel): rows split over tp, all-gathered first; false: replicated input.
//                         Output: this rank's out/tp features, or all of them (gather_output, replicated).
//                         split_groups > 1 (a fused projection such as Q/K/V: 3): the out features are that many
//                         equal blocks, each split over tp, so this rank's features are its slice of every block,
//                         in block order (the state_dict keeps the unsplit (out, in) layout).
//   RowParallelLinear     weight (out, in/tp), bias (out) replicated.  Input: this rank's in/tp features (the
//                         output of a column-parallel layer), or (split_input, BMTrain's) all features with rows
//                         split over tp: the rows are all-gathered and this rank keeps its feature slice. Output:
//                         reduce-scattered along rows (default, sequence parallel) or all-reduced
//                         (all_reduce_output, replicated); the bias is added after the reduction.
//   VPEmbedding           vocabulary-parallel table (vocab/tp, dim). forward(ids), BMTrain's: each tp rank looks up
//                         its own ids (they may differ per rank; sequence_parallel: they are different tokens, and
//                         every rank's table gradient is summed into the slice's owner) in the all-gathered table.
//                         forward_replicated_ids(ids): ids the same on every tp rank, rows without gathering the
//                         table, reduce-scattered along dim 0 (sequence_parallel) or all-reduced. projection(x):
//                         logits of this rank's vocabulary slice for the vocab-parallel FusedCrossEntropy; x rows
//                         split (sequence parallel: all-gathered first; 3+ dims come back as BMTrain's
//                         (x.size(0), -1, vocab/tp)) or replicated. Alias: ParallelEmbedding.
// The forwards are nn/tp_layer_ops.h's functions (shared with the Python package).
// Sizes that tp_size does not divide are rejected with an error naming the layer and the sizes.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>

#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/params/parameter.h"

namespace bmt::nn {

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, bool bias = true,
                           at::ScalarType dtype = at::kFloat, bool gather_output = false, bool gather_input = true,
                           InitMethod weight_init = init::normal(0.0, 0.02), int64_t split_groups = 1);
  at::Tensor forward(const at::Tensor& x);
  // forward() in two halves, so several column-parallel layers reading the same x communicate once:
  // input_of(x) all-gathers the rows (gather_input) or marks x replicated; forward_input(input_of(x)) == forward(x).
  at::Tensor input_of(const at::Tensor& x) const;
  at::Tensor forward_input(const at::Tensor& input);
  void pretty_print(std::ostream& os) const override;
  int64_t in_features, out_features, out_features_per_partition, split_groups;
  bool gather_output, gather_input;
  bool fp8 = false;  // this rank's GEMM in FP8 (nn::fp8_linear; tp_layer_ops.h), set before training
  Fp8LinearScales fp8_scales;  // its operands' delayed scales (BMT_FP8_DELAYED_INPUTS; not in checkpoints)
  at::Tensor weight, bias;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, bool bias = true,
                        at::ScalarType dtype = at::kFloat, bool split_input = false, bool all_reduce_output = false,
                        InitMethod weight_init = init::normal(0.0, 0.02));
  at::Tensor forward(const at::Tensor& x);
  void pretty_print(std::ostream& os) const override;
  int64_t in_features, out_features, in_features_per_partition;
  bool split_input, all_reduce_output;
  bool fp8 = false;  // this rank's GEMM in FP8 (nn::fp8_linear; tp_layer_ops.h), set before training
  Fp8LinearScales fp8_scales;  // its operands' delayed scales (BMT_FP8_DELAYED_INPUTS; not in checkpoints)
  at::Tensor weight, bias;
};
TORCH_MODULE(RowParallelLinear);

class VPEmbeddingImpl : public torch::nn::Module {
 public:
  // sequence_parallel defaults to config().sequence_parallel.
  VPEmbeddingImpl(int64_t vocab_size, int64_t embedding_size, at::ScalarType dtype = at::kFloat,
                  InitMethod weight_init = init::normal(0.0, 0.02), std::optional<bool> sequence_parallel = {});
  // Reuses an already gathered weight when given (one gather for the lookup and the tied projection).
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& gathered_weight = {});
  at::Tensor forward_replicated_ids(const at::Tensor& ids, const at::Tensor& gathered_weight = {});
  // Logits of this rank's vocabulary slice, reusing an already gathered weight when given.
  at::Tensor projection(const at::Tensor& x, const at::Tensor& gathered_weight = {});
  void pretty_print(std::ostream& os) const override;
  int64_t vocab_size, embedding_size, vocab_per_partition, vocab_begin;
  bool sequence_parallel;
  bool fp8 = false;  // this rank's projection GEMM in FP8 (nn::linear_or_fp8), as EmbeddingImpl::fp8
  Fp8LinearScales fp8_scales;  // the projection's delayed scales (as EmbeddingImpl's; not in checkpoints)
  at::Tensor weight;  // (vocab/tp, embedding_size)
};
TORCH_MODULE(VPEmbedding);
using ParallelEmbedding = VPEmbedding;
using ParallelEmbeddingImpl = VPEmbeddingImpl;

}  // namespace bmt::nn
