#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_linear_internal.h"

#include <torch/autograd.h>

#include <algorithm>
#include <optional>

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/core/kernels/fp8_cast_grad_internal.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_delayed_scale_internal.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/fused_linear_internal.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/nn/gemm_epilogue_args_internal.h"
#include "bmt/nn/shape_internal.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace bmt::nn {
namespace {

namespace k = core::kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

EnvChoice<Fp8Format, 2> g_grad_format("BMT_FP8_GRAD", {{{"e5m2", Fp8Format::kE5M2}, {"e4m3", Fp8Format::kE4M3}}});
// BMT_FP8_AMAX_FROM_SUM=0: a gradient's amax by its own pass even where its bias gradient's sum reads it (the
// baseline of that fusion's benchmark rows)
EnvSwitch g_amax_from_sum("BMT_FP8_AMAX_FROM_SUM", true);
// BMT_FP8_DGELU_FUSED: the FP8 MLP's GELU gradient, bias gradient and amax by one kernel (on: its CUDA tests passed on
// an H100 in session 25, +1% at gpt-1.3b); =0: torch's gelu_backward, then the column sum and the cast
EnvSwitch g_dgelu_fused("BMT_FP8_DGELU_FUSED", true);
// BMT_FP8_DELAYED_INPUTS: the linears' inputs and weights cast with their delayed scales (off until measured)
EnvSwitch g_delayed_inputs("BMT_FP8_DELAYED_INPUTS", false);
// BMT_FP8_DELAYED_GRADS: the linears' output gradients cast with their delayed scales (off until measured)
EnvSwitch g_delayed_grads("BMT_FP8_DELAYED_GRADS", false);
EnvChoice<Fp8Scaling, 2> g_scaling("BMT_FP8_SCALING", {{{"tensor", Fp8Scaling::kTensor}, {"row", Fp8Scaling::kRow}}});

bool supported_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

struct Fp8LinearFn : torch::autograd::Function<Fp8LinearFn> {
  // parts > 1: the output as that many pieces of its last dimension (fp8_linear_parts), their gradients read in place
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                               int64_t grad_format, int64_t scaling_id, bool want_dx, bool want_dw, bool compute,
                               Fp8LinearScales* scales, Fp8DelayedScale* grad_scale, int64_t parts) {
    const int64_t in = weight.size(1), out = weight.size(0);
    const auto scaling = static_cast<Fp8Scaling>(scaling_id);
    const at::Tensor x2 = x.contiguous().view({-1, in});
    // compute = false (a recompute's tail): no forward GEMM, so neither x's row-major bytes nor W's cast
    Fp8Tensor xq;
    // (delayed scales: per tensor, E4M3, each amax taken by the cast itself; the weight's transposed copy for dgrad
    // in the same pass)
    const bool delayed = scaling == Fp8Scaling::kTensor && e4m3_scales(scales);
    if (compute || want_dw)
      xq = delayed ? fp8_cast_delayed(x2, scales->input, compute, want_dw)
                   : fp8_cast_as(scaling, x2, Fp8Format::kE4M3, compute, want_dw);
    at::Tensor y;
    Fp8Tensor wq;
    if (compute) {
      wq = delayed ? fp8_cast_delayed(weight, scales->weight, true, want_dx)
                   : fp8_cast_as(scaling, weight, Fp8Format::kE4M3, true, false);
      const at::Tensor res2 = residual ? residual->contiguous().view({-1, out}) : at::Tensor();
      // a residual: added by the GEMM's epilogue (per tensor, CUDA, where cuBLASLt has an algorithm), else after
      bool done = false;
      if (res2.defined() && scaling == Fp8Scaling::kTensor && x.is_cuda()) {
        y = at::empty({x2.size(0), out}, x.options());
        done = fp8_gemm_epilogue(k::GemmEpilogue::kBias, xq.data, Fp8Format::kE4M3, xq.inv, wq.data, Fp8Format::kE4M3,
                                 wq.inv, /*fast_accum=*/true, y, bias ? bias->contiguous() : at::Tensor(),
                                 at::Tensor(), res2);
      }
      // (the fused bias was cleared of the CUBLAS_STATUS_NOT_SUPPORTED of 81f1cd3 by the session-13 probe on an H200)
      if (!done) {
        y = fp8_scaled_mm(xq.data, xq.inv_scale(), wq.data, wq.inv_scale(), x.scalar_type(), /*fast_accum=*/true, bias);
        if (res2.defined()) y.add_(res2);
      }
    } else {
      y = deferred_output({x2.size(0), out}, x.options());
    }
    // (per tensor: the backward's transposed cast of W reuses this cast's statistics, no second amax pass)
    // (delayed: the transposed copy itself, not the weight)
    const bool keep_wt = want_dx && wq.data_t.defined();
    const bool keep_w_stats = want_dx && compute && scaling == Fp8Scaling::kTensor && !keep_wt;
    ctx->save_for_backward({want_dw ? xq.data_t : at::Tensor(), want_dw ? xq.inv_scale_t() : at::Tensor(),
                            want_dx && !keep_wt ? weight : at::Tensor(), keep_w_stats ? wq.stats : at::Tensor(),
                            keep_w_stats || keep_wt ? wq.inv : at::Tensor(), keep_wt ? wq.data_t : at::Tensor()});
    ctx->saved_data["grad_format"] = grad_format;
    ctx->saved_data["scaling"] = scaling_id;
    ctx->saved_data["has_bias"] = bias.has_value();  // (an absent optional input has no gradient slot to ask about)
    ctx->saved_data["has_residual"] = residual.has_value();
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    if (grad_scale) ctx->saved_data["grad_scale"] = delayed_scale_capsule(*grad_scale);
    ctx->saved_data["out_features"] = out;
    // (_unsafe_view: a view made inside a custom function could not be modified in place by the caller)
    const at::Tensor y_view = at::_unsafe_view(y, with_last(x.sizes(), out));
    return parts == 1 ? variable_list{y_view} : y_view.chunk(parts, -1);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xt8 = saved[0], &x_inv = saved[1], &weight = saved[2];
    Fp8Tensor w_forward;  // the forward cast's statistics (undefined: take them again), or its transposed copy
    w_forward.stats = saved[3], w_forward.inv = saved[4], w_forward.data_t = saved[5];
    const auto grad_format = static_cast<Fp8Format>(ctx->saved_data["grad_format"].toInt());
    const auto scaling = static_cast<Fp8Scaling>(ctx->saved_data["scaling"].toInt());
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    const int64_t out = ctx->saved_data["out_features"].toInt();
    const bool want_dx = ctx->needs_input_grad(0), want_dw = ctx->needs_input_grad(1);
    const bool want_db = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    at::Tensor dx, dw, db;
    // the pieces' gradients as 2-D [rows, out / parts] (an unused piece: zeros)
    std::vector<at::Tensor> pieces;
    const int64_t piece = out / static_cast<int64_t>(grads.size());
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < x_sizes.size(); ++i) rows *= x_sizes[i];
    const auto defined = std::find_if(grads.begin(), grads.end(), [](const at::Tensor& g) { return g.defined(); });
    for (const at::Tensor& g : grads)
      pieces.push_back(g.defined() ? g.contiguous().view({-1, piece}) : at::zeros({rows, piece}, defined->options()));
    // (one cast for both copies; the bias gradient's read of dy also takes dy's amax; with a delayed scale one pass
    // reads the pieces where they are)
    const auto grad_scale = ctx->saved_data.find("grad_scale");
    const bool delayed = grad_scale != ctx->saved_data.end();
    const at::Tensor dy2 = delayed || pieces.size() == 1 ? pieces[0] : at::cat(pieces, 1);
    const Fp8Tensor dyq =
        delayed ? fp8_cast_grad_delayed_parts(pieces, delayed_scale_of(grad_scale->second), want_dx, want_dw,
                                              want_db ? &db : nullptr, w_dtype)
                : fp8_cast_grad(scaling, dy2, grad_format, want_dx, want_dw, want_db ? &db : nullptr, w_dtype);
    if (want_dx) {
      // W^T [in, out] row-major
      const Fp8Tensor wq = w_forward.data_t.defined() ? w_forward : fp8_cast_weight_t(scaling, weight, w_forward);
      dx = fp8_scaled_mm(dyq.data, dyq.inv_scale(), wq.data_t, wq.inv_scale_t(), pieces[0].scalar_type(), false,
                         std::nullopt)
               .view(x_sizes);
    }
    if (want_dw) dw = fp8_scaled_mm(dyq.data_t, dyq.inv_scale_t(), xt8, x_inv, w_dtype, false, std::nullopt);
    at::Tensor dres;
    if (ctx->saved_data["has_residual"].toBool() && ctx->needs_input_grad(3)) dres = grads[0];
    variable_list g = {dx, dw, db, dres};
    g.resize(12);  // (none for the eight non-tensor arguments)
    return g;
  }
};

}  // namespace

