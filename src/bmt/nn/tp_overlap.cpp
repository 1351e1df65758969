#include "bmt/nn/tp_overlap.h"

#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <optional>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace bmt::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int64_t> g_chunks{-1};  // -1: not yet read from the environment

// Where one op's collectives run: on CUDA the tp communication stream, ordered against the calling (compute) stream
// by events; on CPU the calling thread (Gloo collectives block, so there is nothing to order).
class Lane {
 public:
  explicit Lane(const at::Tensor& like) {
#ifdef BMT_WITH_CUDA
    if (like.is_cuda()) {
      const Config& cfg = config();
      BMT_CHECK(cfg.tp_comm_stream.has_value(), "tp overlap (rank ", cfg.rank, "): no tp communication stream; "
                "init_distributed on a GPU creates one");
      guard_.emplace(like.device());
      calc_.emplace(c10::cuda::getCurrentCUDAStream(like.device().index()));
      comm_.emplace(c10::cuda::CUDAStream(*cfg.tp_comm_stream));
    }
#else
    (void)like;
#endif
  }
  // The communication stream waits for what the compute stream has queued so far.
  void comm_waits_calc() {
#ifdef BMT_WITH_CUDA
    if (comm_) order(*calc_, *comm_);
#endif
  }
  void calc_waits_comm() {
#ifdef BMT_WITH_CUDA
    if (comm_) order(*comm_, *calc_);
#endif
  }
  core::StreamHandle comm_handle() const {
#ifdef BMT_WITH_CUDA
    if (comm_) return comm_->stream();
#endif
    return nullptr;
  }
  // t is read or written on the communication stream: the allocator must not hand its memory out again before that.
  void used_on_comm(const at::Tensor& t) const {
#ifdef BMT_WITH_CUDA
    if (comm_) t.record_stream(comm_->unwrap());
#else
    (void)t;
#endif
  }

 private:
#ifdef BMT_WITH_CUDA
  static void order(const c10::cuda::CUDAStream& before, const c10::cuda::CUDAStream& after) {
    at::cuda::CUDAEvent e;
    e.record(before);
    e.block(after);
  }
  std::optional<c10::cuda::CUDAGuard> guard_;
  std::optional<c10::cuda::CUDAStream> calc_, comm_;
#endif
};

// out [tp * n, cols]: row block j = (this rank's `local` if j is this rank, else rank j's rows) . b (+ bias). The
// all-gather of `local` runs on the lane while this rank's block is multiplied; *full gets every rank's rows.
at::Tensor gather_then_mm(const at::Tensor& local, const at::Tensor& b, const at::Tensor& bias, at::Tensor* full) {
  core::Communicator& comm = *config().tp_comm;
  check_comm_tensor(local, comm, "tp::gather_rows_linear", "input rows");
  const int tp = comm.size(), r = comm.rank();
  const int64_t n = local.size(0);
  BMT_CHECK(n > 0, "tp overlap (rank ", config().rank, "): no rows to gather");
  Lane lane(local);
  *full = at::empty({tp * n, local.size(1)}, local.options());
  lane.comm_waits_calc();  // `local` was written on the compute stream
  comm.all_gather(local.data_ptr(), full->data_ptr(), local.numel(), to_core_dtype(local.scalar_type()),
                  lane.comm_handle());
  lane.used_on_comm(local);
  lane.used_on_comm(*full);
  at::Tensor out = at::empty({tp * n, b.size(1)}, local.options());
  auto block = [&](int j, const at::Tensor& a) {
    at::Tensor o = out.narrow(0, j * n, n);
    if (bias.defined()) at::addmm_out(o, bias, a, b);
    else at::mm_out(o, a, b);
  };
  block(r, local);  // while the gather runs
  lane.calc_waits_comm();
  for (int j = 0; j < tp; ++j)
    if (j != r) block(j, full->narrow(0, j * n, n));
  return out;
}

// out [n, cols] = this rank's row block of sum over ranks of a . b, a = [tp * n, k]: every rank block cut into
// `chunks` chunks; chunk c's GEMMs on the compute stream, its reduce-scatter on the lane during chunk c + 1's.
at::Tensor mm_then_reduce_scatter(const at::Tensor& a, const at::Tensor& b, int64_t chunks) {
  core::Communicator& comm = *config().tp_comm;
  check_comm_tensor(a, comm, "tp::linear_reduce_scatter_rows", "input rows");
  const int tp = comm.size();
  BMT_CHECK(a.size(0) % tp == 0 && a.size(0) > 0, "tp overlap (rank ", config().rank, "): ", a.size(0),
            " rows do not split over tp_size ", tp, " (sequence-parallel activations are split along dim 0; pad the "
            "batch * sequence rows)");
  const int64_t n = a.size(0) / tp, cols = b.size(1);
  chunks = std::clamp<int64_t>(chunks, 1, n);
  Lane lane(a);
  at::Tensor out = at::empty({n, cols}, a.options());
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * n / chunks, m = (c + 1) * n / chunks - lo;
    if (m == 0) continue;
    at::Tensor part = at::empty({tp, m, cols}, a.options());
    for (int j = 0; j < tp; ++j) {
      at::Tensor dst = part.select(0, j);
      at::mm_out(dst, a.narrow(0, j * n + lo, m), b);
    }
    lane.comm_waits_calc();
    comm.reduce_scatter(part.data_ptr(), out.narrow(0, lo, m).data_ptr(), static_cast<size_t>(m * cols),
                        to_core_dtype(a.scalar_type()), core::ReduceOp::kSum, lane.comm_handle());
    lane.used_on_comm(part);
  }
  lane.used_on_comm(out);
  lane.calc_waits_comm();
  return out;
}

