#include "bmt/nn/fused_linear.h"
#include "bmt/nn/fused_linear_internal.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <optional>

#include "bmt/core/error.h"
#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/nn/gemm_epilogue_args_internal.h"
#include "bmt/nn/shape_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace bmt::nn {

bool run_gemm_epilogue(const core::kernels::GemmEpilogueArgs& g, const at::Tensor& like) {
  if (!like.is_cuda()) {
    core::kernels::gemm_epilogue_cpu(g);
    return true;
  }
#ifdef BMT_WITH_CUDA
  c10::cuda::CUDAGuard guard(like.device());
  namespace k = core::kernels;
  // (from the caching allocator, so it is ordered on this stream and lives in a CUDA graph's pool when captured)
  const at::Tensor ws = at::empty({static_cast<int64_t>(k::kGemmEpilogueWorkspaceNbytes)}, like.options().dtype(at::kByte));
  k::GemmEpilogueArgs tuned = g;
  tuned.autotune_candidates = gemm_autotune_enabled() ? kGemmAutotuneCandidates : 0;
  return k::gemm_epilogue_cuda(tuned, ws.data_ptr(), k::kGemmEpilogueWorkspaceNbytes, current_stream_handle(like));
#else
  BMT_ERROR("nn: an epilogue GEMM on CUDA tensors, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
}

namespace {

namespace k = core::kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

EnvSwitch g_enabled("BMT_GEMM_EPILOGUES");
EnvSwitch g_autotune("BMT_GEMM_AUTOTUNE", false);
EnvChoice<GeluMlpBackward, 3> g_backward("BMT_GELU_MLP_BACKWARD", {{{"dgelu", GeluMlpBackward::kDGelu},
                                                                    {"dgelu_bgrad", GeluMlpBackward::kDGeluBGrad},
                                                                    {"separate", GeluMlpBackward::kSeparate}}});

// One epilogue GEMM on row-major 2-D tensors: on CUDA cuBLASLt (false when it has no algorithm), on CPU the twin.
bool run_gemm(k::GemmEpilogue epilogue, const at::Tensor& a, const at::Tensor& b, bool b_transposed,
              const at::Tensor& out, const at::Tensor& bias, const at::Tensor& aux, const at::Tensor& residual) {
  return run_gemm_epilogue(gemm_epilogue_args(epilogue, a, b, b_transposed, out, bias, aux, residual), out);
}

at::Tensor rows_of(const at::Tensor& t, int64_t width) { return t.contiguous().view({-1, width}); }

// x w^T + b [+ residual] into a new [rows, out] tensor.
at::Tensor linear_bias_residual(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& b,
                                const at::Tensor& residual2) {
  at::Tensor y = at::empty({x2.size(0), w.size(0)}, x2.options());
  if (run_gemm(k::GemmEpilogue::kBias, x2, w, true, y, b, at::Tensor(), residual2)) return y;
  y = at::addmm(b, x2, w.t());
  return residual2.defined() ? y.add_(residual2) : y;
}

struct GeluMlpFn : torch::autograd::Function<GeluMlpFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
                            const at::Tensor& w_proj, const at::Tensor& b_proj,
                            const std::optional<at::Tensor>& residual, bool compute_output) {
    const int64_t in = w_fc.size(1), hidden = w_fc.size(0), out = w_proj.size(0);
    const at::Tensor x2 = rows_of(x, in);
    at::Tensor pre = at::empty({x2.size(0), hidden}, x2.options()), h = at::empty_like(pre);
    const at::Tensor w1 = w_fc.contiguous(), b1 = b_fc.contiguous();
    if (!run_gemm(k::GemmEpilogue::kGeluAuxBias, x2, w1, true, h, b1, pre, at::Tensor())) {
      pre = at::addmm(b_fc, x2, w_fc.t());
      h = at::gelu(pre, "tanh");
    }
    const at::Tensor res2 = residual ? rows_of(*residual, out) : at::Tensor();
    // compute_output = false: a recompute whose output only roots the backward (skip_block_outputs_now)
    const at::Tensor y = compute_output ? linear_bias_residual(h, w_proj.contiguous(), b_proj.contiguous(), res2)
                                        : deferred_output({x2.size(0), out}, x2.options());
    ctx->save_for_backward({x2, w_fc, w_proj, pre, h});
    ctx->saved_data["has_residual"] = residual.has_value();
    // (_unsafe_view: a view made inside a custom function could not be modified in place by the caller)
    return at::_unsafe_view(y, with_last(x.sizes(), out));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &w_fc = saved[1], &w_proj = saved[2], &pre = saved[3], &h = saved[4];
    const int64_t out = w_proj.size(0);
    const at::Tensor dy2 = rows_of(grads[0], out);
    at::Tensor dx, dw_fc, db_fc, dw_proj, db_proj, dres;
    if (ctx->needs_input_grad(3)) dw_proj = dy2.t().mm(h);
    if (ctx->needs_input_grad(4)) db_proj = column_sum(dy2, w_proj.scalar_type());
    if (ctx->saved_data["has_residual"].toBool() && ctx->needs_input_grad(5)) dres = grads[0];
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      // d pre = (dy w_proj) * gelu'(pre) and its column sums (c_fc's bias gradient), as gelu_mlp_backward() says:
      // the GEMM with GELU's gradient then our column sums (default), both in the GEMM, or three separate ops
      at::Tensor dpre = at::empty_like(pre), db;
      const GeluMlpBackward mode = gelu_mlp_backward();
      bool done = false;
      if (mode == GeluMlpBackward::kDGeluBGrad) {
        db = at::empty({pre.size(1)}, pre.options());
        done = run_gemm(k::GemmEpilogue::kDGeluBGrad, dy2, w_proj.contiguous(), false, dpre, db, pre, at::Tensor());
      } else if (mode == GeluMlpBackward::kDGelu && pre.numel() >= kDGeluMinOutputs) {
        done = run_gemm(k::GemmEpilogue::kDGelu, dy2, w_proj.contiguous(), false, dpre, at::Tensor(), pre, at::Tensor());
        if (done && ctx->needs_input_grad(2)) db = column_sum(dpre, w_fc.scalar_type());
      }
      if (!done) {
        dpre = at::gelu_backward(dy2.mm(w_proj), pre, "tanh");
        if (ctx->needs_input_grad(2)) db = column_sum(dpre, w_fc.scalar_type());
      }
      if (ctx->needs_input_grad(0)) dx = dpre.mm(w_fc).view(with_last(grads[0].sizes(), w_fc.size(1)));
      if (ctx->needs_input_grad(1)) dw_fc = dpre.t().mm(x2);
      if (ctx->needs_input_grad(2)) db_fc = db;
    }
    return {dx, dw_fc, db_fc, dw_proj, db_proj, dres, at::Tensor()};
  }
};

