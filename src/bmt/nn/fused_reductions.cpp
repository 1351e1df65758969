#include "bmt/nn/fused_reductions.h"

#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <cmath>


#include "bmt/core/error.h"
#include "bmt/core/kernels/column_reduce_internal.h"
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

EnvSwitch g_enabled("BMT_FUSED_REDUCTIONS");

bool supported_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

bool any_requires_grad(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// dgamma = sum_r dy * (x - mean) * rstd, dbeta = sum_r dy over the rows of [rows, cols] views; either may be skipped.
void layer_norm_param_grads(const at::Tensor& dy2, const at::Tensor& x2, const at::Tensor& mean, const at::Tensor& rstd,
                            at::ScalarType out_dtype, at::Tensor* dgamma, at::Tensor* dbeta) {
  const int64_t rows = dy2.size(0);
  if (dy2.is_cuda()) {
#ifdef BMT_WITH_CUDA
    const int64_t cols = dy2.size(1);
    c10::cuda::CUDAGuard guard(dy2.device());
    const core::DType dt = to_core_dtype(dy2.scalar_type());
    at::Tensor ws = at::empty({2 * k::column_reduce_workspace_numel(rows, cols, dt)}, dy2.options().dtype(at::kFloat));
    if (dgamma) *dgamma = at::empty({cols}, dy2.options().dtype(out_dtype));
    if (dbeta) *dbeta = at::empty({cols}, dy2.options().dtype(out_dtype));
    k::layer_norm_param_grads_cuda(dy2.data_ptr(), x2.data_ptr(), dt, mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                   rows, cols, dgamma ? dgamma->data_ptr() : nullptr,
                                   dbeta ? dbeta->data_ptr() : nullptr, to_core_dtype(out_dtype), ws.data_ptr<float>(),
                                   current_stream_handle(dy2));
    return;
#else
    BMT_ERROR("nn::layer_norm: CUDA tensors, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
  }
  const at::Tensor g = dy2.to(at::kFloat);
  if (dgamma) {
    const at::Tensor xhat = (x2.to(at::kFloat) - mean.view({rows, 1})) * rstd.view({rows, 1});
    *dgamma = (g * xhat).sum(0).to(out_dtype);
  }
  if (dbeta) *dbeta = g.sum(0).to(out_dtype);
}

struct LinearReducedBiasGradFn : torch::autograd::Function<LinearReducedBiasGradFn> {
  // compute = false: y is allocated, not computed (linear_deferred).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            bool compute) {
    ctx->save_for_backward({x, weight});
    // at::linear of a 3-D input returns a view of its 2-D GEMM result, and autograd forbids in-place ops on a view
    // made inside a custom Function (`y += b` in a user's forward): the GEMM writes into a fresh tensor instead.
    if (x.dim() <= 2 && compute) return at::linear(x, weight, bias);
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    at::Tensor y = compute ? at::empty(sizes, x.options()) : deferred_output(sizes, x.options());
    if (compute) linear_fill(x, weight, bias, y);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const int64_t out = weight.size(0), in = weight.size(1);
    const at::Tensor dy2 = grads[0].contiguous().view({-1, out});
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = dy2.mm(weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = dy2.t().mm(x.reshape({-1, in}));
    if (ctx->needs_input_grad(2)) db = column_sum(dy2, weight.scalar_type());
    return {dx, dw, db, at::Tensor()};
  }
};

struct LayerNormReducedParamGradsFn : torch::autograd::Function<LayerNormReducedParamGradsFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            int64_t dim, double eps) {
    auto [y, mean, rstd] = at::native_layer_norm(x, {dim}, weight, bias, eps);
    ctx->save_for_backward({x, weight, bias, mean, rstd});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["eps"] = eps;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2], &mean = saved[3], &rstd = saved[4];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor dx;
    if (ctx->needs_input_grad(0))
      dx = std::get<0>(
          at::native_layer_norm_backward(dy, x, {dim}, mean, rstd, weight, bias, {true, false, false}));
    const bool want_w = ctx->needs_input_grad(1), want_b = ctx->needs_input_grad(2);
    at::Tensor dw, db;
    if (want_w || want_b) {
      at::Tensor m = mean, r = rstd;
      if (m.scalar_type() != at::kFloat || r.scalar_type() != at::kFloat) {
        // (CPU: torch keeps half inputs' statistics in their dtype; the gradients want them in fp32, as on CUDA)
        const at::Tensor xf = x.to(at::kFloat);
        m = xf.mean(-1);
        r = at::rsqrt(xf.var(-1, /*unbiased=*/false) + ctx->saved_data["eps"].toDouble());
      }
      m = m.contiguous().view({-1});
      r = r.contiguous().view({-1});
      layer_norm_param_grads(dy.view({-1, dim}), x.contiguous().view({-1, dim}), m, r, weight.scalar_type(),
                             want_w ? &dw : nullptr, want_b ? &db : nullptr);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool fused_reductions_enabled() { return g_enabled.enabled(); }

void set_fused_reductions_enabled(bool enabled) { g_enabled.set(enabled); }

namespace {

#ifdef BMT_WITH_CUDA
// The column-sum kernel on a 2-D CUDA matrix: the sums of its rows, or with pre (defined) those of matrix * gelu'(pre)
// with that product written to *dgrad; amax_partials (may be null) as column_sum documents.
at::Tensor column_sums_cuda(const at::Tensor& matrix, const at::Tensor& pre, at::ScalarType out_dtype,
                            at::Tensor* amax_partials, at::Tensor* dgrad) {
  c10::cuda::CUDAGuard guard(matrix.device());
  const at::Tensor m = matrix.contiguous();
  const int64_t rows = m.size(0), cols = m.size(1);
  const core::DType dt = to_core_dtype(m.scalar_type());
  at::Tensor out = at::empty({cols}, m.options().dtype(out_dtype));
  at::Tensor ws = at::empty({k::column_reduce_workspace_numel(rows, cols, dt)}, m.options().dtype(at::kFloat));
  uint32_t* partials = nullptr;
  if (amax_partials) {
    *amax_partials = at::empty({k::column_sum_amax_partials(rows, cols, dt)}, m.options().dtype(at::kInt));
    partials = static_cast<uint32_t*>(amax_partials->data_ptr());
  }
  if (pre.defined()) {
    const at::Tensor x = pre.contiguous();
    *dgrad = at::empty_like(m);
    k::dgelu_column_sum_cuda(m.data_ptr(), x.data_ptr(), dt, rows, cols, dgrad->data_ptr(), out.data_ptr(),
                             to_core_dtype(out_dtype), ws.data_ptr<float>(), current_stream_handle(m), partials);
  } else {
    k::column_sum_cuda(m.data_ptr(), dt, rows, cols, out.data_ptr(), to_core_dtype(out_dtype), ws.data_ptr<float>(),
                       current_stream_handle(m), partials);
  }
  return out;
}
#endif

}  // namespace

at::Tensor column_sum(const at::Tensor& matrix, at::ScalarType out_dtype, at::Tensor* amax_partials) {
  BMT_CHECK(matrix.dim() == 2, "nn::column_sum: expected a 2-D tensor, got ", matrix.dim(), " dimensions");
  BMT_CHECK(supported_dtype(matrix.scalar_type()) && supported_dtype(out_dtype),
            "nn::column_sum: dtypes must be fp32, bf16 or fp16, got ", matrix.scalar_type(), " -> ", out_dtype);
  if (!matrix.is_cuda()) {
    if (amax_partials) *amax_partials = at::Tensor();
    return matrix.sum(0, /*keepdim=*/false, at::kFloat).to(out_dtype);
  }
#ifdef BMT_WITH_CUDA
  return column_sums_cuda(matrix, at::Tensor(), out_dtype, amax_partials, nullptr);
#else
  BMT_ERROR("nn::column_sum: a CUDA tensor, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
}

std::pair<at::Tensor, at::Tensor> dgelu_column_sum(const at::Tensor& dy, const at::Tensor& pre,
                                                   at::ScalarType sum_dtype, at::Tensor* amax_partials) {
  BMT_CHECK(dy.dim() == 2 && dy.sizes() == pre.sizes() && dy.scalar_type() == pre.scalar_type() &&
                dy.device() == pre.device(),
            "nn::dgelu_column_sum: dy ", dy.sizes(), " ", dy.scalar_type(), " and pre ", pre.sizes(), " ",
            pre.scalar_type(), " must be 2-D tensors of one shape, dtype and device");
  BMT_CHECK(supported_dtype(dy.scalar_type()) && supported_dtype(sum_dtype),
            "nn::dgelu_column_sum: dtypes must be fp32, bf16 or fp16, got ", dy.scalar_type(), " -> ", sum_dtype);
  if (!dy.is_cuda()) {
    if (amax_partials) *amax_partials = at::Tensor();
    at::Tensor dpre = at::gelu_backward(dy, pre, "tanh");
    at::Tensor db = column_sum(dpre, sum_dtype);
    return {std::move(dpre), std::move(db)};
  }
#ifdef BMT_WITH_CUDA
  at::Tensor dpre;
  at::Tensor db = column_sums_cuda(dy, pre, sum_dtype, amax_partials, &dpre);
  return {std::move(dpre), std::move(db)};
#else
  BMT_ERROR("nn::dgelu_column_sum: a CUDA tensor, but this bmtrain was built without CUDA (BMT_WITH_CUDA=OFF)");
#endif
}

at::Tensor linear_reduced_bias_grad(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  BMT_CHECK(bias.defined(), "nn::linear_reduced_bias_grad: needs a bias");
  BMT_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
            "nn::linear_reduced_bias_grad: input ", x.sizes(), " does not match weight ", weight.sizes());
  return LinearReducedBiasGradFn::apply(x, weight, bias, true);
}

at::Tensor linear_deferred(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  BMT_CHECK(bias.defined(), "nn::linear_deferred: needs a bias");
  BMT_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
            "nn::linear_deferred: input ", x.sizes(), " does not match weight ", weight.sizes());
  return LinearReducedBiasGradFn::apply(x, weight, bias, false);
}

at::Tensor deferred_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  // NaN rather than whatever the allocator held: code that reads it without computing it first (a C++ extension
  // the routing mode does not see) makes the loss NaN instead of silently wrong gradients.
  return at::isFloatingType(options.dtype().toScalarType()) ? at::full(sizes, std::nanf(""), options)
                                                            : at::empty(sizes, options);
}