// a [m, k] row-major x b [n, k] row-major (= the column-major [k, n] operand _scaled_mm wants), dequantised by the
// operands' inverse scales (0-dim: per tensor; [m] and [n]: per row), into out_dtype. Fast accumulation only in the
// forward (the gradients' GEMMs keep full fp32 accumulation, as torchao and TransformerEngine do). A bias is added
// in the GEMM's epilogue where cuBLASLt takes it (per-tensor scales, a 16-bit output of the bias's dtype: one
// write of the output instead of a write, a read and a write), after the GEMM elsewhere.
at::Tensor fp8_scaled_mm(const at::Tensor& a, const at::Tensor& a_inv, const at::Tensor& b, const at::Tensor& b_inv,
                         at::ScalarType out_dtype, bool fast_accum, const std::optional<at::Tensor>& bias) {
  // (autotuning on: the core's cuBLASLt GEMM, which times its candidate algorithms, where it takes the problem)
  const bool half_out = out_dtype == at::kBFloat16 || out_dtype == at::kHalf;
  if (gemm_autotune_enabled() && a_inv.dim() == 0 && a.is_cuda() && half_out &&
      (!bias || bias->scalar_type() == out_dtype)) {
    const at::Tensor out = at::empty({a.size(0), b.size(0)}, a.options().dtype(out_dtype));
    const auto format = [](const at::Tensor& t) {
      return t.scalar_type() == at::kFloat8_e4m3fn ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
    };
    if (fp8_gemm_epilogue(k::GemmEpilogue::kBias, a, format(a), a_inv, b, format(b), b_inv, fast_accum, out,
                          bias ? bias->contiguous() : at::Tensor(), at::Tensor(), at::Tensor()))
      return out;
  }
  if (bias && a_inv.dim() == 0 && a.is_cuda() && out_dtype != at::kFloat && bias->scalar_type() == out_dtype)
    return at::_scaled_mm(a, b.t(), a_inv, b_inv, *bias, std::nullopt, out_dtype, fast_accum);
  if (bias) return fp8_scaled_mm(a, a_inv, b, b_inv, out_dtype, fast_accum, std::nullopt).add_(*bias);
  if (a_inv.dim() == 0) return at::_scaled_mm(a, b.t(), a_inv, b_inv, std::nullopt, std::nullopt, out_dtype, fast_accum);
  const at::Tensor sa = a_inv.view({-1, 1}), sb = b_inv.view({1, -1});
  if (a.is_cuda() && out_dtype == at::kBFloat16)  // the rowwise kernels' one output dtype
    return at::_scaled_mm(a, b.t(), sa, sb, std::nullopt, std::nullopt, out_dtype, fast_accum);
  // (CPUs: _scaled_mm takes per-tensor scales only) the FP8 products with unit scales, scaled per row and column
  const at::Tensor one = at::ones({}, a_inv.options());
  return at::_scaled_mm(a, b.t(), one, one, std::nullopt, std::nullopt, at::kFloat, fast_accum)
      .mul_(sa)
      .mul_(sb)
      .to(out_dtype);
}

