// The fp64 reference of an FP8 linear and the error bound FP8 rounding gives (tests/nn/test_fp8_linear.cpp on
// CPU, tests/cuda/test_fp8_cuda.cpp on a GPU), and one FP8 linear's run for the delayed-scale tests.
#pragma once

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "bmt/nn/fp8_linear.h"

namespace fp8_test {

using bmt::nn::Fp8Format;

// Unit roundoff of a format with `man_bits` mantissa bits (round to nearest: half a unit in the last place).
inline double unit_roundoff(int man_bits) { return std::ldexp(1.0, -(man_bits + 1)); }

// The bound of an FP8 GEMM c = a b^T with a, b quantised per tensor, against the exact product (fp64).
// Quantising one element v (scaled by s, rounded to nearest, unscaled) gives v(1 + d) + e with |d| <= u (u = 2^-4
// for E4M3's 3 mantissa bits, 2^-3 for E5M2's 2) in the normal range, and |e| <= a = (half the smallest subnormal)
// / s below it (2^-10 / s for E4M3, 2^-17 / s for E5M2): so |q(v) - v| <= u|v| + a. Per element of c:
//   |sum_k q(a_ik) q(b_jk) - a_ik b_jk| <= sum_k (u_a|a_ik| + a_a)|b_jk| + |a_ik|(u_b|b_jk| + a_b)
//                                                 + (u_a|a_ik| + a_a)(u_b|b_jk| + a_b)
// (no cancellation assumed: absolute values), plus the GEMM's fp32 accumulation (at most K 2^-24 sum_k |q(a)||q(b)|;
// we allow 2^-20 K), plus the output's rounding (u_out |c|: 2^-24 for fp32, 2^-8 for bf16; scales are fp32, their
// rounding is within the fp32 terms). Saturation never occurs: the scale maps amax onto fp8_max.
// Rowwise scaling: the same with a's and b's scales (so the subnormal terms a_a, a_b) per row of each.
inline at::Tensor gemm_bound(const at::Tensor& a, const at::Tensor& b, Fp8Format fa, Fp8Format fb,
                             const at::Tensor& exact, double u_out, bool rowwise = false) {
  auto u = [](Fp8Format f) { return unit_roundoff(f == Fp8Format::kE4M3 ? 3 : 2); };
  auto absolute = [rowwise](const at::Tensor& t, Fp8Format f) {  // [rows, 1] (rowwise) or 0-dim
    const at::Tensor amax = rowwise ? t.abs().amax(1, /*keepdim=*/true) : t.abs().max();
    const double fmax = f == Fp8Format::kE4M3 ? 448.0 : 57344.0;
    const at::Tensor inv_scale = at::where(amax > 0, amax / fmax, at::ones_like(amax));
    return inv_scale * std::ldexp(1.0, f == Fp8Format::kE4M3 ? -10 : -17);
  };
  const at::Tensor A = a.abs(), B = b.abs();
  const at::Tensor ea = A * u(fa) + absolute(a, fa), eb = B * u(fb) + absolute(b, fb);
  const int64_t K = a.size(1);
  return ea.mm(B.t()) + A.mm(eb.t()) + ea.mm(eb.t()) + A.mm(B.t()) * (std::ldexp(1.0, -20) * K) +
         exact.abs() * u_out;
}

inline void expect_within(const at::Tensor& got, const at::Tensor& exact, const at::Tensor& bound,
                          const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), exact.sizes()) << what;
  const at::Tensor err = (got.to(at::kDouble) - exact).abs();
  EXPECT_TRUE((err <= bound).all().item<bool>())
      << what << ": worst error / bound " << (err / bound).max().item<double>();
  // FP8 was really used: an fp32 or bf16 GEMM would be far more accurate than a quarter of the FP8 bound
  EXPECT_GT((err / bound).max().item<double>(), 0.02) << what << ": suspiciously exact";
}

