#include "bmt/nn/fp8_mlp.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <optional>

#include "bmt/core/error.h"
#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/nn/fp8_delayed_scale_internal.h"
#include "bmt/nn/fp8_linear_internal.h"
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
constexpr Fp8Format kE4M3 = Fp8Format::kE4M3;
// Which FP8 epilogue GEMMs run (each falls back to the GEMM then the separate op). cuBLASLt runs the FP8 DGELU as
// the GEMM plus a separate epilogue kernel (H100 profile, 1.3B: 1.15 ms per layer, slower than torch's GELU
// backward), so it is off unless BMT_FP8_MLP_DGELU=1; the forward GELU (BMT_FP8_MLP_GELU) is on.
EnvSwitch g_dgelu("BMT_FP8_MLP_DGELU", false);
EnvSwitch g_gelu("BMT_FP8_MLP_GELU", true);

// h = gelu(x w_fc^T + b_fc) written in E4M3 by c_fc's GEMM with the delayed scale (pre kept in dtype), its
// transposed copy by a byte transpose when grad; inv: this call's inverse scale (NaN for a non-finite h). An empty
// Fp8Tensor (inv undefined) where cuBLASLt has no FP8-output algorithm: nothing was written, nothing recorded.
Fp8Tensor gelu_in_fp8(const Fp8Tensor& xq, const Fp8Tensor& w1q, const at::Tensor& b1, const at::Tensor& pre,
                      Fp8DelayedScale& scale, bool row_major, bool transposed) {
  const at::Tensor h8 = at::empty(pre.sizes(), pre.options().dtype(at::kFloat8_e4m3fn));
  if (!fp8_gemm_epilogue_to_fp8(k::GemmEpilogue::kGeluAuxBias, xq.data, kE4M3, xq.inv, w1q.data, kE4M3, w1q.inv,
                                /*fast_accum=*/true, h8, scale, b1, pre))
    return Fp8Tensor();
  Fp8Tensor hq;
  hq.inv = scale.record();
  if (row_major) hq.data = h8;
  if (transposed) hq.data_t = fp8_transpose(h8);
  return hq;
}

