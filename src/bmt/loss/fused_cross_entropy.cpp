#include "bmt/loss/fused_cross_entropy.h"

#include <torch/autograd.h>

#include "bmt/core/error.h"
#include "bmt/core/kernels/cross_entropy_internal.h"
#include "bmt/core/kernels/thread_pool.h"
#include "bmt/runtime/stream_capture.h"
#include "bmt/runtime/init.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#include <cmath>
#include <mutex>
#include <optional>

#ifdef BMT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace bmt::loss {
namespace {

namespace k = core::kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Where the local columns sit in the vocabulary, and the group that holds the other columns (null: none).
struct VocabSlice {
  int64_t begin = 0, total = 0;
  core::Communicator* comm = nullptr;
};

k::CrossEntropyArgs kernel_args(const at::Tensor& logits, const at::Tensor& target, int64_t vocab_begin,
                                int64_t vocab_total, int64_t ignore_index) {
  k::CrossEntropyArgs a;
  a.logits = logits.data_ptr();
  a.dtype = to_core_dtype(logits.scalar_type());
  a.rows = logits.size(0);
  a.cols = logits.size(1);
  a.target = target.data_ptr<int64_t>();
  a.vocab_begin = vocab_begin;
  a.vocab_total = vocab_total;
  a.ignore_index = ignore_index;
  return a;
}

#ifndef BMT_WITH_CUDA
[[noreturn]] void no_cuda() {
  BMT_ERROR("fused_cross_entropy: CUDA logits, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
}
#endif

void run_stats(const k::CrossEntropyArgs& a, const at::Tensor& logits, at::Tensor& stats) {
  if (logits.is_cuda()) {
#ifdef BMT_WITH_CUDA
    c10::cuda::CUDAGuard guard(logits.device());
    k::cross_entropy_stats_cuda(a, stats.data_ptr<float>(), current_stream_handle(logits));
#else
    no_cuda();
#endif
  } else {
    k::cross_entropy_stats_cpu(a, stats.data_ptr<float>(), k::ThreadPool::global());
  }
}

void run_backward(const k::CrossEntropyArgs& a, const at::Tensor& logits, const at::Tensor& row_max,
                  const at::Tensor& row_sumexp, const at::Tensor& grad_row, float eps, at::Tensor& grad_logits) {
  const float *m = row_max.data_ptr<float>(), *s = row_sumexp.data_ptr<float>(), *g = grad_row.data_ptr<float>();
  if (logits.is_cuda()) {
#ifdef BMT_WITH_CUDA
    c10::cuda::CUDAGuard guard(logits.device());
    k::cross_entropy_backward_cuda(a, m, s, g, eps, grad_logits.data_ptr(), current_stream_handle(logits));
#else
    no_cuda();
#endif
  } else {
    k::cross_entropy_backward_cpu(a, m, s, g, eps, grad_logits.data_ptr(), k::ThreadPool::global());
  }
}

struct FusedCrossEntropyFn : torch::autograd::Function<FusedCrossEntropyFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            int64_t ignore_index, int64_t reduction, double label_smoothing, int64_t vocab_begin,
                            int64_t vocab_total, int64_t comm_ptr, bool inplace) {
    const int64_t n = logits.size(0);
    const auto a = kernel_args(logits, target, vocab_begin, vocab_total, ignore_index);
    at::Tensor stats = at::empty({k::kCrossEntropyNumStats, n}, logits.options().dtype(at::kFloat));
    run_stats(a, logits, stats);
    if (comm_ptr != 0 && n > 0) {
      // M = max_r m_r; shift this rank's sums from m_r to M; then one sum of (S, target logit, Z) (cross_entropy.h).
      auto* comm = reinterpret_cast<core::Communicator*>(comm_ptr);
      core::StreamHandle stream = current_stream_handle(logits);
      float* p = stats.data_ptr<float>();
      at::Tensor m_local = stats[k::kStatMax].clone();
      comm->all_reduce(p, p, static_cast<size_t>(n), core::DType::kFloat32, core::ReduceOp::kMax, stream);
      at::Tensor big_m = stats[k::kStatMax], s = stats[k::kStatSumExp], z = stats[k::kStatShiftedSum];
      at::Tensor same = m_local == big_m;  // also covers -inf == -inf, where m - M would be NaN
      at::Tensor shift = at::where(same, at::zeros({}, m_local.options()), m_local - big_m);
      s.copy_(at::where(same, s, s * at::exp(shift)));
      z.add_(shift * static_cast<float>(logits.size(1)));
      comm->all_reduce(p + n, p + n, static_cast<size_t>(3 * n), core::DType::kFloat32, core::ReduceOp::kSum, stream);
    }
    at::Tensor row_max = stats[k::kStatMax], row_sumexp = stats[k::kStatSumExp];
    const float eps = static_cast<float>(label_smoothing);
    at::Tensor rows_loss = (1.0f - eps) * (row_max - stats[k::kStatTargetLogit]);
    if (eps != 0.0f) rows_loss = rows_loss - eps * (stats[k::kStatShiftedSum] / static_cast<float>(vocab_total));
    rows_loss = rows_loss + at::log(row_sumexp);
    at::Tensor valid = target != ignore_index;
    rows_loss = at::where(valid, rows_loss, at::zeros({}, rows_loss.options()));  // ignored rows have S = 0
    at::Tensor count = valid.sum().to(at::kFloat);

    ctx->save_for_backward({logits, target, row_max, row_sumexp, count});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["vocab_begin"] = vocab_begin;
    ctx->saved_data["vocab_total"] = vocab_total;
    ctx->saved_data["inplace"] = inplace;
    if (static_cast<Reduction>(reduction) == Reduction::kNone) return rows_loss;
    if (static_cast<Reduction>(reduction) == Reduction::kSum) return rows_loss.sum();
    return rows_loss.sum() / count.clamp_min(1.0f);  // mean; no valid row: 0, not NaN
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &target = saved[1], &row_max = saved[2], &row_sumexp = saved[3];
    const int64_t n = logits.size(0);
    at::Tensor g = grads[0].to(at::kFloat);
    auto reduction = static_cast<Reduction>(ctx->saved_data["reduction"].toInt());
    if (reduction == Reduction::kMean) g = g / saved[4].clamp_min(1.0f);
    at::Tensor grad_row = reduction == Reduction::kNone ? g.contiguous() : g.expand({n}).contiguous();
    const auto a = kernel_args(logits, target, ctx->saved_data["vocab_begin"].toInt(),
                               ctx->saved_data["vocab_total"].toInt(), ctx->saved_data["ignore_index"].toInt());
    // In place: each element is read and then overwritten by the same thread (cross_entropy.h), and the logits
    // are not needed after this.
    at::Tensor grad_logits = ctx->saved_data["inplace"].toBool() ? logits
                                                                  : at::empty_like(logits, at::MemoryFormat::Contiguous);
    run_backward(a, logits, row_max, row_sumexp, grad_row,
                 static_cast<float>(ctx->saved_data["label_smoothing"].toDouble()), grad_logits);
    return {grad_logits, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// Throws naming the first target outside [0, vocab_total) that is not ignore_index, if any (error path only).
void throw_bad_target(const at::Tensor& target, int64_t ignore_index, int64_t vocab_total, const char* where) {
  at::Tensor t = target.cpu();
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    BMT_CHECK(p[i] == ignore_index || (p[i] >= 0 && p[i] < vocab_total), "fused_cross_entropy", where, ": target[",
              i, "] = ", p[i], " is outside the vocabulary [0, ", vocab_total, ") and is not ignore_index (",
              ignore_index, "); fix the labels or set options.ignore_index to the padding id");
  BMT_ERROR("fused_cross_entropy", where, ": another tensor-parallel rank has a target outside the vocabulary [0, ",
            vocab_total, ")");
}

at::Tensor bad_target_mask(const at::Tensor& target, int64_t ignore_index, int64_t vocab_total) {
  return (target != ignore_index) & ((target < 0) | (target >= vocab_total));
}

at::Tensor bad_target_count(const at::Tensor& target, int64_t ignore_index, int64_t vocab_total) {
  return bad_target_mask(target, ignore_index, vocab_total).sum();
}

#ifdef BMT_WITH_CUDA
// The target check of CUDA calls without a host synchronisation: the verdict (count, first bad index, its value)
// is copied into pinned memory behind an event, and read at the next call or check_pending_targets(), when it
// is long complete. The bad call itself returns a NaN loss, so the step is visibly wrong before the error.
struct PendingTargetCheck {
  at::Tensor verdict;  // pinned int64 (3)
  std::optional<at::cuda::CUDAEvent> done;
  int64_t vocab_total = 0;
  bool armed = false;
};

PendingTargetCheck& pending_check() {
  // Never destroyed: freeing a pinned buffer during static destruction, after CUDA's stream pool is gone, aborts.
  static auto* check = new PendingTargetCheck;
  return *check;
}
std::mutex& pending_check_mutex() {
  static std::mutex m;
  return m;
}

void resolve_pending_check() {
  std::lock_guard<std::mutex> lock(pending_check_mutex());
  PendingTargetCheck& c = pending_check();
  if (!c.armed) return;
  c.done->synchronize();  // recorded a whole step ago: normally complete already
  c.armed = false;
  const int64_t* v = c.verdict.data_ptr<int64_t>();
  BMT_CHECK(v[0] == 0, "fused_cross_entropy: in an earlier call on CUDA, ", v[0], " target(s) were outside the "
            "vocabulary [0, ", c.vocab_total, ") and not ignore_index, the first target[", v[1], "] = ", v[2],
            " (that call returned a NaN loss); fix the labels or set options.ignore_index to the padding id");
}

void arm_pending_check(const at::Tensor& bad, const at::Tensor& target, int64_t vocab_total) {
  std::lock_guard<std::mutex> lock(pending_check_mutex());
  PendingTargetCheck& c = pending_check();
  if (!c.verdict.defined()) {
    c.verdict = at::empty({3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    c.done.emplace();
  }
  at::Tensor first = bad.numel() > 0 ? bad.to(at::kByte).argmax() : at::zeros({}, target.options());
  // (index_select, not index({first}): indexing by a 0-dim tensor reads it on the host, a sync in the forward)
  at::Tensor value = bad.numel() > 0 ? target.reshape({-1}).index_select(0, first.reshape({1})).squeeze(0)
                                     : at::zeros({}, target.options());
  c.verdict.copy_(at::stack({bad.sum(), first, value}), /*non_blocking=*/true);
  c.done->record(c10::cuda::getCurrentCUDAStream(target.device().index()));
  c.vocab_total = vocab_total;
  c.armed = true;
}
#endif

// Parallel mode: every tp rank must pass the same N, C, dtype and targets, and no rank may hold a bad target.
// One all-reduce(max) of (x, -x) pairs makes every rank see the same verdict, so they all raise the same error.
void check_tp_agreement(const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, int64_t vocab_total,
                        core::Communicator& comm) {
  const int64_t n = logits.size(0), c = logits.size(1), dt = static_cast<int64_t>(logits.scalar_type());
  at::Tensor info = at::cat({at::tensor({n, c, dt}, at::kLong).to(logits.device()), target.sum().view({1}),
                             bad_target_count(target, ignore_index, vocab_total).view({1})});
  info = at::cat({info, -info.narrow(0, 0, 4)}).contiguous();  // built on the device: one sync, below
  comm.all_reduce(info.data_ptr(), info.data_ptr(), 9, core::DType::kInt64, core::ReduceOp::kMax,
                  current_stream_handle(info));
  at::Tensor h = info.cpu();
  const int64_t* v = h.data_ptr<int64_t>();
  const char* names[] = {"row count N", "column count C", "logits dtype", "targets"};
  for (int i = 0; i < 4; ++i)
    BMT_CHECK(v[i] == -v[i + 5], "fused_cross_entropy(parallel=true) on rank ", comm.rank(), " of '", comm.name(),
              "': the tensor-parallel ranks disagree on the ", names[i], " (this rank: logits ", logits.sizes(), " ",
              c10::toString(logits.scalar_type()), "); every tp rank must pass its (N, C) vocabulary slice of the same "
              "logits and the same target");
  if (v[4] > 0) throw_bad_target(target, ignore_index, vocab_total, "(parallel=true)");
}

}  // namespace

void check_pending_targets() {
#ifdef BMT_WITH_CUDA
  resolve_pending_check();
#endif
}

at::Tensor fused_cross_entropy(const at::Tensor& logits_in, const at::Tensor& target,
                               const FusedCrossEntropyOptions& options) {
  BMT_CHECK(logits_in.defined() && target.defined(), "fused_cross_entropy: logits or target is undefined");
  BMT_CHECK(logits_in.dim() == 2, "fused_cross_entropy: logits must be 2-D (N, C), got shape ", logits_in.sizes(),
            "; flatten leading dimensions with .view({-1, C})");
  const auto st = logits_in.scalar_type();
  BMT_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
            "fused_cross_entropy: logits of dtype ", c10::toString(st), " are not supported; use a float dtype");
  BMT_CHECK(target.dim() == 1 && target.size(0) == logits_in.size(0), "fused_cross_entropy: target must be 1-D with ",
            logits_in.size(0), " entries (one per row of the logits), got shape ", target.sizes());
  BMT_CHECK(target.scalar_type() == at::kLong, "fused_cross_entropy: target must be int64, got ",
            c10::toString(target.scalar_type()), "; convert it with .to(torch::kLong)");
  BMT_CHECK(target.device() == logits_in.device(), "fused_cross_entropy: target is on ", target.device().str(),
            " but the logits are on ", logits_in.device().str(), "; move both to the same device");
  BMT_CHECK(logits_in.is_cpu() || logits_in.is_cuda(), "fused_cross_entropy: logits on ", logits_in.device().str(),
            " are not supported (CPU or CUDA only)");
  BMT_CHECK(logits_in.size(1) >= 1, "fused_cross_entropy: the logits have no column (shape ", logits_in.sizes(), ")");
  BMT_CHECK(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0,
            "fused_cross_entropy: label_smoothing must be in [0, 1], got ", options.label_smoothing);
  const int r = static_cast<int>(options.reduction);
  BMT_CHECK(r >= 0 && r <= 2, "fused_cross_entropy: unknown reduction ", r);

  // fp64 is computed in fp32 (the kernels' precision); autograd casts the gradient back.
  at::Tensor logits = (st == at::kDouble ? logits_in.to(at::kFloat) : logits_in).contiguous();
  at::Tensor tgt = target.contiguous();
  const int64_t c = logits.size(1);
  VocabSlice slice{0, c, nullptr};
  at::Tensor bad;  // CUDA, not parallel: the rows whose target is bad, checked on the host one call later
  if (options.parallel) {
    BMT_CHECK(is_initialized(), "fused_cross_entropy(parallel=true) needs the tensor-parallel group: call "
              "bmt::init_distributed (with InitOptions::tp_size) first, or use parallel=false");
    core::Communicator& comm = *config().tp_comm;
    check_comm_tensor(logits, comm, "fused_cross_entropy(parallel=true)", "logits");
    slice = {static_cast<int64_t>(comm.rank()) * c, c * comm.size(), &comm};
    check_tp_agreement(logits, tgt, options.ignore_index, slice.total, comm);
  } else if (logits.is_cuda()) {
#ifdef BMT_WITH_CUDA
    bad = bad_target_mask(tgt, options.ignore_index, c);
    // Under CUDA graph capture the host check can neither wait nor be re-armed by a replay: only the NaN below.
    if (!current_stream_capturing(logits.device())) {
      resolve_pending_check();  // the previous call's verdict (raises for it)
      arm_pending_check(bad, tgt, c);
    }
#endif
  } else if (bad_target_count(tgt, options.ignore_index, c).item<int64_t>() > 0) {
    throw_bad_target(tgt, options.ignore_index, c, "");
  }
  at::Tensor loss = FusedCrossEntropyFn::apply(logits, tgt, options.ignore_index,
                                               static_cast<int64_t>(options.reduction), options.label_smoothing,
                                               slice.begin, slice.total, reinterpret_cast<int64_t>(slice.comm),
                                               options.inplace);
  if (!bad.defined()) return loss;
  // A bad target makes the loss NaN (no host synchronisation here; the error comes at the next call).
  at::Tensor poisoned = options.reduction == Reduction::kNone ? bad : bad.any();
  return at::where(poisoned, at::full({}, std::nanf(""), loss.options()), loss);
}

}  // namespace bmt::loss