std::vector<int64_t> rows_and_last(at::IntArrayRef sizes, int64_t rows_factor_num, int64_t rows_factor_den,
                                   int64_t last) {
  std::vector<int64_t> s(sizes.begin(), sizes.end());
  s.front() = s.front() * rows_factor_num / rows_factor_den;
  s.back() = last;
  return s;
}

struct GatherRowsLinearFn : torch::autograd::Function<GatherRowsLinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, int64_t chunks) {
    const int64_t in = weight.size(1), out = weight.size(0), tp = config().tp_size;
    const at::Tensor x2 = x.contiguous().view({-1, in});
    at::Tensor full;
    const at::Tensor y = gather_then_mm(x2, weight.t(), bias ? bias->contiguous() : at::Tensor(), &full);
    ctx->save_for_backward({full, weight});
    ctx->saved_data["chunks"] = chunks;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["has_bias"] = bias.has_value();
    return at::_unsafe_view(y, rows_and_last(x.sizes(), tp, 1, out));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &full = saved[0], &weight = saved[1];
    const at::Tensor dy2 = grads[0].contiguous().view({-1, weight.size(0)});
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0))
      dx = mm_then_reduce_scatter(dy2, weight, ctx->saved_data["chunks"].toInt())
               .view(ctx->saved_data["x_sizes"].toIntVector());
    if (ctx->needs_input_grad(1)) dw = dy2.t().mm(full);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2))
      db = nn::column_sum(dy2, weight.scalar_type());
    return {dx, dw, db, at::Tensor()};
  }
};

struct LinearReduceScatterRowsFn : torch::autograd::Function<LinearReduceScatterRowsFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, int64_t chunks) {
    const int64_t in = weight.size(1), out = weight.size(0), tp = config().tp_size;
    BMT_CHECK(x.size(0) % tp == 0, "tp::linear_reduce_scatter_rows (rank ", config().rank, "): dim 0 of the input ",
              "(shape ", x.sizes(), ") must be divisible by tp_size ", tp, " (sequence-parallel activations are split "
              "along dim 0; pad the batch * sequence rows)");
    const at::Tensor x2 = x.contiguous().view({-1, in});
    const at::Tensor y = mm_then_reduce_scatter(x2, weight.t(), chunks);
    ctx->save_for_backward({x2, weight});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return at::_unsafe_view(y, rows_and_last(x.sizes(), 1, tp, out));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &weight = saved[1];
    const at::Tensor dy2 = grads[0].contiguous().view({-1, weight.size(0)});
    at::Tensor dy_full;
    const at::Tensor dx = gather_then_mm(dy2, weight, at::Tensor(), &dy_full);  // (the gather is needed for dw too)
    at::Tensor dw;
    if (ctx->needs_input_grad(1)) dw = dy_full.t().mm(x2);
    return {ctx->needs_input_grad(0) ? dx.view(ctx->saved_data["x_sizes"].toIntVector()) : at::Tensor(), dw,
            at::Tensor()};
  }
};

void check_linear(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  BMT_CHECK(weight.defined() && weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), op, " (rank ",
            config().rank, "): input ", x.sizes(), " does not match weight ",
            weight.defined() ? weight.sizes() : at::IntArrayRef());
}

}  // namespace

at::Tensor gather_rows_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t chunks) {
  check_linear(x, weight, "tp::gather_rows_linear");
  if (config().tp_size == 1) return nn::linear(x, weight, bias);
  return GatherRowsLinearFn::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                                   chunks);
}

at::Tensor linear_reduce_scatter_rows(const at::Tensor& x, const at::Tensor& weight, int64_t chunks) {
  check_linear(x, weight, "tp::linear_reduce_scatter_rows");
  if (config().tp_size == 1) return at::linear(x, weight);
  return LinearReduceScatterRowsFn::apply(x, weight, chunks);
}

int64_t overlap_chunks() {
  int64_t v = g_chunks.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("BMT_TP_OVERLAP_CHUNKS");
    v = 0;
    if (e && *e) {
      char* end = nullptr;
      const long long n = std::strtoll(e, &end, 10);
      BMT_CHECK(end && *end == '\0' && n >= 0 && n <= 64, "BMT_TP_OVERLAP_CHUNKS=", e,
                ": expected a chunk count from 0 (off) to 64");
      v = n;
    }
    g_chunks.store(v, std::memory_order_relaxed);
  }
  return v;
}

void set_overlap_chunks(int64_t chunks) {
  BMT_CHECK(chunks >= 0 && chunks <= 64, "tp::set_overlap_chunks: ", chunks, " is not a chunk count from 0 to 64");
  g_chunks.store(chunks, std::memory_order_relaxed);
}

}  // namespace bmt::tp
