// The FP8 epilogue GEMMs' CPU twin (core/kernels/gemm_epilogue with FP8 operands) against torch in fp64 on the
// dequantised operands, every epilogue; and nn::fp8_gelu_mlp's fused autograd function (the twin's epilogues on
// CPU) against the separate composition it replaces (nn::fp8_linear, at::gelu, nn::fp8_linear, the residual add):
// in fp32 the two agree to fp32 rounding (the only difference is GELU reading an fp64 instead of an fp32 sum), in
// bf16 to FP8 rounding; the recompute tail (compute_output = false) keeps every gradient; bad shapes name themselves.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>

#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/nn/fp8_linear_internal.h"
#include "bmt/nn/fp8_mlp.h"
#include "bmt/nn/fused_linear.h"

namespace k = bmt::core::kernels;
using bmt::nn::Fp8Format;

namespace {

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-30);
}

at::Tensor dequant(const at::Tensor& q, const at::Tensor& inv) { return q.to(at::kDouble) * inv.item<double>(); }

at::Tensor gelu_d(const at::Tensor& x) { return at::gelu(x, "tanh"); }

at::Tensor gelu_grad_d(const at::Tensor& x) {
  return at::gelu_backward(at::ones_like(x), x, "tanh");
}

// a bf16 result against its fp64 value: one rounding (2^-8 relative, with slack for gelu's tanh in fp64 vs the
// twin's) plus an absolute floor for values near zero
void expect_rounded(const at::Tensor& got, const at::Tensor& want, double floor, const char* what) {
  const at::Tensor err = (got.to(at::kDouble) - want).abs();
  EXPECT_TRUE((err <= want.abs() * std::ldexp(1.0, -7) + floor).all().item<bool>())
      << what << ": max error " << err.max().item<double>();
}

struct MlpGrads {
  at::Tensor y, dx, dw1, db1, dw2, db2, dres;
};

MlpGrads run_mlp(bool fused, const at::Tensor& x0, const at::Tensor& w10, const at::Tensor& b10, const at::Tensor& w20,
                 const at::Tensor& b20, const at::Tensor& r0, const at::Tensor& g, Fp8Format gf, bool compute = true) {
  at::Tensor x = x0.clone().requires_grad_(), w1 = w10.clone().requires_grad_(), b1 = b10.clone().requires_grad_();
  at::Tensor w2 = w20.clone().requires_grad_(), b2 = b20.clone().requires_grad_(), r = r0.clone().requires_grad_();
  at::Tensor y;
  if (fused) {
    y = bmt::nn::fp8_gelu_mlp_fused(x, w1, b1, w2, b2, r, gf, compute);
  } else {  // the composition the fused function replaces (what fp8_gelu_mlp runs where it does not apply)
    const at::Tensor h = at::gelu(bmt::nn::fp8_linear(x, w1, b1, gf), "tanh");
    y = r + bmt::nn::fp8_linear(h, w2, b2, gf);
  }
  y.backward(g);
  return {y.detach(), x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad(), r.grad()};
}

}  // namespace

TEST(Fp8GemmEpilogueTwin, EveryEpilogueMatchesTorchOnTheDequantisedOperands) {
  at::manual_seed(41);
  const int64_t rows = 32, inner = 48, cols = 64;
  const at::Tensor a = at::randn({rows, inner}), w = at::randn({cols, inner}) * 0.1;
  const bmt::nn::Fp8Tensor aq = bmt::nn::fp8_cast(a, Fp8Format::kE5M2, true, false);
  const bmt::nn::Fp8Tensor wq = bmt::nn::fp8_cast(w, Fp8Format::kE4M3, true, false);
  const at::Tensor prod = dequant(aq.data, aq.inv).mm(dequant(wq.data, wq.inv).t());  // exact in fp64
  const at::Tensor bias = at::randn({cols}).to(at::kBFloat16), res = at::randn({rows, cols}).to(at::kBFloat16);
  const at::Tensor bd = bias.to(at::kDouble), rd = res.to(at::kDouble);
  auto run = [&](k::GemmEpilogue e, const at::Tensor& out, const at::Tensor& b, const at::Tensor& aux,
                 const at::Tensor& r) {
    ASSERT_TRUE(bmt::nn::fp8_gemm_epilogue(e, aq.data, Fp8Format::kE5M2, aq.inv, wq.data, Fp8Format::kE4M3, wq.inv,
                                           false, out, b, aux, r));
  };
  at::Tensor out = at::empty({rows, cols}, at::kBFloat16);
  run(k::GemmEpilogue::kBias, out, bias, {}, res);
  expect_rounded(out, prod + bd + rd, 1e-6, "bias + residual");
  at::Tensor aux = at::empty_like(out);
  run(k::GemmEpilogue::kGeluAuxBias, out, bias, aux, {});
  expect_rounded(aux, prod + bd, 1e-6, "gelu aux (pre-activation)");
  expect_rounded(out, gelu_d(prod + bd), 1e-6, "gelu output");
  // DGELU reads aux as stored (bf16)
  run(k::GemmEpilogue::kDGelu, out, {}, aux, {});
  expect_rounded(out, prod * gelu_grad_d(aux.to(at::kDouble)), 1e-6, "dgelu");
  // FP8 really in use: the dequantised product differs from the unquantised one by more than bf16 rounding
  EXPECT_GT(rel_diff(prod, a.to(at::kDouble).mm(w.to(at::kDouble).t())), 0.01);
}

