#include "bmt/nn/tp_layer_ops.h"

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/nn/tp_ops.h"
#include "bmt/nn/tp_overlap.h"

namespace bmt::nn {
namespace {

void check_features(const char* op, const at::Tensor& x, const at::Tensor& weight, const char* hint = "") {
  BMT_CHECK(weight.defined() && weight.dim() == 2, op, " (rank ", config().rank, "): the weight must be a 2-dim "
            "tensor, got ", weight.defined() ? weight.sizes() : at::IntArrayRef{});
  BMT_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), op, " (rank ", config().rank, "): input has ",
            x.dim() >= 1 ? x.size(-1) : 0, " features (shape ", x.sizes(), "), expected ", weight.size(1),
            " (this rank's weight is ", weight.sizes(), ")", hint);
}

// BMTrain's split_input: x holds all `per * tp` features in the sequence-parallel layout; its rows are all-gathered
// and this rank keeps its feature slice. The narrow's backward puts this rank's slice into zeros, and the gather's
// reduce-scatter sums the ranks' slices into each rank's rows: the complete gradient of x.
at::Tensor split_input_rows(const char* op, const at::Tensor& x, int64_t per) {
  const Config& cfg = config();
  BMT_CHECK(x.dim() >= 1 && x.size(-1) == per * cfg.tp_size, op, " (rank ", cfg.rank, "): split_input expects all ",
            per * cfg.tp_size, " input features (in_features), got shape ", x.sizes());
  if (cfg.tp_size == 1) return x;
  return tp::gather_rows(x).narrow(-1, per * cfg.tp_rank, per);
}

bool overlapped(int64_t chunks) { return chunks > 0 && config().tp_size > 1; }

}  // namespace

at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                  bool gather_input, bool gather_output, int64_t overlap_chunks, bool fp8,
                                  Fp8LinearScales* scales) {
  check_features("ColumnParallelLinear", x, weight);
  at::Tensor y;
  if (gather_input && overlapped(overlap_chunks) && !fp8)  // the all-gather overlapped with the GEMM
    y = tp::gather_rows_linear(x, weight, bias, overlap_chunks);
  else
    y = linear_or_fp8(gather_input ? tp::gather_rows(x) : tp::copy_to_tp(x), weight, bias, fp8, true, scales);
  return gather_output ? tp::gather_last_dim(y) : y;
}

at::Tensor row_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               bool split_input, bool all_reduce_output, int64_t overlap_chunks, bool fp8,
                               Fp8LinearScales* scales) {
  BMT_CHECK(weight.defined() && weight.dim() == 2, "RowParallelLinear: the weight must be a 2-dim tensor");
  at::Tensor input = split_input ? split_input_rows("RowParallelLinear", x, weight.size(1)) : x;
  check_features("RowParallelLinear", input, weight,
                 split_input ? "" : " = in_features / tp_size (pass split_input=true for inputs with all features)");
  at::Tensor y;
  if (!all_reduce_output && overlapped(overlap_chunks) && !fp8)
    y = tp::linear_reduce_scatter_rows(input, weight, overlap_chunks);  // chunked GEMM + reduce-scatter, overlapped
  else if (all_reduce_output)
    y = tp::reduce_from_tp(linear_or_fp8(input, weight, {}, fp8, true, scales));  // (no bias: at::linear)
  else
    y = tp::reduce_scatter_rows(linear_or_fp8(input, weight, {}, fp8, true, scales));
  return bias.defined() ? y + bias : y;
}

at::Tensor vocab_parallel_lookup(const at::Tensor& ids, const at::Tensor& weight, bool sequence_parallel) {
  BMT_CHECK(!at::isFloatingType(ids.scalar_type()), "VPEmbedding (rank ", config().rank, "): ids must be an "
            "integer tensor, got ", ids.scalar_type(), " (pass projection=True to compute logits)");
  if (config().tp_size == 1) return at::embedding(weight, ids);
  const at::Tensor table = sequence_parallel ? tp::gather_rows(weight) : tp::gather_rows_replicated(weight);
  return at::embedding(table, ids);
}

at::Tensor vocab_parallel_lookup_replicated_ids(const at::Tensor& ids, const at::Tensor& weight,
                                                bool sequence_parallel) {
  const Config& cfg = config();
  if (cfg.tp_size == 1) return at::embedding(weight, ids);
  // Ids outside this rank's range look up row 0 and are zeroed; the sum over tp ranks restores every row, and
  // the backward gives each rank the gradient of every token that hit its range (also other ranks' rows).
  const int64_t per = weight.size(0);
  at::Tensor local = ids - per * cfg.tp_rank;
  at::Tensor mine = (local >= 0).logical_and(local < per);
  at::Tensor rows = at::embedding(weight, local.masked_fill(mine.logical_not(), 0));
  rows = rows * mine.unsqueeze(-1).to(rows.scalar_type());
  return sequence_parallel ? tp::reduce_scatter_rows(rows) : tp::reduce_from_tp(rows);
}

at::Tensor vocab_parallel_projection(const at::Tensor& x, const at::Tensor& weight, bool sequence_parallel,
                                     bool fp8, Fp8LinearScales* scales) {
  check_features("VPEmbedding projection", x, weight);
  if (!sequence_parallel) return linear_or_fp8(tp::copy_to_tp(x), weight, at::Tensor(), fp8, true, scales);
  at::Tensor y = linear_or_fp8(tp::gather_rows(x), weight, at::Tensor(), fp8, true, scales);
  // BMTrain views the gathered rows as (x.size(0), -1, ·): the same memory as (tp · x.size(0), ...).
  return x.dim() >= 3 ? y.view({x.size(0), -1, y.size(-1)}) : y;
}

at::Tensor op_parallel_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                              bool gather_input, bool gather_output, bool split_input, TpReduce reduce,
                              int64_t overlap_chunks) {
  BMT_CHECK(weight.defined() && weight.dim() == 2, "OpParallelLinear: the weight must be a 2-dim tensor");
  at::Tensor y;
  if (gather_input && split_input) {
    y = linear(split_input_rows("OpParallelLinear", x, weight.size(1)), weight, bias);
  } else if (split_input) {
    const int64_t tp = config().tp_size;
    BMT_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1) * tp, "OpParallelLinear (rank ", config().rank,
              "): split_input expects all ", weight.size(1) * tp, " input features, got shape ", x.sizes());
    y = linear(tp::split_last_dim(x), weight, bias);
  } else if (gather_input) {
    check_features("OpParallelLinear", x, weight);
    y = overlapped(overlap_chunks) ? tp::gather_rows_linear(x, weight, bias, overlap_chunks)
                                   : linear(tp::gather_rows(x), weight, bias);
  } else {
    check_features("OpParallelLinear", x, weight);
    // Without a reduction the output's features are this rank's and x feeds every rank: its gradient is summed.
    y = linear(reduce == TpReduce::kNone ? tp::copy_to_tp(x) : x, weight, bias);
  }
  if (gather_output) y = tp::gather_last_dim(y);
  if (reduce == TpReduce::kAllReduce) return tp::reduce_from_tp(y);
  if (reduce == TpReduce::kReduceScatter) return tp::reduce_scatter_rows(y);
  return y;
}

TpGradReduce row_parallel_bias_grad_reduce(bool all_reduce_output) {
  return all_reduce_output ? TpGradReduce::kAvg : TpGradReduce::kSum;
}

}  // namespace bmt::nn