// y = x W^T + b and its three gradients on `device` against fp64, inputs exactly representable in dt. Rowwise
// scaling casts every operand to E4M3 (grad_format is then ignored).
inline void check_fp8_linear(at::Device device, at::ScalarType dt, Fp8Format grad_format, int64_t rows, int64_t in,
                             int64_t out, bmt::nn::Fp8Scaling scaling = bmt::nn::Fp8Scaling::kTensor) {
  const bool rowwise = scaling == bmt::nn::Fp8Scaling::kRow;
  if (rowwise) grad_format = Fp8Format::kE4M3;
  SCOPED_TRACE(std::string("dtype ") + c10::toString(dt) + " grad " +
               (grad_format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") + (rowwise ? " rowwise" : " per tensor"));
  // inputs exactly representable in dt, so the fp64 reference sees the same numbers
  const at::Tensor x0 = at::randn({2, rows / 2, in}).to(dt), w0 = (at::randn({out, in}) * 0.05).to(dt);
  const at::Tensor b0 = at::randn({out}).to(dt), g0 = at::randn({2, rows / 2, out}).to(dt);
  at::Tensor x = x0.to(device).requires_grad_(), w = w0.to(device).requires_grad_();
  at::Tensor b = b0.to(device).requires_grad_();
  ASSERT_TRUE(bmt::nn::fp8_linear_applies(x, w));
  const at::Tensor y = bmt::nn::fp8_linear(x, w, b, grad_format, scaling);
  ASSERT_EQ(y.scalar_type(), dt);
  y.backward(g0.to(device));

  const at::Tensor xd = x0.to(at::kDouble).view({rows, in}), wd = w0.to(at::kDouble), bd = b0.to(at::kDouble);
  const at::Tensor gd = g0.to(at::kDouble).view({rows, out});
  const double u_out = dt == at::kFloat ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);
  const at::Tensor y_exact = xd.mm(wd.t());  // the bias is added exactly up to the output's rounding
  expect_within(y.view({rows, out}).to(at::kDouble).cpu() - bd, y_exact,
                gemm_bound(xd, wd, Fp8Format::kE4M3, Fp8Format::kE4M3, y_exact, u_out, rowwise) +
                    (y_exact + bd).abs() * u_out,
                "forward");
  const at::Tensor dx_exact = gd.mm(wd);
  expect_within(x.grad().view({rows, in}).cpu(), dx_exact,
                gemm_bound(gd, wd.t(), grad_format, Fp8Format::kE4M3, dx_exact, u_out, rowwise), "dgrad");
  const at::Tensor dw_exact = gd.t().mm(xd);
  expect_within(w.grad().cpu(), dw_exact,
                gemm_bound(gd.t(), xd.t(), grad_format, Fp8Format::kE4M3, dw_exact, u_out, rowwise), "wgrad");
  // the bias gradient is summed in fp32 from the unquantised dy: fp32 accuracy, then one rounding into dt
  const at::Tensor db_exact = gd.sum(0);
  const at::Tensor db_err = (b.grad().cpu().to(at::kDouble) - db_exact).abs();
  EXPECT_TRUE((db_err <= db_exact.abs() * u_out + gd.abs().sum(0) * (rows * std::ldexp(1.0, -23))).all().item<bool>())
      << "bias gradient: max error " << db_err.max().item<double>();
}

// One fp8_linear forward and backward (per-tensor scales, E5M2 gradients, the layer's delayed scales when given):
// its output and gradients (tests/nn/test_fp8_delayed*.cpp).
struct LinearRun {
  at::Tensor y, dx, dw, db;
};

inline LinearRun run_linear(const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& b0, const at::Tensor& g,
                            bmt::nn::Fp8LinearScales* scales) {
  at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
  const at::Tensor y = bmt::nn::fp8_linear(x, w, b, Fp8Format::kE5M2, bmt::nn::Fp8Scaling::kTensor, true, scales);
  y.backward(g);
  return {y.detach(), x.grad(), w.grad(), b.grad()};
}

}  // namespace fp8_test