TEST(Fp8GemmEpilogueTwin, NeedsBothInverseScales) {
  const at::Tensor q = at::zeros({16, 16}, at::kFloat8_e4m3fn), out = at::empty({16, 16}, at::kBFloat16);
  k::Fp8GemmOperands f8;  // no scales
  k::GemmEpilogueArgs g;
  g.rows = g.cols = g.inner = 16;
  g.a = g.b = q.data_ptr();
  g.out = out.data_ptr();
  g.fp8 = &f8;
  try {
    k::gemm_epilogue_cpu(g);
    ADD_FAILURE() << "accepted FP8 operands without scales";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("without their inverse scales"), std::string::npos) << e.what();
  }
}

TEST(Fp8GeluMlp, FusedEqualsTheSeparateCompositionInFp32) {
  at::manual_seed(42);
  const int64_t rows = 32, in = 48, hidden = 128, out = 48;
  const at::Tensor x = at::randn({2, rows / 2, in}), w1 = at::randn({hidden, in}) * 0.1, b1 = at::randn({hidden}) * 0.1;
  const at::Tensor w2 = at::randn({out, hidden}) * 0.1, b2 = at::randn({out}) * 0.1, r = at::randn({2, rows / 2, out});
  const at::Tensor g = at::randn({2, rows / 2, out});
  for (Fp8Format gf : {Fp8Format::kE5M2, Fp8Format::kE4M3}) {
    SCOPED_TRACE(gf == Fp8Format::kE5M2 ? "e5m2 gradients" : "e4m3 gradients");
    const MlpGrads f = run_mlp(true, x, w1, b1, w2, b2, r, g, gf), s = run_mlp(false, x, w1, b1, w2, b2, r, g, gf);
    EXPECT_LT(rel_diff(f.y, s.y), 1e-5);
    EXPECT_LT(rel_diff(f.dx, s.dx), 1e-5);
    EXPECT_LT(rel_diff(f.dw1, s.dw1), 1e-5);
    EXPECT_LT(rel_diff(f.db1, s.db1), 1e-5);
    EXPECT_LT(rel_diff(f.dw2, s.dw2), 1e-5);
    EXPECT_LT(rel_diff(f.db2, s.db2), 1e-5);
    EXPECT_TRUE(at::equal(f.dres, g)) << "the residual's gradient is dy";
    // and both are FP8: far from the fp32 MLP
    const at::Tensor exact = r + at::linear(at::gelu(at::linear(x, w1, b1), "tanh"), w2, b2);
    EXPECT_GT(rel_diff(f.y - r, exact - r), 1e-3);
  }
}

