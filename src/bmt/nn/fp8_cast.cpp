#include "bmt/nn/fp8_cast.h"
#include "bmt/nn/fp8_cast_internal.h"

#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_grad_internal.h"
#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_format_internal.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace bmt::nn {
namespace {

namespace k = core::kernels;

// BMT_FP8_AMAX_FROM_SUM=0: a gradient's amax by its own pass even where its bias gradient's sum reads it (the
// baseline of that fusion's benchmark rows)
EnvSwitch g_amax_from_sum("BMT_FP8_AMAX_FROM_SUM", true);
// BMT_FP8_DGELU_FUSED: the FP8 MLP's GELU gradient, bias gradient and amax by one kernel (on: its CUDA tests passed on
// an H100 in session 25, +1% at gpt-1.3b); =0: torch's gelu_backward, then the column sum and the cast
EnvSwitch g_dgelu_fused("BMT_FP8_DGELU_FUSED", true);

// An FP8 cast's outputs in `format` on like's device: data (rows x cols) where row_major, data_t (cols x rows) where
// transposed, with per-row inverse scales (inv, inv_t) for rowwise scaling.
Fp8Tensor fp8_outputs(const at::Tensor& like, int64_t rows, int64_t cols, Fp8Format format, bool row_major,
                      bool transposed, bool rowwise_inv = false) {
  const auto opts = like.options().dtype(fp8_dtype(format));
  const auto f32 = like.options().dtype(at::kFloat);
  Fp8Tensor r;
  if (row_major) r.data = at::empty({rows, cols}, opts);
  if (transposed) r.data_t = at::empty({cols, rows}, opts);
  if (rowwise_inv && row_major) r.inv = at::empty({rows}, f32);
  if (rowwise_inv && transposed) r.inv_t = at::empty({cols}, f32);
  return r;
}

// An output's bytes, what the kernels write (null where that layout was not asked for)
uint8_t* fp8_bytes(const at::Tensor& t) { return t.defined() ? static_cast<uint8_t*>(t.data_ptr()) : nullptr; }

}  // namespace

bool fp8_supported_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

Fp8Tensor fp8_cast_as(Fp8Scaling scaling, const at::Tensor& m, Fp8Format format, bool row_major, bool transposed) {
  return scaling == Fp8Scaling::kRow ? fp8_cast_rowwise(m, Fp8Format::kE4M3, row_major, transposed)
                                     : fp8_cast(m, format, row_major, transposed);
}