bool fp8_gemm_epilogue(k::GemmEpilogue epilogue, const at::Tensor& a, Fp8Format a_format, const at::Tensor& a_inv,
                       const at::Tensor& b, Fp8Format b_format, const at::Tensor& b_inv, bool fast_accum,
                       const at::Tensor& out, const at::Tensor& bias, const at::Tensor& aux,
                       const at::Tensor& residual) {
  BMT_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(1) && out.size(0) == a.size(0) &&
                out.size(1) == b.size(0),
            "nn::fp8_gemm_epilogue: operands ", a.sizes(), " x ", b.sizes(), "^T do not make the output ", out.sizes());
  BMT_CHECK(a_inv.dim() == 0 && b_inv.dim() == 0, "nn::fp8_gemm_epilogue: per-tensor scales only");
  k::Fp8GemmOperands f8;
  f8.a_format = core_format(a_format), f8.b_format = core_format(b_format);
  f8.a_inv_scale = a_inv.data_ptr<float>(), f8.b_inv_scale = b_inv.data_ptr<float>();
  f8.fast_accum = fast_accum;
  k::GemmEpilogueArgs g = gemm_epilogue_args(epilogue, a, b, /*b_transposed=*/true, out, bias, aux, residual);
  g.fp8 = &f8;
  return run_gemm_epilogue(g, out);
}

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
  BMT_CHECK(supported_dtype(matrix.scalar_type()), "nn::fp8_cast: dtype ", matrix.scalar_type(),
            " is not fp32, bf16 or fp16");
  const at::Tensor m = matrix.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  const auto opts = m.options().dtype(fp8_dtype(format));
  Fp8Tensor r;
  if (!delayed) r.stats = known ? known->stats : at::empty({3}, m.options().dtype(at::kFloat));
  if (rowwise) r.data = at::empty({rows, cols}, opts);
  if (transposed) r.data_t = at::empty({cols, rows}, opts);
  auto* q = rowwise ? static_cast<uint8_t*>(r.data.data_ptr()) : nullptr;
  auto* qt = transposed ? static_cast<uint8_t*>(r.data_t.data_ptr()) : nullptr;
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