TEST(Fp8GeluMlp, FusedIsWithinFp8RoundingOfTheSeparateCompositionInBf16) {
  at::manual_seed(43);
  const int64_t rows = 64, in = 64, hidden = 256, out = 64;
  auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  const at::Tensor x = bf(at::randn({rows, in})), w1 = bf(at::randn({hidden, in}) * 0.1), b1 = bf(at::randn({hidden}) * 0.1);
  const at::Tensor w2 = bf(at::randn({out, hidden}) * 0.1), b2 = bf(at::randn({out}) * 0.1), r = bf(at::randn({rows, out}));
  const at::Tensor g = bf(at::randn({rows, out}));
  const MlpGrads f = run_mlp(true, x, w1, b1, w2, b2, r, g, Fp8Format::kE5M2);
  const MlpGrads s = run_mlp(false, x, w1, b1, w2, b2, r, g, Fp8Format::kE5M2);
  // GELU on the unrounded sum moves h by up to a bf16 ulp (2^-8), which flips the FP8 rounding of a few elements
  // of h (and of d pre) by one FP8 ulp (2^-3 for E4M3): a percent-level difference in norm, far under FP8's own error
  EXPECT_LT(rel_diff(f.y - r, s.y - r), 0.03);
  for (auto [got, want, what] : {std::tuple{f.dx, s.dx, "dx"}, {f.dw1, s.dw1, "dw_fc"}, {f.db1, s.db1, "db_fc"},
                                 {f.dw2, s.dw2, "dw_proj"}, {f.db2, s.db2, "db_proj"}})
    EXPECT_LT(rel_diff(got, want), 0.05) << what;
}

TEST(Fp8GeluMlp, RecomputeTailKeepsEveryGradient) {
  at::manual_seed(44);
  const at::Tensor x = at::randn({32, 32}), w1 = at::randn({64, 32}) * 0.1, b1 = at::randn({64}) * 0.1;
  const at::Tensor w2 = at::randn({32, 64}) * 0.1, b2 = at::randn({32}) * 0.1, r = at::randn({32, 32});
  const at::Tensor g = at::randn({32, 32});
  const MlpGrads full = run_mlp(true, x, w1, b1, w2, b2, r, g, Fp8Format::kE5M2, true);
  const MlpGrads tail = run_mlp(true, x, w1, b1, w2, b2, r, g, Fp8Format::kE5M2, false);
  EXPECT_TRUE(at::equal(full.dx, tail.dx) && at::equal(full.dw1, tail.dw1) && at::equal(full.db1, tail.db1) &&
              at::equal(full.dw2, tail.dw2) && at::equal(full.db2, tail.db2) && at::equal(full.dres, tail.dres));
}

TEST(Fp8GeluMlp, WithoutGradientsAndOnTheSeparatePathTheForwardIsTheSame) {
  at::manual_seed(45);
  const at::Tensor x = at::randn({32, 32}), w1 = at::randn({64, 32}) * 0.1, b1 = at::randn({64}) * 0.1;
  const at::Tensor w2 = at::randn({32, 64}) * 0.1, b2 = at::randn({32}) * 0.1;
  at::Tensor with_grad = bmt::nn::fp8_gelu_mlp_fused(x, w1.clone().requires_grad_(), b1, w2, b2, {}, Fp8Format::kE5M2);
  at::Tensor no_grad;
  {
    at::NoGradGuard guard;
    no_grad = bmt::nn::fp8_gelu_mlp_fused(x, w1, b1, w2, b2, {}, Fp8Format::kE5M2);
  }
  EXPECT_TRUE(at::equal(with_grad.detach(), no_grad));
  // CPU tensors take the separate composition in fp8_gelu_mlp (the twin is the fused path's test reference only)
  const at::Tensor separate = bmt::nn::fp8_gelu_mlp(x, w1, b1, w2, b2, {}, Fp8Format::kE5M2);
  const at::Tensor composed = bmt::nn::fp8_linear(at::gelu(bmt::nn::fp8_linear(x, w1, b1), "tanh"), w2, b2);
  EXPECT_TRUE(at::equal(separate, composed));
}

TEST(Fp8GeluMlp, BadShapesNameThemselves) {
  const at::Tensor x = at::randn({32, 32}), w1 = at::randn({64, 32}), b1 = at::randn({64});
  const at::Tensor w2 = at::randn({32, 64}), b2 = at::randn({32});
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { bmt::nn::fp8_gelu_mlp(x, w1, b1, at::randn({32, 48}), b2, {}, Fp8Format::kE5M2); })
                .find("does not take c_fc's 64 features"),
            std::string::npos);
  EXPECT_NE(message([&] { bmt::nn::fp8_gelu_mlp(x, w1, b1, w2, b2, at::randn({32, 16}), Fp8Format::kE5M2); })
                .find("residual [32, 16] does not match the output [32, 32]"),
            std::string::npos);
  EXPECT_NE(message([&] { bmt::nn::fp8_gelu_mlp_fused(at::randn({20, 32}), w1, b1, w2, b2, {}, Fp8Format::kE5M2); })
                .find("multiples of 16 (rows 20"),
            std::string::npos);
}