struct LinearResidualFn : torch::autograd::Function<LinearResidualFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const at::Tensor& residual) {
    const int64_t in = weight.size(1), out = weight.size(0);
    const at::Tensor x2 = rows_of(x, in);
    ctx->save_for_backward({x2, weight});
    return at::_unsafe_view(linear_bias_residual(x2, weight.contiguous(), bias.contiguous(), rows_of(residual, out)),
                            with_last(x.sizes(), out));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &weight = saved[1];
    const at::Tensor dy2 = rows_of(grads[0], weight.size(0));
    at::Tensor dx, dw, db, dres;
    if (ctx->needs_input_grad(0)) dx = dy2.mm(weight).view(with_last(grads[0].sizes(), weight.size(1)));
    if (ctx->needs_input_grad(1)) dw = dy2.t().mm(x2);
    if (ctx->needs_input_grad(2)) db = column_sum(dy2, weight.scalar_type());
    if (ctx->needs_input_grad(3)) dres = grads[0];
    return {dx, dw, db, dres};
  }
};

// y = h w^T + b, where the caller computed h = gelu_tanh(pre) (a user's F.gelu then F.linear): the forward is the
// plain linear on h; the backward sends the gradient to pre, with GELU's gradient done by this GEMM's DGELU
// epilogue instead of a pass of its own. h comes detached (no gradient goes through it).
struct LinearAfterGeluFn : torch::autograd::Function<LinearAfterGeluFn> {
  // compute = false: y is allocated, not computed (nn::linear_fill writes it; see linear_deferred)
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& pre, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& h, bool compute) {
    const int64_t in = weight.size(1), out = weight.size(0);
    const at::Tensor h2 = rows_of(h, in);
    const std::vector<int64_t> sizes = with_last(h.sizes(), out);
    at::Tensor y = compute ? at::empty(sizes, h.options()) : deferred_output(sizes, h.options());
    if (compute) linear_fill(h2, weight, bias, y);
    ctx->save_for_backward({pre, h2, weight});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &pre = saved[0], &h2 = saved[1], &weight = saved[2];
    const at::Tensor dy2 = rows_of(grads[0], weight.size(0));
    at::Tensor dpre, dw, db;
    if (ctx->needs_input_grad(1)) dw = dy2.t().mm(h2);
    if (ctx->needs_input_grad(2)) db = column_sum(dy2, weight.scalar_type());
    if (ctx->needs_input_grad(0)) {
      const at::Tensor pre2 = rows_of(pre, weight.size(1));
      bool done = false;
      if (gelu_mlp_backward() != GeluMlpBackward::kSeparate && (!pre2.is_cuda() || pre2.numel() >= kDGeluMinOutputs)) {
        dpre = at::empty_like(pre2);
        done = run_gemm(k::GemmEpilogue::kDGelu, dy2, weight.contiguous(), false, dpre, at::Tensor(), pre2, at::Tensor());
      }
      if (!done) dpre = at::gelu_backward(dy2.mm(weight), pre2, "tanh");
      dpre = dpre.view(pre.sizes());
    }
    return {dpre, dw, db, at::Tensor(), at::Tensor()};
  }
};