void linear_fill(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& y) {
  BMT_CHECK(y.is_contiguous() && y.size(-1) == weight.size(0) && y.numel() / weight.size(0) == x.numel() / x.size(-1),
            "nn::linear_fill: output ", y.sizes(), " does not fit input ", x.sizes(), " and weight ", weight.sizes());
  at::NoGradGuard no_grad;  // (y may need gradients: it is a deferred node's output)
  at::Tensor y2 = y.view({-1, weight.size(0)});
  if (bias.defined()) at::addmm_out(y2, bias, x.reshape({-1, weight.size(1)}), weight.t());
  else at::mm_out(y2, x.reshape({-1, weight.size(1)}), weight.t());
}

at::Tensor layer_norm_reduced_param_grads(const at::Tensor& x, int64_t dim, const at::Tensor& weight,
                                          const at::Tensor& bias, double eps) {
  // (torch's C++ autograd functions take no undefined inputs: a LayerNorm without bias stays at::layer_norm)
  BMT_CHECK(weight.defined() && bias.defined(), "nn::layer_norm_reduced_param_grads: needs a weight and a bias");
  BMT_CHECK(x.dim() >= 1 && x.size(-1) == dim && weight.numel() == dim,
            "nn::layer_norm_reduced_param_grads: input ", x.sizes(), " and weight ", weight.sizes(),
            " do not match dim ", dim);
  return LayerNormReducedParamGradsFn::apply(x, weight, bias, dim, eps);
}

namespace {

// What both dispatchers ask before taking the fused path: a CUDA input that needs gradients, with a weight and a
// bias of its (supported) dtype, and the switch on.
bool fused_path_applies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  // (not under autocast: the forward would run in another dtype than the backward's saved operands)
  return weight.defined() && bias.defined() && x.is_cuda() && x.dim() >= 1 && fused_reductions_enabled() &&
         !at::autocast::is_autocast_enabled(at::kCUDA) &&
         supported_dtype(x.scalar_type()) && weight.scalar_type() == x.scalar_type() &&
         bias.scalar_type() == x.scalar_type() && any_requires_grad({&x, &weight, &bias});
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const bool fused = fused_path_applies(x, weight, bias) && weight.dim() == 2;
  return fused ? LinearReducedBiasGradFn::apply(x, weight, bias, true) : at::linear(x, weight, bias);
}

at::Tensor layer_norm(const at::Tensor& x, int64_t dim, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const bool fused = fused_path_applies(x, weight, bias) && x.size(-1) == dim;
  return fused ? layer_norm_reduced_param_grads(x, dim, weight, bias, eps)
               : at::layer_norm(x, {dim}, weight, bias, eps);
}

}  // namespace bmt::nn
