#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_linear_internal.h"

#include <torch/autograd.h>

#include <algorithm>
#include <optional>

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_grad_internal.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_delayed_scale_internal.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/fused_linear_internal.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/nn/gemm_epilogue_args_internal.h"
#include "bmt/nn/shape_internal.h"
#include "bmt/runtime/env_switch_internal.h"

namespace bmt::nn {
namespace {

namespace k = core::kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

EnvChoice<Fp8Format, 2> g_grad_format("BMT_FP8_GRAD", {{{"e5m2", Fp8Format::kE5M2}, {"e4m3", Fp8Format::kE4M3}}});
EnvChoice<Fp8Scaling, 2> g_scaling("BMT_FP8_SCALING", {{{"tensor", Fp8Scaling::kTensor}, {"row", Fp8Scaling::kRow}}});

struct Fp8LinearFn : torch::autograd::Function<Fp8LinearFn> {
  // parts > 1: the output as that many pieces of its last dimension (fp8_linear_parts), their gradients read in place
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                               int64_t grad_format, int64_t scaling_id, bool want_dx, bool want_dw, bool compute,
                               Fp8LinearScales* scales, Fp8DelayedScale* grad_scale, int64_t parts,
                               bool fp8_forward) {
    const int64_t in = weight.size(1), out = weight.size(0);
    const auto scaling = static_cast<Fp8Scaling>(scaling_id);
    const at::Tensor x2 = x.contiguous().view({-1, in});
    // compute = false (a recompute's tail): no forward GEMM, so neither x's row-major bytes nor W's cast; nor with
    // the forward GEMM in x's dtype (fp8_forward = false: only wgrad reads x's bytes, and dgrad casts W itself)
    const bool gemm8 = compute && fp8_forward;
    Fp8Tensor xq;
    // (delayed scales: per tensor, E4M3, each amax taken by the cast itself; the weight's transposed copy for dgrad
    // in the same pass)
    const bool delayed = scaling == Fp8Scaling::kTensor && e4m3_scales(scales);
    if (gemm8 || want_dw)
      xq = delayed ? fp8_cast_delayed(x2, scales->input, gemm8, want_dw)
                   : fp8_cast_as(scaling, x2, Fp8Format::kE4M3, gemm8, want_dw);
    at::Tensor y;
    Fp8Tensor wq;
    const at::Tensor res2 = compute && residual ? residual->contiguous().view({-1, out}) : at::Tensor();
    if (compute && !fp8_forward) {
      y = linear(x2, weight, bias ? *bias : at::Tensor());
      if (res2.defined()) y.add_(res2);
    } else if (compute) {
      wq = delayed ? fp8_cast_delayed(weight, scales->weight, true, want_dx)
                   : fp8_cast_as(scaling, weight, Fp8Format::kE4M3, true, false);
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
    const bool keep_w_stats = want_dx && gemm8 && scaling == Fp8Scaling::kTensor && !keep_wt;
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
    g.resize(13);  // (none for the nine non-tensor arguments)
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

bool e4m3_scales(const Fp8LinearScales* scales) {
  return scales && scales->input.format() == Fp8Format::kE4M3 && scales->weight.format() == Fp8Format::kE4M3;
}

Fp8DelayedScale* delayed_grad_scale(Fp8LinearScales* scales, Fp8Format grad_format, Fp8Scaling scaling) {
  const bool use = scales && fp8_delayed_grads_enabled() && scaling == Fp8Scaling::kTensor &&
                   scales->grad.format() == grad_format;
  return use ? &scales->grad : nullptr;
}

bool fp8_linear_applies(const at::Tensor& x, const at::Tensor& weight) {
  if (!x.defined() || !weight.defined() || weight.dim() != 2 || x.dim() < 1) return false;
  if (!fp8_supported_dtype(x.scalar_type()) || weight.scalar_type() != x.scalar_type()) return false;
  if (x.device() != weight.device() || x.size(-1) != weight.size(1)) return false;
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  // every GEMM dimension (rows are wgrad's reduction dimension) a multiple of 16, as _scaled_mm wants on GPUs
  return rows > 0 && rows % 16 == 0 && weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0;
}

namespace {

void check_operands(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const char* who) {
  BMT_CHECK(weight.defined() && weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), who, ": input ",
            x.sizes(), " does not match weight ", weight.defined() ? weight.sizes() : at::IntArrayRef(),
            " (a 2-D [out, in] weight, in = the input's last dimension)");
  BMT_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), who, ": bias ", bias.sizes(),
            " does not match weight ", weight.sizes());
}

// Whether the FP8 node takes these operands (else the bf16 path).
bool takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return fp8_linear_applies(x, weight) && (!bias.defined() || bias.scalar_type() == x.scalar_type());
}

variable_list apply_fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& residual, Fp8Format grad_format, Fp8Scaling scaling,
                               bool compute_output, Fp8LinearScales* scales, int64_t parts) {
  // (what the backward will need, known here: inside the Function's forward grad mode is off)
  const bool grad = at::GradMode::is_enabled();
  const bool fp8_forward = !(scales && scales->backward_only);
  const auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  return Fp8LinearFn::apply(x, weight, opt(bias), opt(residual), static_cast<int64_t>(grad_format),
                            static_cast<int64_t>(scaling), grad && x.requires_grad(), grad && weight.requires_grad(),
                            compute_output, fp8_delayed_inputs_enabled() ? scales : nullptr,
                            delayed_grad_scale(scales, grad_format, scaling), parts, fp8_forward);
}

}  // namespace

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, Fp8Format grad_format,
                      Fp8Scaling scaling, bool compute_output, Fp8LinearScales* scales) {
  check_operands(x, weight, bias, "nn::fp8_linear");
  if (!takes(x, weight, bias)) return compute_output ? linear(x, weight, bias) : linear_deferred(x, weight, bias);
  return apply_fp8_linear(x, weight, bias, at::Tensor(), grad_format, scaling, compute_output, scales, 1)[0];
}

