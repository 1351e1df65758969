// CPU twin of the fused-epilogue GEMMs (gemm_epilogue_internal.h): plain loops in fp64, the reference the CUDA
// test compares with, and the shared argument checks. Not fast: the LibTorch layer's CPU path uses torch's ops.
#include <algorithm>
#include <cmath>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/float_elements_cpu_internal.h"
#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/core/kernels/gemm_epilogue_internal.h"

namespace bmt::core::kernels {
namespace {

double load(const void* p, DType dtype, int64_t i) { return load_float_element(p, dtype, i, "gemm_epilogue"); }

void store(void* p, DType dtype, int64_t i, double v) { store_float_element(p, dtype, i, v, "gemm_epilogue"); }

constexpr double kSqrt2OverPi = 0.7978845608028654, kCubic = 0.044715;

double gelu_tanh_d(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x))); }

double gelu_tanh_grad_d(double x) {
  const double t = std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kCubic * x * x);
}

}  // namespace

const char* gemm_epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kBias: return "bias";
    case GemmEpilogue::kGeluAuxBias: return "gelu_aux_bias";
    case GemmEpilogue::kDGeluBGrad: return "dgelu_bgrad";
    case GemmEpilogue::kDGelu: return "dgelu";
  }
  return "unknown";
}

float gelu_tanh(float x) { return static_cast<float>(gelu_tanh_d(x)); }
float gelu_tanh_grad(float x) { return static_cast<float>(gelu_tanh_grad_d(x)); }

void check_gemm_epilogue_args(const GemmEpilogueArgs& g, const char* op) {
  BMT_CHECK(g.rows >= 0 && g.cols >= 0 && g.inner >= 0, op, ": negative shape rows=", g.rows, " cols=", g.cols,
            " inner=", g.inner);
  BMT_CHECK(g.dtype == DType::kFloat32 || g.dtype == DType::kBFloat16 || g.dtype == DType::kFloat16, op,
            ": dtype ", dtype_name(g.dtype), " is not fp32, bf16 or fp16");
  const bool empty = g.rows == 0 || g.cols == 0;
  BMT_CHECK(empty || (g.out && (g.inner == 0 || (g.a && g.b))), op, ": null a, b or out for a ", g.rows, "x",
            g.cols, "x", g.inner, " problem");
  const char* epi = gemm_epilogue_name(g.epilogue);
  switch (g.epilogue) {
    case GemmEpilogue::kBias: break;
    case GemmEpilogue::kGeluAuxBias:
      BMT_CHECK(empty || (g.bias && g.aux), op, ": epilogue ", epi, " needs a bias and an aux (pre-activation) output");
      break;
    case GemmEpilogue::kDGeluBGrad:
      BMT_CHECK(g.cols == 0 || g.bias, op, ": epilogue ", epi, " needs a bias-gradient output");
      BMT_CHECK(empty || g.aux, op, ": epilogue ", epi, " needs the forward's pre-activation (aux)");
      break;
    case GemmEpilogue::kDGelu:
      BMT_CHECK(empty || g.aux, op, ": epilogue ", epi, " needs the forward's pre-activation (aux)");
      break;
  }
  BMT_CHECK(!g.residual || g.epilogue == GemmEpilogue::kBias, op, ": a residual is added only with the bias epilogue, not ",
            epi);
  BMT_CHECK(!g.fp8 || (g.fp8->a_inv_scale && g.fp8->b_inv_scale), op, ": FP8 operands without their inverse scales");
  if (g.fp8 && g.fp8->out_scale) {
    BMT_CHECK(g.fp8->out_amax, op, ": an FP8 output needs its amax output (out_amax)");
    BMT_CHECK(!g.residual && (g.epilogue == GemmEpilogue::kBias || g.epilogue == GemmEpilogue::kGeluAuxBias), op,
              ": an FP8 output takes the bias or gelu_aux_bias epilogue without a residual, not ", epi,
              g.residual ? " with a residual" : "");
  }
}

void gemm_epilogue_cpu(const GemmEpilogueArgs& g) {
  check_gemm_epilogue_args(g, "gemm_epilogue_cpu");
  const DType dt = g.dtype;
  // an operand's element: dtype, or FP8 bytes (the product is scaled by both inverse scales below)
  auto operand = [&](const void* p, int64_t i, bool is_a) {
    if (!g.fp8) return load(p, dt, i);
    return static_cast<double>(
        fp8_to_float(static_cast<const uint8_t*>(p)[i], is_a ? g.fp8->a_format : g.fp8->b_format));
  };
  const double product_scale =
      g.fp8 ? static_cast<double>(*g.fp8->a_inv_scale) * static_cast<double>(*g.fp8->b_inv_scale) : 1.0;
  std::vector<double> bias_grad(g.epilogue == GemmEpilogue::kDGeluBGrad ? g.cols : 0, 0.0);
  // FP8 output: the value rounded to fp32 (as a 16-bit output is, through fp32), scaled in fp32, then encoded
  const bool out_fp8 = g.fp8 && g.fp8->out_scale;
  float out_amax = 0.0f;
  auto store_out = [&](int64_t o, double v) {
    if (!out_fp8) return store(g.out, dt, o, v);
    const float f = static_cast<float>(v);
    out_amax = std::isnan(f) || std::isnan(out_amax) ? NAN : std::max(out_amax, std::fabs(f));
    static_cast<uint8_t*>(g.out)[o] = float_to_fp8(f * *g.fp8->out_scale, g.fp8->out_format);
  };
  for (int64_t r = 0; r < g.rows; ++r) {
    for (int64_t c = 0; c < g.cols; ++c) {
      double acc = 0.0;
      for (int64_t k = 0; k < g.inner; ++k) {
        const double bv = operand(g.b, g.b_transposed ? c * g.inner + k : k * g.cols + c, false);
        acc += operand(g.a, r * g.inner + k, true) * bv;
      }
      acc *= product_scale;
      const int64_t o = r * g.cols + c;
      switch (g.epilogue) {
        case GemmEpilogue::kBias:
          if (g.bias) acc += load(g.bias, dt, c);
          if (g.residual) acc += load(g.residual, dt, o);
          store_out(o, acc);
          break;
        case GemmEpilogue::kGeluAuxBias:
          acc += load(g.bias, dt, c);
          store(g.aux, dt, o, acc);
          store_out(o, gelu_tanh_d(acc));
          break;
        case GemmEpilogue::kDGeluBGrad:
        case GemmEpilogue::kDGelu: {
          const double d = acc * gelu_tanh_grad_d(load(g.aux, dt, o));
          store(g.out, dt, o, d);
          if (g.epilogue == GemmEpilogue::kDGeluBGrad) bias_grad[c] += d;
          break;
        }
      }
    }
  }
  for (int64_t c = 0; c < static_cast<int64_t>(bias_grad.size()); ++c) store(g.bias, dt, c, bias_grad[c]);
  if (out_fp8) *g.fp8->out_amax = std::isnan(*g.fp8->out_amax) ? NAN : std::max(*g.fp8->out_amax, out_amax);
}

}  // namespace bmt::core::kernels