struct Fp8GeluMlpFn : torch::autograd::Function<Fp8GeluMlpFn> {
  // grad: the backward will run (known outside: grad mode is off in here), so the transposed copies wgrad needs
  // are cast in the same passes; epilogues: try the epilogue GEMMs (CPU: the fp64 twin)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
                            const at::Tensor& w_proj, const at::Tensor& b_proj,
                            const std::optional<at::Tensor>& residual, int64_t grad_format, bool grad,
                            bool compute_output, bool epilogues, Fp8DelayedScale* gelu_scale,
                            Fp8LinearScales* fc_scales, Fp8LinearScales* proj_scales, Fp8DelayedScale* fc_grad,
                            Fp8DelayedScale* proj_grad) {
    const int64_t in = w_fc.size(1), hidden = w_fc.size(0), out = w_proj.size(0);
    const at::Tensor x2 = x.contiguous().view({-1, in});
    const int64_t rows = x2.size(0);
    const at::ScalarType dtype = x.scalar_type();
    // (delayed scales: x, and each weight with its transposed copy for the backward in the same pass)
    const bool fc_delayed = e4m3_scales(fc_scales), proj_delayed = e4m3_scales(proj_scales);
    const Fp8Tensor xq = fc_delayed ? fp8_cast_delayed(x2, fc_scales->input, true, grad)
                                    : fp8_cast(x2, kE4M3, true, grad);
    const Fp8Tensor w1q = fc_delayed ? fp8_cast_delayed(w_fc, fc_scales->weight, true, grad)
                                     : fp8_cast(w_fc, kE4M3, true, false);
    const at::Tensor b1 = b_fc.contiguous();
    at::Tensor pre = at::empty({rows, hidden}, x.options());
    const bool gelu_epilogue = epilogues && (g_gelu.enabled() || !x.is_cuda());
    // h in E4M3 from c_fc's GEMM itself (a delayed scale), else in dtype and cast (its amax recorded for the next)
    const bool delayed = gelu_epilogue && gelu_scale && gelu_scale->ready() &&
                         gelu_scale->scale().device() == x.device() && gelu_scale->format() == kE4M3;
    Fp8Tensor hq = delayed ? gelu_in_fp8(xq, w1q, b1, pre, *gelu_scale, compute_output, grad) : Fp8Tensor();
    if (!hq.inv.defined()) {
      at::Tensor h = at::empty_like(pre);
      if (!(gelu_epilogue && fp8_gemm_epilogue(k::GemmEpilogue::kGeluAuxBias, xq.data, kE4M3, xq.inv, w1q.data,
                                               kE4M3, w1q.inv, /*fast_accum=*/true, h, b1, pre, at::Tensor()))) {
        pre = fp8_scaled_mm(xq.data, xq.inv, w1q.data, w1q.inv, dtype, true, b1);
        h = at::gelu(pre, "tanh");
      }
      // (compute_output = false, a recompute's tail: only wgrad's transposed copy of h)
      hq = fp8_cast(h, kE4M3, compute_output, grad);
      if (gelu_scale && gelu_scale->format() == kE4M3) gelu_scale->record_amax(hq.stats.select(0, k::kFp8Amax));
    }
    at::Tensor y;
    Fp8Tensor w2q;
    if (compute_output) {
      w2q = proj_delayed ? fp8_cast_delayed(w_proj, proj_scales->weight, true, grad)
                         : fp8_cast(w_proj, kE4M3, true, false);
      const at::Tensor b2 = b_proj.contiguous();
      const at::Tensor res2 = residual ? residual->contiguous().view({-1, out}) : at::Tensor();
      y = at::empty({rows, out}, x.options());
      if (!(epilogues && fp8_gemm_epilogue(k::GemmEpilogue::kBias, hq.data, kE4M3, hq.inv, w2q.data, kE4M3, w2q.inv,
                                           true, y, b2, at::Tensor(), res2))) {
        y = fp8_scaled_mm(hq.data, hq.inv, w2q.data, w2q.inv, dtype, true, b2);
        if (res2.defined()) y.add_(res2);
      }
    } else {
      y = deferred_output({rows, out}, x.options());
    }
    // (the weights' statistics: their transposed casts in the backward skip the amax pass; w_proj's only when its
    // forward cast ran)
    ctx->save_for_backward({xq.data_t, xq.inv, hq.data_t, hq.inv, w_fc, w_proj, pre, w1q.stats, w1q.inv, w2q.stats,
                            w2q.inv, w1q.data_t, w2q.data_t});
    ctx->saved_data["grad_format"] = grad_format;
    ctx->saved_data["has_residual"] = residual.has_value();
    ctx->saved_data["epilogues"] = epilogues;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    // (the gradients' delayed scales: the node holds the states, see delayed_scale_capsule)
    if (fc_grad) ctx->saved_data["fc_grad"] = delayed_scale_capsule(*fc_grad);
    if (proj_grad) ctx->saved_data["proj_grad"] = delayed_scale_capsule(*proj_grad);
    // (_unsafe_view: a view made inside a custom function could not be modified in place by the caller)
    return at::_unsafe_view(y, with_last(x.sizes(), out));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xt8 = saved[0], &x_inv = saved[1], &ht8 = saved[2], &h_inv = saved[3], &w_fc = saved[4],
                     &w_proj = saved[5], &pre = saved[6];
    Fp8Tensor w1_forward, w2_forward;  // the forward casts' statistics
    w1_forward.stats = saved[7], w1_forward.inv = saved[8], w2_forward.stats = saved[9], w2_forward.inv = saved[10];
    w1_forward.data_t = saved[11], w2_forward.data_t = saved[12];  // (delayed scales: the forward's own copies)
    const auto gf = static_cast<Fp8Format>(ctx->saved_data["grad_format"].toInt());
    const bool epilogues = ctx->saved_data["epilogues"].toBool();
    const int64_t out = w_proj.size(0);
    const at::Tensor dy2 = grads[0].contiguous().view({-1, out});
    const at::ScalarType dtype = grads[0].scalar_type();
    const bool want_dpre = ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2);
    const bool want_dw2 = ctx->needs_input_grad(3);
    const bool want_db2 = ctx->needs_input_grad(4);
    at::Tensor dx, dw1, db1, dw2, db2, dres;
    const auto fc_grad = ctx->saved_data.find("fc_grad"), proj_grad = ctx->saved_data.find("proj_grad");
    const bool fc_delayed = fc_grad != ctx->saved_data.end(), proj_delayed = proj_grad != ctx->saved_data.end();
    // (the bias gradients' reads of dy and d pre also take their amax: one read less per cast; delayed scales: the
    // cast and the bias gradient in one read, d pre never written in dtype)
    const Fp8Tensor dyq =
        proj_delayed ? fp8_cast_grad_delayed(dy2, at::Tensor(), delayed_scale_of(proj_grad->second), want_dpre,
                                             want_dw2, want_db2 ? &db2 : nullptr, w_proj.scalar_type())
                     : fp8_cast_grad(Fp8Scaling::kTensor, dy2, gf, want_dpre, want_dw2, want_db2 ? &db2 : nullptr,
                                     w_proj.scalar_type());
    if (want_dw2) dw2 = fp8_scaled_mm(dyq.data_t, dyq.inv, ht8, h_inv, w_proj.scalar_type(), false, std::nullopt);
    if (want_dpre) {
      // d pre = (dy w_proj) * gelu'(pre): GELU's gradient in the GEMM's epilogue (large problems, see
      // kDGeluMinOutputs), else after it
      // w_proj^T [hidden, out] row-major
      const Fp8Tensor w2t =
          w2_forward.data_t.defined() ? w2_forward : fp8_cast_weight_t(Fp8Scaling::kTensor, w_proj, w2_forward);
      const bool try_dgelu =
          epilogues && (!pre.is_cuda() || (g_dgelu.enabled() && pre.numel() >= kDGeluMinOutputs));
      at::Tensor dpre = try_dgelu ? at::empty_like(pre) : at::Tensor();
      const bool done = try_dgelu && fp8_gemm_epilogue(k::GemmEpilogue::kDGelu, dyq.data, gf, dyq.inv, w2t.data_t,
                                                       kE4M3, w2t.inv, false, dpre, at::Tensor(), pre, at::Tensor());
      if (!done) dpre = at::Tensor();  // (not holding its bytes while the kernel below writes its own)
      const bool want_dx = ctx->needs_input_grad(0), want_dw1 = ctx->needs_input_grad(1);
      const bool want_db1 = ctx->needs_input_grad(2);
      // (no DGELU epilogue: GELU's gradient after the GEMM, with c_fc's bias gradient and d pre's amax in the same
      // kernel when fp8_dgelu_fused_enabled())
      at::Tensor* db1_out = want_db1 ? &db1 : nullptr;
      Fp8Tensor dpq;
      if (done) {
        dpq = fc_delayed ? fp8_cast_grad_delayed(dpre, at::Tensor(), delayed_scale_of(fc_grad->second), want_dx,
                                                 want_dw1, db1_out, w_fc.scalar_type())
                         : fp8_cast_grad(Fp8Scaling::kTensor, dpre, gf, want_dx, want_dw1, db1_out, w_fc.scalar_type());
      } else {
        at::Tensor dmid = fp8_scaled_mm(dyq.data, dyq.inv, w2t.data_t, w2t.inv, dtype, false, std::nullopt);
        dpq = fc_delayed ? fp8_cast_grad_delayed(dmid, pre, delayed_scale_of(fc_grad->second), want_dx, want_dw1,
                                                 db1_out, w_fc.scalar_type())
                         : fp8_cast_dgelu_grad(Fp8Scaling::kTensor, std::move(dmid), pre, gf, want_dx, want_dw1,
                                               db1_out, w_fc.scalar_type());
      }
      if (want_dx) {
        const Fp8Tensor w1t =  // w_fc^T [in, hidden]
            w1_forward.data_t.defined() ? w1_forward : fp8_cast_weight_t(Fp8Scaling::kTensor, w_fc, w1_forward);
        dx = fp8_scaled_mm(dpq.data, dpq.inv, w1t.data_t, w1t.inv, dtype, false, std::nullopt)
                 .view(ctx->saved_data["x_sizes"].toIntVector());
      }
      if (want_dw1) dw1 = fp8_scaled_mm(dpq.data_t, dpq.inv, xt8, x_inv, w_fc.scalar_type(), false, std::nullopt);
    }
    if (ctx->saved_data["has_residual"].toBool() && ctx->needs_input_grad(5)) dres = grads[0];
    variable_list g = {dx, dw1, db1, dw2, db2, dres};
    g.resize(15);  // (none for the nine non-tensor arguments)
    return g;
  }
};