bool half_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

void check_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const char* op, const char* what) {
  BMT_CHECK(w.defined() && b.defined(), op, ": ", what, " needs a weight and a bias");
  BMT_CHECK(w.dim() == 2 && b.dim() == 1 && b.size(0) == w.size(0), op, ": ", what, " weight ", w.sizes(),
            " and bias ", b.sizes(), " do not match");
  BMT_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), op, ": ", what, " input ", x.sizes(), " does not match weight ",
            w.sizes());
}

void check_same_kind(std::initializer_list<const at::Tensor*> ts, const char* op) {
  const at::Tensor& x = **ts.begin();
  for (const at::Tensor* t : ts)
    BMT_CHECK(!t->defined() || (t->scalar_type() == x.scalar_type() && t->device() == x.device()), op,
              ": every operand must have the input's dtype and device (", x.scalar_type(), " on ", x.device(),
              "), got ", t->scalar_type(), " on ", t->device());
}

// The fused path: CUDA, bf16/fp16 throughout, the switch on, and gradients wanted (without them autograd is not
// involved and the separate ops cost the same minus the saved tensors).
bool fused_path_applies(std::initializer_list<const at::Tensor*> ts) {
  if (!gemm_epilogues_enabled() || !at::GradMode::is_enabled()) return false;
  const at::Tensor& x = **ts.begin();
  // (under autocast the ops inside would run in another dtype than the backward's operands)
  if (!x.is_cuda() || !half_dtype(x.scalar_type()) || at::autocast::is_autocast_enabled(at::kCUDA)) return false;
  bool grad = false;
  for (const at::Tensor* t : ts) {
    if (!t->defined()) continue;
    if (t->scalar_type() != x.scalar_type() || t->device() != x.device()) return false;
    grad = grad || t->requires_grad();
  }
  return grad;
}

}  // namespace

bool gemm_epilogues_enabled() { return g_enabled.enabled(); }

void set_gemm_epilogues_enabled(bool enabled) { g_enabled.set(enabled); }

bool gemm_autotune_enabled() { return g_autotune.enabled(); }

void set_gemm_autotune_enabled(bool enabled) { g_autotune.set(enabled); }

GeluMlpBackward gelu_mlp_backward() { return g_backward.get(); }

void set_gelu_mlp_backward(GeluMlpBackward mode) { g_backward.set(mode); }

void check_residual(const at::Tensor& residual, const at::Tensor& x, int64_t out, const char* op) {
  if (!residual.defined()) return;
  BMT_CHECK(residual.sizes() == at::IntArrayRef(with_last(x.sizes(), out)), op, ": residual ", residual.sizes(),
            " does not match the output ", at::IntArrayRef(with_last(x.sizes(), out)));
}

void check_mlp(const char* op, const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
               const at::Tensor& w_proj, const at::Tensor& b_proj, const at::Tensor& residual) {
  BMT_CHECK(w_fc.defined() && w_fc.dim() == 2 && x.dim() >= 1 && x.size(-1) == w_fc.size(1), op, ": input ",
            x.sizes(), " does not match c_fc weight ", w_fc.defined() ? w_fc.sizes() : at::IntArrayRef());
  BMT_CHECK(w_proj.defined() && w_proj.dim() == 2 && w_proj.size(1) == w_fc.size(0), op, ": c_proj weight ",
            w_proj.defined() ? w_proj.sizes() : at::IntArrayRef(), " does not take c_fc's ", w_fc.size(0), " features");
  BMT_CHECK(!b_fc.defined() || (b_fc.dim() == 1 && b_fc.size(0) == w_fc.size(0)), op, ": c_fc bias ", b_fc.sizes(),
            " does not match its ", w_fc.size(0), " output features");
  BMT_CHECK(!b_proj.defined() || (b_proj.dim() == 1 && b_proj.size(0) == w_proj.size(0)), op, ": c_proj bias ",
            b_proj.sizes(), " does not match its ", w_proj.size(0), " output features");
  check_residual(residual, x, w_proj.size(0), op);
}