bool e4m3_scales(const Fp8LinearScales* scales) {
  return scales && scales->input.format() == Fp8Format::kE4M3 && scales->weight.format() == Fp8Format::kE4M3;
}

Fp8DelayedScale* delayed_grad_scale(Fp8LinearScales* scales, Fp8Format grad_format, Fp8Scaling scaling) {
  const bool use = scales && g_delayed_grads.enabled() && scaling == Fp8Scaling::kTensor &&
                   scales->grad.format() == grad_format;
  return use ? &scales->grad : nullptr;
}

Fp8Tensor fp8_cast_grad_delayed(const at::Tensor& dy, const at::Tensor& pre, Fp8DelayedScale& state, bool row_major,
                                bool transposed, at::Tensor* db, at::ScalarType sum_dtype) {
  BMT_CHECK(dy.dim() == 2 && (!pre.defined() || pre.sizes() == dy.sizes()), "nn::fp8_cast_grad_delayed: expected a "
            "2-D gradient (and pre of its shape), got ", dy.sizes(), pre.defined() ? " and " : "",
            pre.defined() ? pre.sizes() : at::IntArrayRef());
  const bool cast = row_major || transposed;
  if (!cast || !state.ready()) {  // (the first call: the dynamic cast, its amax the state's first record)
    Fp8Tensor r = pre.defined()
                      ? fp8_cast_dgelu_grad(Fp8Scaling::kTensor, dy, pre, state.format(), row_major, transposed, db,
                                            sum_dtype)
                      : fp8_cast_grad(Fp8Scaling::kTensor, dy, state.format(), row_major, transposed, db, sum_dtype);
    if (cast) state.record_amax(r.stats.select(0, k::kFp8Amax));
    return r;
  }
  BMT_CHECK(state.scale().device() == dy.device(), "nn::fp8_cast_grad_delayed: the delayed scale is on ",
            state.scale().device(), ", the gradient on ", dy.device(), " (one state per tensor and device)");
  BMT_CHECK(supported_dtype(dy.scalar_type()) && (!pre.defined() || pre.scalar_type() == dy.scalar_type()),
            "nn::fp8_cast_grad_delayed: dtype ", dy.scalar_type(), " is not fp32, bf16 or fp16 (or pre's differs)");
  const at::Tensor g = dy.contiguous(), p = pre.defined() ? pre.contiguous() : at::Tensor();
  const int64_t rows = g.size(0), cols = g.size(1);
  const auto opts = g.options().dtype(fp8_dtype(state.format()));
  Fp8Tensor r;
  if (row_major) r.data = at::empty({rows, cols}, opts);
  if (transposed) r.data_t = at::empty({cols, rows}, opts);
  if (db) *db = at::empty({cols}, g.options().dtype(sum_dtype));
  auto* q = row_major ? static_cast<uint8_t*>(r.data.data_ptr()) : nullptr;
  auto* qt = transposed ? static_cast<uint8_t*>(r.data_t.data_ptr()) : nullptr;
  const core::DType dt = to_core_dtype(g.scalar_type());
  const k::Fp8Format f = core_format(state.format());
  const float* scale = state.scale().data_ptr<float>();
  float* amax = state.amax().data_ptr<float>();
  void* sums = db ? db->data_ptr() : nullptr;
  const core::DType sum_dt = to_core_dtype(sum_dtype);
  const void* pre_ptr = p.defined() ? p.data_ptr() : nullptr;
  if (!g.is_cuda()) {
    k::fp8_cast_grad_delayed_cpu(g.data_ptr(), pre_ptr, dt, rows, cols, scale, amax, f, q, qt, sums, sum_dt);
    r.inv = state.record();
    return r;
  }
#ifdef BMT_WITH_CUDA
  c10::cuda::CUDAGuard guard(g.device());
  if (!k::fp8_cast_grad_cuda_applies(rows, cols, g.data_ptr(), pre_ptr, q, qt)) {  // the separate ops
    const at::Tensor d = p.defined() ? at::gelu_backward(g, p, "tanh") : g;
    if (db) *db = column_sum(d, sum_dtype);
    return cast_per_tensor(d, state.format(), row_major, transposed, at::Tensor(), nullptr, &state);
  }
  const at::Tensor ws = db ? at::empty({k::fp8_cast_grad_workspace_numel(rows, cols)}, g.options().dtype(at::kFloat))
                           : at::Tensor();
  k::fp8_cast_grad_delayed_cuda(g.data_ptr(), pre_ptr, dt, rows, cols, scale, amax, f, q, qt, sums, sum_dt,
                                db ? ws.data_ptr<float>() : nullptr, current_stream_handle(g));
  r.inv = state.record();
  return r;
#else
  BMT_ERROR("nn::fp8_cast_grad_delayed: a CUDA tensor, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
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
  if (pieces.size() == 1) return fp8_cast_grad_delayed(pieces[0], at::Tensor(), state, row_major, transposed, db, sum_dtype);
#ifdef BMT_WITH_CUDA
  const at::Tensor& first = pieces[0];
  if (first.is_cuda() && state.ready() && (row_major || transposed) && supported_dtype(first.scalar_type()) &&
      state.scale().device() == first.device()) {
    std::vector<at::Tensor> ps;
    const void* ptrs[k::kFp8CastGradMaxParts] = {};
    for (size_t i = 0; i < pieces.size(); ++i) ps.push_back(pieces[i].contiguous()), ptrs[i] = ps.back().data_ptr();
    const int parts = static_cast<int>(ps.size());
    const int64_t rows = first.size(0), cols = first.size(1) * parts;
    const auto opts = first.options().dtype(fp8_dtype(state.format()));
    Fp8Tensor r;
    if (row_major) r.data = at::empty({rows, cols}, opts);
    if (transposed) r.data_t = at::empty({cols, rows}, opts);
    auto* q = row_major ? static_cast<uint8_t*>(r.data.data_ptr()) : nullptr;
    auto* qt = transposed ? static_cast<uint8_t*>(r.data_t.data_ptr()) : nullptr;
    if (k::fp8_cast_grad_parts_cuda_applies(rows, cols, ptrs, parts, q, qt)) {
      c10::cuda::CUDAGuard guard(first.device());
      if (db) *db = at::empty({cols}, first.options().dtype(sum_dtype));
      const at::Tensor ws =
          db ? at::empty({k::fp8_cast_grad_workspace_numel(rows, cols)}, first.options().dtype(at::kFloat))
             : at::Tensor();
      k::fp8_cast_grad_parts_delayed_cuda(ptrs, parts, to_core_dtype(first.scalar_type()), rows, cols,
                                          state.scale().data_ptr<float>(), state.amax().data_ptr<float>(),
                                          core_format(state.format()), q, qt, db ? db->data_ptr() : nullptr,
                                          to_core_dtype(sum_dtype), db ? ws.data_ptr<float>() : nullptr,
                                          current_stream_handle(first));
      r.inv = state.record();
      return r;
    }
  }
#endif
  return fp8_cast_grad_delayed(at::cat(pieces, 1), at::Tensor(), state, row_major, transposed, db, sum_dtype);
}

Fp8Tensor fp8_cast_rowwise(const at::Tensor& matrix, Fp8Format format, bool row_major, bool transposed) {
  BMT_CHECK(matrix.dim() == 2, "nn::fp8_cast_rowwise: expected a 2-D tensor, got ", matrix.dim(), " dimensions");
  BMT_CHECK(supported_dtype(matrix.scalar_type()), "nn::fp8_cast_rowwise: dtype ", matrix.scalar_type(),
            " is not fp32, bf16 or fp16");
  const at::Tensor m = matrix.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  const auto opts = m.options().dtype(fp8_dtype(format));
  const auto f32 = m.options().dtype(at::kFloat);
  Fp8Tensor r;
  if (row_major) r.data = at::empty({rows, cols}, opts), r.inv = at::empty({rows}, f32);
  if (transposed) r.data_t = at::empty({cols, rows}, opts), r.inv_t = at::empty({cols}, f32);
  auto* q = row_major ? static_cast<uint8_t*>(r.data.data_ptr()) : nullptr;
  auto* qt = transposed ? static_cast<uint8_t*>(r.data_t.data_ptr()) : nullptr;
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

bool fp8_linear_applies(const at::Tensor& x, const at::Tensor& weight) {
  if (!x.defined() || !weight.defined() || weight.dim() != 2 || x.dim() < 1) return false;
  if (!supported_dtype(x.scalar_type()) || weight.scalar_type() != x.scalar_type()) return false;
  if (x.device() != weight.device() || x.size(-1) != weight.size(1)) return false;
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  // every GEMM dimension (rows are wgrad's reduction dimension) a multiple of 16, as _scaled_mm wants on GPUs
  return rows > 0 && rows % 16 == 0 && weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, Fp8Format grad_format,
                      Fp8Scaling scaling, bool compute_output, Fp8LinearScales* scales) {
  BMT_CHECK(weight.defined() && weight.dim() == 2, "nn::fp8_linear: needs a 2-D weight");
  BMT_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "nn::fp8_linear: input ", x.sizes(),
            " does not match weight ", weight.sizes());
  BMT_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), "nn::fp8_linear: bias ",
            bias.sizes(), " does not match weight ", weight.sizes());
  if (!fp8_linear_applies(x, weight) || (bias.defined() && bias.scalar_type() != x.scalar_type()))
    return compute_output ? linear(x, weight, bias) : linear_deferred(x, weight, bias);
  // (what the backward will need, known here: inside the Function's forward grad mode is off)
  const bool grad = at::GradMode::is_enabled();
  return Fp8LinearFn::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, std::nullopt,
                            static_cast<int64_t>(grad_format), static_cast<int64_t>(scaling),
                            grad && x.requires_grad(), grad && weight.requires_grad(), compute_output,
                            fp8_delayed_inputs_enabled() ? scales : nullptr, delayed_grad_scale(scales, grad_format, scaling),
                            int64_t{1})[0];
}