// Every operand of x's dtype and device, and GEMM shapes the FP8 path takes.
bool fused_operands(std::initializer_list<const at::Tensor*> ts, const at::Tensor& x, const at::Tensor& w_fc,
                    const at::Tensor& w_proj) {
  for (const at::Tensor* t : ts)
    if (!t->defined() || t->scalar_type() != x.scalar_type() || t->device() != x.device()) return false;
  return fp8_linear_applies(x, w_fc) && w_proj.size(0) % 16 == 0;
}

// The fused MLP runs both forward GEMMs in FP8: a layer asking for its backward GEMMs only is refused, not ignored.
void check_not_backward_only(const char* who, const Fp8LinearScales* fc, const Fp8LinearScales* proj) {
  BMT_CHECK(!(fc && fc->backward_only) && !(proj && proj->backward_only), who, ": c_fc or c_proj has backward_only "
            "FP8 (Fp8LinearScales::backward_only), which the fused FP8 MLP does not do; run that layer through "
            "nn::fp8_linear or clear backward_only");
}

// fc_scales / proj_scales: the forward operands' states (null: dynamic casts); their gradient states are used under
// fp8_delayed_grads_enabled()
at::Tensor apply(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc, const at::Tensor& w_proj,
                 const at::Tensor& b_proj, const at::Tensor& residual, Fp8Format grad_format, bool compute_output,
                 Fp8DelayedScale* gelu_scale, Fp8LinearScales* fc_scales, Fp8LinearScales* proj_scales,
                 Fp8LinearScales* fc_grad_scales, Fp8LinearScales* proj_grad_scales) {
  const bool grad = at::GradMode::is_enabled() && (x.requires_grad() || w_fc.requires_grad() ||
                                                   w_proj.requires_grad() || b_fc.requires_grad());
  return Fp8GeluMlpFn::apply(x, w_fc, b_fc, w_proj, b_proj,
                             residual.defined() ? std::optional<at::Tensor>(residual) : std::nullopt,
                             static_cast<int64_t>(grad_format), grad, compute_output, /*epilogues=*/true,
                             gelu_scale, fc_scales, proj_scales,
                             delayed_grad_scale(fc_grad_scales, grad_format, Fp8Scaling::kTensor),
                             delayed_grad_scale(proj_grad_scales, grad_format, Fp8Scaling::kTensor));
}

}  // namespace