at::Tensor gelu_mlp_fused(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc,
                          const at::Tensor& w_proj, const at::Tensor& b_proj, const at::Tensor& residual,
                          bool compute_output) {
  BMT_CHECK(b_fc.defined() && b_proj.defined(), "nn::gelu_mlp_fused: c_fc and c_proj need biases");
  check_mlp("nn::gelu_mlp", x, w_fc, b_fc, w_proj, b_proj, residual);
  check_same_kind({&x, &w_fc, &b_fc, &w_proj, &b_proj, &residual}, "nn::gelu_mlp_fused");
  return GeluMlpFn::apply(x, w_fc, b_fc, w_proj, b_proj,
                          residual.defined() ? std::optional<at::Tensor>(residual) : std::nullopt, compute_output);
}

at::Tensor linear_residual_fused(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                 const at::Tensor& residual) {
  check_linear(x, weight, bias, "nn::linear_residual", "the linear");
  BMT_CHECK(residual.defined(), "nn::linear_residual: needs a residual");
  check_residual(residual, x, weight.size(0), "nn::linear_residual");
  check_same_kind({&x, &weight, &bias, &residual}, "nn::linear_residual_fused");
  return LinearResidualFn::apply(x, weight, bias, residual);
}

at::Tensor gelu_mlp(const at::Tensor& x, const at::Tensor& w_fc, const at::Tensor& b_fc, const at::Tensor& w_proj,
                    const at::Tensor& b_proj, const at::Tensor& residual, bool compute_output) {
  check_mlp("nn::gelu_mlp", x, w_fc, b_fc, w_proj, b_proj, residual);
  if (b_fc.defined() && b_proj.defined() && fused_path_applies({&x, &w_fc, &b_fc, &w_proj, &b_proj, &residual}))
    return GeluMlpFn::apply(x, w_fc, b_fc, w_proj, b_proj,
                            residual.defined() ? std::optional<at::Tensor>(residual) : std::nullopt, compute_output);
  at::Tensor y = linear(at::gelu(linear(x, w_fc, b_fc), "tanh"), w_proj, b_proj);
  return residual.defined() ? residual + y : y;
}

at::Tensor linear_after_gelu_fused(const at::Tensor& h, const at::Tensor& pre, const at::Tensor& weight,
                                  const at::Tensor& bias, bool compute) {
  check_linear(h, weight, bias, "nn::linear_after_gelu", "the linear");
  BMT_CHECK(pre.defined() && pre.sizes() == h.sizes(), "nn::linear_after_gelu: the pre-activation ",
            pre.defined() ? pre.sizes() : at::IntArrayRef(), " does not match GELU's output ", h.sizes());
  check_same_kind({&h, &pre, &weight, &bias}, "nn::linear_after_gelu_fused");
  return LinearAfterGeluFn::apply(pre, weight, bias, h.detach(), compute);
}

at::Tensor linear_after_gelu(const at::Tensor& h, const at::Tensor& pre, const at::Tensor& weight,
                             const at::Tensor& bias, bool compute) {
  if (bias.defined() && weight.defined() && weight.dim() == 2 && pre.defined() && pre.sizes() == h.sizes() &&
      fused_path_applies({&h, &pre, &weight, &bias}) && (pre.requires_grad() || weight.requires_grad() ||
                                                         bias.requires_grad()))
    return linear_after_gelu_fused(h, pre, weight, bias, compute);
  if (!compute && bias.defined()) return linear_deferred(h, weight, bias);
  return linear(h, weight, bias);
}

at::Tensor linear_residual(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& residual) {
  BMT_CHECK(residual.defined() && weight.defined() && weight.dim() == 2,
            "nn::linear_residual: needs a residual and a 2-D weight");
  check_residual(residual, x, weight.size(0), "nn::linear_residual");  // (the same shape rule on every path)
  if (bias.defined() && fused_path_applies({&x, &weight, &bias, &residual}))
    return linear_residual_fused(x, weight, bias, residual);
  return residual + linear(x, weight, bias);
}

}  // namespace bmt::nn