at::Tensor fp8_linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& residual, Fp8Format grad_format, Fp8Scaling scaling,
                               Fp8LinearScales* scales) {
  BMT_CHECK(weight.defined() && weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
            "nn::fp8_linear_residual: input ", x.sizes(), " does not match weight ",
            weight.defined() ? weight.sizes() : at::IntArrayRef());
  BMT_CHECK(residual.defined(), "nn::fp8_linear_residual: needs a residual");
  check_residual(residual, x, weight.size(0), "nn::fp8_linear_residual");
  if (!fp8_linear_applies(x, weight) || (bias.defined() && bias.scalar_type() != x.scalar_type()) ||
      residual.scalar_type() != x.scalar_type() || residual.device() != x.device())
    return residual + fp8_linear(x, weight, bias, grad_format, scaling, true, scales);
  BMT_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), "nn::fp8_linear_residual: bias ",
            bias.sizes(), " does not match weight ", weight.sizes());
  const bool grad = at::GradMode::is_enabled();
  return Fp8LinearFn::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                            std::optional<at::Tensor>(residual), static_cast<int64_t>(grad_format),
                            static_cast<int64_t>(scaling), grad && x.requires_grad(), grad && weight.requires_grad(),
                            true, fp8_delayed_inputs_enabled() ? scales : nullptr,
                            delayed_grad_scale(scales, grad_format, scaling), int64_t{1})[0];
}