at::Tensor fp8_linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& residual, Fp8Format grad_format, Fp8Scaling scaling,
                               Fp8LinearScales* scales) {
  check_operands(x, weight, bias, "nn::fp8_linear_residual");
  BMT_CHECK(residual.defined(), "nn::fp8_linear_residual: needs a residual");
  check_residual(residual, x, weight.size(0), "nn::fp8_linear_residual");
  if (!takes(x, weight, bias) || residual.scalar_type() != x.scalar_type() || residual.device() != x.device())
    return residual + fp8_linear(x, weight, bias, grad_format, scaling, true, scales);
  return apply_fp8_linear(x, weight, bias, residual, grad_format, scaling, true, scales, 1)[0];
}

at::Tensor linear_or_fp8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool fp8,
                         bool compute_output, Fp8LinearScales* scales) {
  if (fp8) return fp8_linear(x, weight, bias, fp8_grad_format(), fp8_scaling(), compute_output, scales);
  return compute_output ? linear(x, weight, bias) : linear_deferred(x, weight, bias);
}

std::vector<at::Tensor> fp8_linear_parts(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                         int64_t parts, Fp8Format grad_format, Fp8Scaling scaling,
                                         bool compute_output, Fp8LinearScales* scales) {
  check_operands(x, weight, bias, "nn::fp8_linear_parts");
  BMT_CHECK(parts >= 1 && parts <= k::kFp8CastGradMaxParts && weight.size(0) % parts == 0, "nn::fp8_linear_parts: ",
            weight.size(0), " output features do not split into ", parts, " pieces (1 to ",
            k::kFp8CastGradMaxParts, ", dividing them)");
  if (!takes(x, weight, bias)) {
    const at::Tensor y = compute_output ? linear(x, weight, bias) : linear_deferred(x, weight, bias);
    return y.chunk(parts, -1);
  }
  return apply_fp8_linear(x, weight, bias, at::Tensor(), grad_format, scaling, compute_output, scales, parts);
}

std::vector<at::Tensor> linear_or_fp8_parts(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                            bool fp8, int64_t parts, Fp8LinearScales* scales) {
  if (fp8) return fp8_linear_parts(x, weight, bias, parts, fp8_grad_format(), fp8_scaling(), true, scales);
  return linear(x, weight, bias).chunk(parts, -1);
}

Fp8Format fp8_grad_format() { return g_grad_format.get(); }

void set_fp8_grad_format(Fp8Format format) { g_grad_format.set(format); }

Fp8Scaling fp8_scaling() { return g_scaling.get(); }

void set_fp8_scaling(Fp8Scaling scaling) { g_scaling.set(scaling); }

}  // namespace bmt::nn