namespace {

// fp8_cast; amax_partials (CUDA, defined): the partial maxima of |matrix| a kernel that read it already wrote
// (nn::column_sum's), so the scale reduces those instead of reading the matrix again; known (defined): the
// statistics and inverse scale of an earlier cast of the same values, so no scale pass at all; delayed (ready, of
// `format`): its scale, the amax folded into it by the cast, the inverse scale its record gives (no statistics)
Fp8Tensor cast_per_tensor(const at::Tensor& matrix, Fp8Format format, bool rowwise, bool transposed,
                          const at::Tensor& amax_partials, const Fp8Tensor* known = nullptr,
                          Fp8DelayedScale* delayed = nullptr) {
  BMT_CHECK(matrix.dim() == 2, "nn::fp8_cast: expected a 2-D tensor, got ", matrix.dim(), " dimensions");
  BMT_CHECK(fp8_supported_dtype(matrix.scalar_type()), "nn::fp8_cast: dtype ", matrix.scalar_type(),
            " is not fp32, bf16 or fp16");
  const at::Tensor m = matrix.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  Fp8Tensor r = fp8_outputs(m, rows, cols, format, rowwise, transposed);
  uint8_t *q = fp8_bytes(r.data), *qt = fp8_bytes(r.data_t);
  if (!delayed) r.stats = known ? known->stats : at::empty({3}, m.options().dtype(at::kFloat));
  const core::DType dt = to_core_dtype(m.scalar_type());
  const k::Fp8Format f = core_format(format);
  const float* delayed_scale = delayed ? delayed->scale().data_ptr<float>() : nullptr;
  float* delayed_amax = delayed ? delayed->amax().data_ptr<float>() : nullptr;
  if (!m.is_cuda()) {
    if (delayed) {
      k::fp8_cast_delayed_cpu(m.data_ptr(), dt, rows, cols, delayed_scale, delayed_amax, f, q, qt);
      r.inv = delayed->record();
      return r;
    }
    if (!known) k::fp8_scale_cpu(m.data_ptr(), dt, m.numel(), f, r.stats.data_ptr<float>());
    k::fp8_cast_cpu(m.data_ptr(), dt, rows, cols, r.stats.data_ptr<float>(), f, q, qt);
    r.inv = known ? known->inv : r.stats.select(0, 2).clone();
    return r;
  }
#ifdef BMT_WITH_CUDA
  c10::cuda::CUDAGuard guard(m.device());
  void* stream = current_stream_handle(m);
  if (delayed) {
    k::fp8_cast_delayed_cuda(m.data_ptr(), dt, rows, cols, delayed_scale, delayed_amax, f, q, qt, stream);
    r.inv = delayed->record();
    return r;
  }
  if (known) {  // the statistics of an earlier cast of the same values: the cast alone
    r.inv = known->inv;
  } else {
    r.inv = at::empty({}, r.stats.options());  // written by the scale kernel itself (no copy kernel)
    if (amax_partials.defined()) {
      k::fp8_scale_from_partials_cuda(static_cast<const uint32_t*>(amax_partials.data_ptr()), amax_partials.numel(),
                                      f, r.stats.data_ptr<float>(), stream, r.inv.data_ptr<float>());
    } else {
      // (from the caching allocator: ordered on this stream, and in a CUDA graph's pool when captured)
      const at::Tensor ws = at::empty({k::fp8_scale_workspace_numel(m.numel())}, m.options().dtype(at::kInt));
      k::fp8_scale_cuda(m.data_ptr(), dt, m.numel(), f, r.stats.data_ptr<float>(),
                        static_cast<uint32_t*>(ws.data_ptr()), stream, r.inv.data_ptr<float>());
    }
  }
  k::fp8_cast_cuda(m.data_ptr(), dt, rows, cols, r.stats.data_ptr<float>(), f, q, qt, stream);
  return r;
#else
  BMT_ERROR("nn::fp8_cast: a CUDA tensor, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
}

}  // namespace

Fp8Tensor fp8_cast(const at::Tensor& matrix, Fp8Format format, bool rowwise, bool transposed) {
  return cast_per_tensor(matrix, format, rowwise, transposed, at::Tensor());
}

Fp8Tensor fp8_cast_known_scale(const at::Tensor& matrix, Fp8Format format, bool rowwise, bool transposed,
                               const Fp8Tensor& earlier) {
  BMT_CHECK(earlier.stats.defined() && earlier.inv.defined() && earlier.inv.dim() == 0,
            "nn::fp8_cast_known_scale: needs the statistics of a per-tensor cast");
  return cast_per_tensor(matrix, format, rowwise, transposed, at::Tensor(), &earlier);
}

Fp8Tensor fp8_cast_weight_t(Fp8Scaling scaling, const at::Tensor& weight, const Fp8Tensor& forward) {
  return forward.stats.defined() ? fp8_cast_known_scale(weight, Fp8Format::kE4M3, false, true, forward)
                                 : fp8_cast_as(scaling, weight, Fp8Format::kE4M3, false, true);
}

Fp8Tensor fp8_cast_grad(Fp8Scaling scaling, const at::Tensor& dy, Fp8Format format, bool row_major, bool transposed,
                        at::Tensor* db, at::ScalarType sum_dtype) {
  const bool cast = row_major || transposed;
  if (db) {
    if (cast && scaling == Fp8Scaling::kTensor && dy.is_cuda() && g_amax_from_sum.enabled()) {
      at::Tensor partials;
      *db = column_sum(dy, sum_dtype, &partials);
      return cast_per_tensor(dy, format, row_major, transposed, partials);
    }
    *db = column_sum(dy, sum_dtype);
  }
  return cast ? fp8_cast_as(scaling, dy, format, row_major, transposed) : Fp8Tensor();
}

Fp8Tensor fp8_cast_dgelu_grad(Fp8Scaling scaling, at::Tensor dmid, const at::Tensor& pre, Fp8Format format,
                              bool row_major, bool transposed, at::Tensor* db, at::ScalarType sum_dtype) {
  if (db && (row_major || transposed) && scaling == Fp8Scaling::kTensor && dmid.is_cuda() &&
      g_amax_from_sum.enabled() && g_dgelu_fused.enabled()) {
    at::Tensor partials;
    auto [dpre, sums] = dgelu_column_sum(dmid, pre, sum_dtype, &partials);
    dmid.reset();  // (its bytes back to the allocator before the cast's)
    *db = std::move(sums);
    return cast_per_tensor(dpre, format, row_major, transposed, partials);
  }
  at::Tensor dpre = at::gelu_backward(dmid, pre, "tanh");
  dmid.reset();
  return fp8_cast_grad(scaling, dpre, format, row_major, transposed, db, sum_dtype);
}

Fp8Tensor fp8_cast_delayed(const at::Tensor& matrix, Fp8DelayedScale& state, bool row_major, bool transposed) {
  if (!state.ready()) {  // (the first call: a dynamic cast, its amax the state's first record)
    Fp8Tensor r = fp8_cast(matrix, state.format(), row_major, transposed);
    state.record_amax(r.stats.select(0, k::kFp8Amax));
    return r;
  }
  BMT_CHECK(state.scale().device() == matrix.device(), "nn::fp8_cast_delayed: the delayed scale is on ",
            state.scale().device(), ", the tensor on ", matrix.device(), " (one state per tensor and device)");
  return cast_per_tensor(matrix, state.format(), row_major, transposed, at::Tensor(), nullptr, &state);
}


namespace {

// The delayed cast of dy = cat(pieces, 1) (pre: the tanh-GELU MLP's, one piece only), for both public forms: one
// kernel over the pieces where they are on CUDA (and where the kernel takes them), the twin on CPUs, the separate
// ops over the concatenation elsewhere, the dynamic cast before the state's first record.
Fp8Tensor cast_grad_delayed(at::TensorList pieces, const at::Tensor& pre, Fp8DelayedScale& state, bool row_major,
                            bool transposed, at::Tensor* db, at::ScalarType sum_dtype) {
  const at::Tensor& first = pieces[0];
  const auto whole = [&] { return pieces.size() == 1 ? first : at::cat(pieces, 1); };
  const bool cast = row_major || transposed;
  if (!cast || !state.ready()) {  // (the first call: the dynamic cast, its amax the state's first record)
    Fp8Tensor r = pre.defined()
                      ? fp8_cast_dgelu_grad(Fp8Scaling::kTensor, first, pre, state.format(), row_major, transposed, db,
                                            sum_dtype)
                      : fp8_cast_grad(Fp8Scaling::kTensor, whole(), state.format(), row_major, transposed, db,
                                      sum_dtype);
    if (cast) state.record_amax(r.stats.select(0, k::kFp8Amax));
    return r;
  }
  BMT_CHECK(state.scale().device() == first.device(), "nn::fp8_cast_grad_delayed: the delayed scale is on ",
            state.scale().device(), ", the gradient on ", first.device(), " (one state per tensor and device)");
  BMT_CHECK(fp8_supported_dtype(first.scalar_type()) && (!pre.defined() || pre.scalar_type() == first.scalar_type()),
            "nn::fp8_cast_grad_delayed: dtype ", first.scalar_type(), " is not fp32, bf16 or fp16 (or pre's differs)");
  std::vector<at::Tensor> ps;
  const void* ptrs[k::kFp8CastGradMaxParts] = {};
  for (size_t i = 0; i < pieces.size(); ++i) ps.push_back(pieces[i].contiguous()), ptrs[i] = ps.back().data_ptr();
  const at::Tensor p = pre.defined() ? pre.contiguous() : at::Tensor();
  const void* pre_ptr = p.defined() ? p.data_ptr() : nullptr;
  const int parts = static_cast<int>(ps.size());
  const int64_t rows = first.size(0), cols = first.size(1) * parts;
#ifdef BMT_WITH_CUDA
  // (checked before the outputs exist: fresh allocations are aligned, so null stands in for them)
  if (first.is_cuda() && !(pre_ptr ? k::fp8_cast_grad_cuda_applies(rows, cols, ptrs[0], pre_ptr, nullptr, nullptr)
                                   : k::fp8_cast_grad_parts_cuda_applies(rows, cols, ptrs, parts, nullptr, nullptr))) {
    c10::cuda::CUDAGuard guard(first.device());
    const at::Tensor d = p.defined() ? at::gelu_backward(first, p, "tanh") : whole();
    if (db) *db = column_sum(d, sum_dtype);
    return cast_per_tensor(d, state.format(), row_major, transposed, at::Tensor(), nullptr, &state);
  }
#endif
  Fp8Tensor r = fp8_outputs(first, rows, cols, state.format(), row_major, transposed);
  uint8_t *q = fp8_bytes(r.data), *qt = fp8_bytes(r.data_t);
  if (db) *db = at::empty({cols}, first.options().dtype(sum_dtype));
  const core::DType dt = to_core_dtype(first.scalar_type()), sum_dt = to_core_dtype(sum_dtype);
  const k::Fp8Format f = core_format(state.format());
  const float* scale = state.scale().data_ptr<float>();
  float* amax = state.amax().data_ptr<float>();
  void* sums = db ? db->data_ptr() : nullptr;
  if (!first.is_cuda()) {
    if (pre_ptr)
      k::fp8_cast_grad_delayed_cpu(ptrs[0], pre_ptr, dt, rows, cols, scale, amax, f, q, qt, sums, sum_dt);
    else
      k::fp8_cast_grad_parts_delayed_cpu(ptrs, parts, dt, rows, cols, scale, amax, f, q, qt, sums, sum_dt);
    r.inv = state.record();
    return r;
  }
#ifdef BMT_WITH_CUDA
  c10::cuda::CUDAGuard guard(first.device());
  const at::Tensor ws = db ? at::empty({k::fp8_cast_grad_workspace_numel(rows, cols)}, first.options().dtype(at::kFloat))
                           : at::Tensor();
  float* w = db ? ws.data_ptr<float>() : nullptr;
  void* stream = current_stream_handle(first);
  if (pre_ptr)
    k::fp8_cast_grad_delayed_cuda(ptrs[0], pre_ptr, dt, rows, cols, scale, amax, f, q, qt, sums, sum_dt, w, stream);
  else
    k::fp8_cast_grad_parts_delayed_cuda(ptrs, parts, dt, rows, cols, scale, amax, f, q, qt, sums, sum_dt, w, stream);
  r.inv = state.record();
  return r;
#else
  BMT_ERROR("nn::fp8_cast_grad_delayed: a CUDA tensor, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
}

}  // namespace

Fp8Tensor fp8_cast_grad_delayed(const at::Tensor& dy, const at::Tensor& pre, Fp8DelayedScale& state, bool row_major,
                                bool transposed, at::Tensor* db, at::ScalarType sum_dtype) {
  BMT_CHECK(dy.dim() == 2 && (!pre.defined() || pre.sizes() == dy.sizes()), "nn::fp8_cast_grad_delayed: expected a "
            "2-D gradient (and pre of its shape), got ", dy.sizes(), pre.defined() ? " and " : "",
            pre.defined() ? pre.sizes() : at::IntArrayRef());
  return cast_grad_delayed({dy}, pre, state, row_major, transposed, db, sum_dtype);
}

Fp8Tensor fp8_cast_grad_delayed_parts(at::TensorList pieces, Fp8DelayedScale& state, bool row_major,
                                      bool transposed, at::Tensor* db, at::ScalarType sum_dtype) {
  BMT_CHECK(!pieces.empty() && static_cast<int>(pieces.size()) <= k::kFp8CastGradMaxParts,
            "nn::fp8_cast_grad_delayed_parts: 1 to ", k::kFp8CastGradMaxParts, " pieces, got ", pieces.size());
  for (const at::Tensor& p : pieces)
    BMT_CHECK(p.dim() == 2 && p.sizes() == pieces[0].sizes() && p.scalar_type() == pieces[0].scalar_type() &&
                  p.device() == pieces[0].device(),
              "nn::fp8_cast_grad_delayed_parts: the pieces must be 2-D, of one shape, dtype and device (got ",
              p.sizes(), " and ", pieces[0].sizes(), ")");
  return cast_grad_delayed(pieces, at::Tensor(), state, row_major, transposed, db, sum_dtype);
}

Fp8Tensor fp8_cast_rowwise(const at::Tensor& matrix, Fp8Format format, bool row_major, bool transposed) {
  BMT_CHECK(matrix.dim() == 2, "nn::fp8_cast_rowwise: expected a 2-D tensor, got ", matrix.dim(), " dimensions");
  BMT_CHECK(fp8_supported_dtype(matrix.scalar_type()), "nn::fp8_cast_rowwise: dtype ", matrix.scalar_type(),
            " is not fp32, bf16 or fp16");
  const at::Tensor m = matrix.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  Fp8Tensor r = fp8_outputs(m, rows, cols, format, row_major, transposed, /*rowwise_inv=*/true);
  uint8_t *q = fp8_bytes(r.data), *qt = fp8_bytes(r.data_t);
  float* q_inv = row_major ? r.inv.data_ptr<float>() : nullptr;
  float* qt_inv = transposed ? r.inv_t.data_ptr<float>() : nullptr;
  const core::DType dt = to_core_dtype(m.scalar_type());
  if (!m.is_cuda()) {
    k::fp8_cast_rowwise_cpu(m.data_ptr(), dt, rows, cols, core_format(format), q, q_inv, qt, qt_inv);
    return r;
  }
#ifdef BMT_WITH_CUDA
  c10::cuda::CUDAGuard guard(m.device());
  const at::Tensor ws = transposed ? at::empty({cols}, m.options().dtype(at::kInt)) : at::Tensor();
  k::fp8_cast_rowwise_cuda(m.data_ptr(), dt, rows, cols, core_format(format), q, q_inv, qt, qt_inv,
                           transposed ? static_cast<uint32_t*>(ws.data_ptr()) : nullptr, current_stream_handle(m));
  return r;
#else
  BMT_ERROR("nn::fp8_cast_rowwise: a CUDA tensor, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
}

bool fp8_dgelu_fused_enabled() { return g_dgelu_fused.enabled(); }

void set_fp8_dgelu_fused_enabled(bool enabled) { g_dgelu_fused.set(enabled); }

}  // namespace bmt::nn