at::Tensor linear_or_fp8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool fp8,
                         bool compute_output, Fp8LinearScales* scales) {
  if (fp8) return fp8_linear(x, weight, bias, fp8_grad_format(), fp8_scaling(), compute_output, scales);
  return compute_output ? linear(x, weight, bias) : linear_deferred(x, weight, bias);
}

std::vector<at::Tensor> fp8_linear_parts(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                         int64_t parts, Fp8Format grad_format, Fp8Scaling scaling,
                                         bool compute_output, Fp8LinearScales* scales) {
  BMT_CHECK(weight.defined() && weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
            "nn::fp8_linear_parts: input ", x.sizes(), " does not match weight ",
            weight.defined() ? weight.sizes() : at::IntArrayRef());
  BMT_CHECK(parts >= 1 && parts <= k::kFp8CastGradMaxParts && weight.size(0) % parts == 0, "nn::fp8_linear_parts: ",
            weight.size(0), " output features do not split into ", parts, " pieces (1 to ",
            k::kFp8CastGradMaxParts, ", dividing them)");
  BMT_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), "nn::fp8_linear_parts: bias ",
            bias.sizes(), " does not match weight ", weight.sizes());
  if (parts == 1 || !fp8_linear_applies(x, weight) || (bias.defined() && bias.scalar_type() != x.scalar_type()))
    return fp8_linear(x, weight, bias, grad_format, scaling, compute_output, scales).chunk(parts, -1);
  const bool grad = at::GradMode::is_enabled();
  return Fp8LinearFn::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, std::nullopt,
                            static_cast<int64_t>(grad_format), static_cast<int64_t>(scaling),
                            grad && x.requires_grad(), grad && weight.requires_grad(), compute_output,
                            fp8_delayed_inputs_enabled() ? scales : nullptr,
                            delayed_grad_scale(scales, grad_format, scaling), parts);
}

