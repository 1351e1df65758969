#include "bmt/nn/parallel_layers.h"

#include <ostream>
#include <string>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/nn/tp_layer_ops.h"
#include "bmt/nn/tp_ops.h"
#include "bmt/nn/tp_overlap.h"

namespace bmt::nn {
namespace {

void check_divisible(const char* layer, const char* what, int64_t n) {
  const Config& cfg = config();
  BMT_CHECK(n > 0, layer, ": ", what, " must be positive, got ", n);
  BMT_CHECK(n % cfg.tp_size == 0, layer, " (rank ", cfg.rank, "): ", what, " = ", n, " is not divisible by tp_size ",
            cfg.tp_size, "; choose a tp_size that divides it");
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, bool with_bias, at::ScalarType dtype,
                                                   bool gather_out, bool gather_in, InitMethod weight_init,
                                                   int64_t groups)
    : in_features(in), out_features(out), split_groups(groups), gather_output(gather_out), gather_input(gather_in) {
  BMT_CHECK(in > 0, "nn::ColumnParallelLinear: in_features must be positive, got ", in);
  BMT_CHECK(groups >= 1 && out % groups == 0, "nn::ColumnParallelLinear: out_features = ", out,
            " is not a multiple of split_groups = ", groups);
  // Gathered features would come out rank-major, not in the logical (block-major) order.
  BMT_CHECK(groups == 1 || !gather_out || config().tp_size == 1, "nn::ColumnParallelLinear: gather_output with "
            "split_groups = ", groups, " is not supported; gather each block's output instead");
  check_divisible("nn::ColumnParallelLinear", groups > 1 ? "out_features / split_groups" : "out_features",
                  out / groups);
  out_features_per_partition = out / config().tp_size;
  weight = register_parameter("weight", TensorParallelParameter({out, in}, 0, dtype, std::move(weight_init), true,
                                                                "nn::ColumnParallelLinear weight", groups));
  if (with_bias)
    bias = register_parameter("bias", TensorParallelParameter({out}, 0, dtype, init::zeros(), true,
                                                              "nn::ColumnParallelLinear bias", groups));
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return column_parallel_linear(x, gathered(weight), bias.defined() ? gathered(bias) : at::Tensor(), gather_input,
                                gather_output, tp::overlap_chunks(), fp8, &fp8_scales);
}

at::Tensor ColumnParallelLinearImpl::input_of(const at::Tensor& x) const {
  return gather_input ? tp::gather_rows(x) : tp::copy_to_tp(x);
}

at::Tensor ColumnParallelLinearImpl::forward_input(const at::Tensor& input) {
  at::Tensor y =
      linear_or_fp8(input, gathered(weight), bias.defined() ? gathered(bias) : at::Tensor(), fp8, true, &fp8_scales);
  return gather_output ? tp::gather_last_dim(y) : y;
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& os) const {
  os << "bmt::nn::ColumnParallelLinear(in_features=" << in_features << ", out_features=" << out_features
     << ", out_features_per_partition=" << out_features_per_partition
     << (split_groups > 1 ? ", split_groups=" + std::to_string(split_groups) : std::string()) << ", bias=" << bias.defined()
     << ", gather_input=" << gather_input << ", gather_output=" << gather_output << ")";
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, bool with_bias, at::ScalarType dtype,
                                             bool split_in, bool all_reduce_out, InitMethod weight_init)
    : in_features(in), out_features(out), split_input(split_in), all_reduce_output(all_reduce_out) {
  check_divisible("nn::RowParallelLinear", "in_features", in);
  BMT_CHECK(out > 0, "nn::RowParallelLinear: out_features must be positive, got ", out);
  in_features_per_partition = in / config().tp_size;
  weight = register_parameter("weight", TensorParallelParameter({out, in}, 1, dtype, std::move(weight_init), true,
                                                                "nn::RowParallelLinear weight"));
  if (with_bias) {
    bias = register_parameter("bias", DistributedParameter({out}, dtype, init::zeros()));
    // Added after the reduction: identical gradients with an all-reduced output, partial ones (each rank's rows)
    // with a reduce-scattered output (BMTrain reduced neither over tp, so its copies drifted apart).
    set_tp_grad_reduce(bias, row_parallel_bias_grad_reduce(all_reduce_output));
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  return row_parallel_linear(x, gathered(weight), bias.defined() ? gathered(bias) : at::Tensor(), split_input,
                             all_reduce_output, tp::overlap_chunks(), fp8, &fp8_scales);
}

void RowParallelLinearImpl::pretty_print(std::ostream& os) const {
  os << "bmt::nn::RowParallelLinear(in_features=" << in_features << ", out_features=" << out_features
     << ", in_features_per_partition=" << in_features_per_partition << ", bias=" << bias.defined()
     << ", split_input=" << split_input << ", all_reduce_output=" << all_reduce_output << ")";
}

VPEmbeddingImpl::VPEmbeddingImpl(int64_t vocab, int64_t dim, at::ScalarType dtype, InitMethod weight_init,
                                 std::optional<bool> seq_parallel)
    : vocab_size(vocab), embedding_size(dim), sequence_parallel(seq_parallel.value_or(config().sequence_parallel)) {
  check_divisible("nn::VPEmbedding", "vocab_size", vocab);
  BMT_CHECK(dim > 0, "nn::VPEmbedding: embedding_size must be positive, got ", dim);
  vocab_per_partition = vocab / config().tp_size;
  vocab_begin = vocab_per_partition * config().tp_rank;
  weight = register_parameter("weight", TensorParallelParameter({vocab, dim}, 0, dtype, std::move(weight_init), true,
                                                                "nn::VPEmbedding weight"));
}

at::Tensor VPEmbeddingImpl::forward(const at::Tensor& ids, const at::Tensor& gathered_weight) {
  return vocab_parallel_lookup(ids, gathered_weight.defined() ? gathered_weight : gathered(weight), sequence_parallel);
}

at::Tensor VPEmbeddingImpl::forward_replicated_ids(const at::Tensor& ids, const at::Tensor& gathered_weight) {
  return vocab_parallel_lookup_replicated_ids(ids, gathered_weight.defined() ? gathered_weight : gathered(weight),
                                              sequence_parallel);
}

at::Tensor VPEmbeddingImpl::projection(const at::Tensor& x, const at::Tensor& gathered_weight) {
  return vocab_parallel_projection(x, gathered_weight.defined() ? gathered_weight : gathered(weight),
                                   sequence_parallel, fp8, &fp8_scales);
}

void VPEmbeddingImpl::pretty_print(std::ostream& os) const {
  os << "bmt::nn::VPEmbedding(vocab_size=" << vocab_size << ", embedding_size=" << embedding_size
     << ", vocab_per_partition=" << vocab_per_partition << ", sequence_parallel=" << sequence_parallel << ")";
}

}  // namespace bmt::nn
