#include "bmt/nn/tp_ops.h"

#include <torch/autograd.h>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"

namespace bmt::tp {
namespace {

enum Kind : int64_t { kCopy, kReduce, kGatherLast, kSplitLast, kGatherRows, kReduceScatterRows, kSplitRows,
              kGatherRowsReplicated };

const char* kind_name(int64_t k) {
  static const char* names[] = {"copy_to_tp", "reduce_from_tp", "gather_last_dim", "split_last_dim",
                                "gather_rows", "reduce_scatter_rows", "split_rows",
                                "gather_rows_replicated"};
  return names[k];
}

// The forward of `kind` without autograd.
at::Tensor apply_raw(int64_t kind, const at::Tensor& x) {
  const Config& cfg = config();
  core::Communicator& comm = *cfg.tp_comm;
  const int tp = comm.size(), r = comm.rank();
  auto check_rows = [&](const char* what) {
    BMT_CHECK(x.dim() >= 1 && x.size(0) % tp == 0, "tp::", kind_name(kind), " (rank ", cfg.rank, "): dim 0 of ",
              what, " (shape ", x.sizes(), ") must be divisible by tp_size ", tp, " (sequence-parallel activations "
              "are split along dim 0; pad the batch * sequence rows)");
  };
  switch (kind) {
    case kCopy: return x;
    case kReduce: return distributed::raw_all_reduce(x, core::ReduceOp::kSum, comm);
    case kGatherLast: {
      at::Tensor all = distributed::raw_all_gather(x, comm);  // (tp, *x)
      return at::cat(all.unbind(0), -1);
    }
    case kSplitLast: {
      BMT_CHECK(x.dim() >= 1 && x.size(-1) % tp == 0, "tp::split_last_dim (rank ", cfg.rank, "): the last dim of ",
                "shape ", x.sizes(), " must be divisible by tp_size ", tp);
      const int64_t n = x.size(-1) / tp;
      return x.narrow(-1, n * r, n).contiguous();
    }
    case kGatherRows:
    case kGatherRowsReplicated: {
      at::Tensor all = distributed::raw_all_gather(x, comm);
      std::vector<int64_t> shape = x.sizes().vec();
      shape[0] *= tp;
      return all.view(shape);
    }
    case kReduceScatterRows:
      check_rows("the input");
      return distributed::raw_reduce_scatter(x, core::ReduceOp::kSum, comm);
    case kSplitRows: {
      check_rows("the input");
      const int64_t n = x.size(0) / tp;
      return x.narrow(0, n * r, n).contiguous();
    }
  }
  BMT_ASSERT(false, "unknown tp op");
}

int64_t backward_kind(int64_t kind) {
  switch (kind) {
    case kCopy: return kReduce;
    case kReduce: return kCopy;
    case kGatherLast: return kSplitLast;
    case kSplitLast: return kGatherLast;
    case kGatherRows: return kReduceScatterRows;
    case kReduceScatterRows: return kGatherRows;
    case kSplitRows: return kGatherRows;
    case kGatherRowsReplicated: return kSplitRows;
  }
  BMT_ASSERT(false, "unknown tp op");
}

struct TpFn : torch::autograd::Function<TpFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t kind) {
    ctx->saved_data["kind"] = kind;
    at::Tensor y = apply_raw(kind, x.contiguous());
    return y.is_same(x) ? x.view_as(x) : y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t kind = backward_kind(ctx->saved_data["kind"].toInt());
    at::Tensor g = apply_raw(kind, grads[0].contiguous());
    return {g, at::Tensor()};
  }
};

at::Tensor run(int64_t kind, const at::Tensor& x) {
  if (config().tp_size == 1) return x;
  return TpFn::apply(x, kind);
}

}  // namespace

at::Tensor copy_to_tp(const at::Tensor& x) { return run(kCopy, x); }
at::Tensor reduce_from_tp(const at::Tensor& x) { return run(kReduce, x); }
at::Tensor gather_last_dim(const at::Tensor& x) { return run(kGatherLast, x); }
at::Tensor split_last_dim(const at::Tensor& x) { return run(kSplitLast, x); }
at::Tensor gather_rows(const at::Tensor& x) { return run(kGatherRows, x); }
at::Tensor reduce_scatter_rows(const at::Tensor& x) { return run(kReduceScatterRows, x); }
at::Tensor split_rows(const at::Tensor& x) { return run(kSplitRows, x); }
at::Tensor gather_rows_replicated(const at::Tensor& x) { return run(kGatherRowsReplicated, x); }

}  // namespace bmt::tp