std::vector<at::Tensor> linear_or_fp8_parts(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                            bool fp8, int64_t parts, Fp8LinearScales* scales) {
  if (fp8) return fp8_linear_parts(x, weight, bias, parts, fp8_grad_format(), fp8_scaling(), true, scales);
  return linear(x, weight, bias).chunk(parts, -1);
}

Fp8Format fp8_grad_format() { return g_grad_format.get(); }

void set_fp8_grad_format(Fp8Format format) { g_grad_format.set(format); }

bool fp8_dgelu_fused_enabled() { return g_dgelu_fused.enabled(); }

void set_fp8_dgelu_fused_enabled(bool enabled) { g_dgelu_fused.set(enabled); }

bool fp8_delayed_inputs_enabled() { return g_delayed_inputs.enabled(); }

void set_fp8_delayed_inputs_enabled(bool enabled) { g_delayed_inputs.set(enabled); }

bool fp8_delayed_grads_enabled() { return g_delayed_grads.enabled(); }

void set_fp8_delayed_grads_enabled(bool enabled) { g_delayed_grads.set(enabled); }

Fp8Scaling fp8_scaling() { return g_scaling.get(); }

void set_fp8_scaling(Fp8Scaling scaling) { g_scaling.set(scaling); }

}  // namespace bmt::nn