at::Tensor fp8_gelu_mlp_fused(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
                              const at::Tensor& w_proj, const at::Tensor& b_proj, const at::Tensor& residual,
                              Fp8Format grad_format, bool compute_output, Fp8DelayedScale* gelu_scale,
                              Fp8LinearScales* fc_scales, Fp8LinearScales* proj_scales) {
  check_mlp("nn::fp8_gelu_mlp", x, w_fc, b_fc, w_proj, b_proj, residual);
  check_not_backward_only("nn::fp8_gelu_mlp_fused", fc_scales, proj_scales);
  BMT_CHECK(b_fc.defined() && b_proj.defined(), "nn::fp8_gelu_mlp_fused: c_fc and c_proj need biases");
  BMT_CHECK(fused_operands({&w_fc, &b_fc, &w_proj, &b_proj}, x, w_fc, w_proj) &&
                (!residual.defined() || fused_operands({&residual}, x, w_fc, w_proj)),
            "nn::fp8_gelu_mlp_fused: needs operands of one dtype and device and GEMM dimensions that are multiples "
            "of 16 (rows ", x.numel() / std::max<int64_t>(x.size(-1), 1), ", features ", w_fc.size(1), ", ",
            w_fc.size(0), ", ", w_proj.size(0), ")");
  return apply(x, w_fc, b_fc, w_proj, b_proj, residual, grad_format, compute_output, gelu_scale, fc_scales,
               proj_scales, fc_scales, proj_scales);
}

at::Tensor fp8_gelu_mlp(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc, const at::Tensor& w_proj,
                        const at::Tensor& b_proj, const at::Tensor& residual, Fp8Format grad_format,
                        bool compute_output, Fp8DelayedScale* gelu_scale, Fp8LinearScales* fc_scales,
                        Fp8LinearScales* proj_scales) {
  check_mlp("nn::fp8_gelu_mlp", x, w_fc, b_fc, w_proj, b_proj, residual);
  check_not_backward_only("nn::fp8_gelu_mlp", fc_scales, proj_scales);
  // (under autocast the ops inside would run in another dtype than the backward's operands)
  const bool fused = fp8_scaling() == Fp8Scaling::kTensor && gemm_epilogues_enabled() && x.is_cuda() &&
                     !at::autocast::is_autocast_enabled(at::kCUDA) &&
                     fused_operands({&w_fc, &b_fc, &w_proj, &b_proj}, x, w_fc, w_proj) &&
                     (!residual.defined() || fused_operands({&residual}, x, w_fc, w_proj));
  const bool inputs = fp8_delayed_inputs_enabled();
  if (fused)
    return apply(x, w_fc, b_fc, w_proj, b_proj, residual, grad_format, compute_output,
                 fp8_delayed_gelu_enabled() ? gelu_scale : nullptr, inputs ? fc_scales : nullptr,
                 inputs ? proj_scales : nullptr, fc_scales, proj_scales);
  const Fp8Scaling scaling = fp8_scaling();
  const at::Tensor h = at::gelu(fp8_linear(x, w_fc, b_fc, grad_format, scaling, true, fc_scales), "tanh");
  const at::Tensor y = fp8_linear(h, w_proj, b_proj, grad_format, scaling, compute_output, proj_scales);
  return residual.defined() ? residual + y : y;
}

}  // namespace bmt::nn
