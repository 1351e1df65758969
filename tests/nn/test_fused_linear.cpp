// The fused-epilogue GEMMs' CPU twin against torch's ops in double, and nn::gelu_mlp / nn::linear_residual's
// autograd functions (run here on the twin) against the same model written with torch's own ops and autograd in
// double: outputs and every gradient, with and without a residual, with some inputs not needing gradients.
// The CUDA variant against the twin: tests/cuda/test_gemm_epilogue_cuda.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "bmt/core/error.h"
#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/gemm_epilogue_args_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace k = bmt::core::kernels;
constexpr auto gemm_args = &bmt::nn::gemm_epilogue_args;  // (the short name the cases use)

namespace {

at::Tensor leaf(const at::Tensor& t, bool grad = true) { return t.detach().clone().requires_grad_(grad); }

// Within `rel` of the reference's magnitude (elementwise, plus a floor of rel * its mean magnitude).
void expect_near(const at::Tensor& got, const at::Tensor& want, double rel, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const at::Tensor err = (g - w).abs();
  const double floor = rel * w.abs().mean().item<double>() + 1e-12;
  EXPECT_TRUE((err <= w.abs() * rel + floor).all().item<bool>())
      << what << ": max error " << err.max().item<double>() << " (reference max " << w.abs().max().item<double>() << ")";
}


}  // namespace

TEST(GemmEpilogueCpu, GeluMatchesTorchsTanhApproximation) {
  const at::Tensor x = at::linspace(-8, 8, 1601, at::kDouble);
  const at::Tensor y = at::gelu(x, "tanh");
  const at::Tensor dy = at::gelu_backward(at::ones_like(x), x, "tanh");
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float xi = static_cast<float>(x[i].item<double>());
    EXPECT_NEAR(k::gelu_tanh(xi), y[i].item<double>(), 1e-6) << "x=" << xi;
    EXPECT_NEAR(k::gelu_tanh_grad(xi), dy[i].item<double>(), 1e-6) << "x=" << xi;
  }
}

TEST(GemmEpilogueCpu, EveryEpilogueMatchesTorchOpsInDouble) {
  at::manual_seed(3);
  const int64_t rows = 37, inner = 24, cols = 16;
  for (at::ScalarType st : {at::kFloat, at::kBFloat16}) {
    const double rel = st == at::kFloat ? 1e-6 : 1.0 / 128;
    const at::Tensor a = at::randn({rows, inner}).to(st), w = (at::randn({cols, inner}) * 0.3).to(st);
    const at::Tensor bias = at::randn({cols}).to(st), res = at::randn({rows, cols}).to(st);
    const at::Tensor ad = a.to(at::kDouble), wd = w.to(at::kDouble);
    const std::string dt = c10::toString(st);
    // bias + residual, b transposed (a Linear's weight) and not (an input gradient)
    at::Tensor out = at::empty({rows, cols}, a.options());
    k::gemm_epilogue_cpu(gemm_args(k::GemmEpilogue::kBias, a, w, true, out, bias, {}, res));
    expect_near(out, ad.mm(wd.t()) + bias.to(at::kDouble) + res.to(at::kDouble), rel, dt + " bias+residual");
    const at::Tensor wn = w.t().contiguous();
    k::gemm_epilogue_cpu(gemm_args(k::GemmEpilogue::kBias, a, wn, false, out, {}, {}, {}));
    expect_near(out, ad.mm(wd.t()), rel, dt + " no bias, b not transposed");
    // GELU, keeping the pre-activation
    at::Tensor aux = at::empty({rows, cols}, a.options());
    k::gemm_epilogue_cpu(gemm_args(k::GemmEpilogue::kGeluAuxBias, a, w, true, out, bias, aux, {}));
    const at::Tensor pre = ad.mm(wd.t()) + bias.to(at::kDouble);
    expect_near(aux, pre, rel, dt + " gelu aux");
    expect_near(out, at::gelu(pre, "tanh"), rel, dt + " gelu out");
    // GELU's gradient and the bias gradient, from that aux
    const at::Tensor dy = at::randn({rows, inner}).to(st), w2 = (at::randn({inner, cols}) * 0.3).to(st);
    at::Tensor db = at::empty({cols}, a.options());
    k::gemm_epilogue_cpu(gemm_args(k::GemmEpilogue::kDGeluBGrad, dy, w2, false, out, db, aux, {}));
    const at::Tensor dpre = at::gelu_backward(dy.to(at::kDouble).mm(w2.to(at::kDouble)), aux.to(at::kDouble), "tanh");
    expect_near(out, dpre, rel, dt + " dgelu");
    expect_near(db, dpre.sum(0), rel, dt + " bias gradient");
  }
}

TEST(GemmEpilogueCpu, ArgumentErrorsNameTheMissingOperand) {
  const at::Tensor a = at::randn({4, 8}), w = at::randn({8, 8}), out = at::empty({4, 8});
  try {
    k::gemm_epilogue_cpu(gemm_args(k::GemmEpilogue::kGeluAuxBias, a, w, true, out, {}, {}, {}));
    FAIL() << "no error";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("gelu_aux_bias needs a bias and an aux"), std::string::npos) << e.what();
  }
  try {
    k::gemm_epilogue_cpu(gemm_args(k::GemmEpilogue::kDGeluBGrad, a, w, false, out, at::empty({8}), {}, at::empty({4, 8})));
    FAIL() << "no error";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pre-activation"), std::string::npos) << e.what();
  }
}

namespace {

struct Mlp {
  at::Tensor x, w_fc, b_fc, w_proj, b_proj, residual;
};

Mlp make_mlp(at::ScalarType st, int64_t batch, int64_t seq, int64_t dim, int64_t hidden) {
  Mlp m;
  m.x = at::randn({batch, seq, dim}).to(st);
  m.w_fc = (at::randn({hidden, dim}) * 0.2).to(st);
  m.b_fc = (at::randn({hidden}) * 0.5).to(st);
  m.w_proj = (at::randn({dim, hidden}) * 0.2).to(st);
  m.b_proj = (at::randn({dim}) * 0.5).to(st);
  m.residual = at::randn({batch, seq, dim}).to(st);
  return m;
}

}  // namespace

TEST(FusedLinearCpu, GeluMlpMatchesTorchAutogradInDouble) {
  at::manual_seed(4);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16}) {
    for (bool with_residual : {false, true}) {
      const std::string what = std::string(c10::toString(st)) + (with_residual ? " residual" : " no residual");
      const double rel = st == at::kFloat ? 1e-5 : 1.0 / 32;  // bf16: a few roundings of each intermediate
      const Mlp m = make_mlp(st, 2, 5, 16, 40);
      const at::Tensor gy = at::randn({2, 5, 16}).to(st);
      at::Tensor x = leaf(m.x), w1 = leaf(m.w_fc), b1 = leaf(m.b_fc), w2 = leaf(m.w_proj), b2 = leaf(m.b_proj);
      at::Tensor r = leaf(m.residual);
      at::Tensor y = bmt::nn::gelu_mlp_fused(x, w1, b1, w2, b2, with_residual ? r : at::Tensor());
      y.backward(gy);
      // The reference: torch's ops in double.
      at::Tensor xd = leaf(m.x.to(at::kDouble)), w1d = leaf(m.w_fc.to(at::kDouble)), b1d = leaf(m.b_fc.to(at::kDouble));
      at::Tensor w2d = leaf(m.w_proj.to(at::kDouble)), b2d = leaf(m.b_proj.to(at::kDouble));
      at::Tensor rd = leaf(m.residual.to(at::kDouble));
      at::Tensor yd = at::linear(at::gelu(at::linear(xd, w1d, b1d), "tanh"), w2d, b2d);
      if (with_residual) yd = yd + rd;
      yd.backward(gy.to(at::kDouble));
      expect_near(y, yd, rel, what + " y");
      expect_near(x.grad(), xd.grad(), rel, what + " dx");
      expect_near(w1.grad(), w1d.grad(), rel, what + " dw_fc");
      expect_near(b1.grad(), b1d.grad(), rel, what + " db_fc");
      expect_near(w2.grad(), w2d.grad(), rel, what + " dw_proj");
      expect_near(b2.grad(), b2d.grad(), rel, what + " db_proj");
      if (with_residual) {
        EXPECT_TRUE(at::equal(r.grad(), gy)) << what << ": the residual's gradient is dy";
      } else {
        EXPECT_FALSE(r.grad().defined());
      }
    }
  }
}

// A checkpointed Block's recompute whose MLP output only roots the backward: compute_output = false leaves y NaN
// (c_proj's GEMM skipped) with the same gradients as the computing path.
TEST(FusedLinearCpu, GeluMlpWithoutItsOutputHasTheSameGradients) {
  at::manual_seed(9);
  const Mlp m = make_mlp(at::kFloat, 2, 5, 16, 40);
  const at::Tensor gy = at::randn({2, 5, 16});
  std::vector<at::Tensor> grads[2];
  for (bool compute : {true, false}) {
    at::Tensor x = leaf(m.x), w1 = leaf(m.w_fc), b1 = leaf(m.b_fc), w2 = leaf(m.w_proj), b2 = leaf(m.b_proj);
    at::Tensor r = leaf(m.residual);
    at::Tensor y = bmt::nn::gelu_mlp_fused(x, w1, b1, w2, b2, r, compute);
    EXPECT_EQ(compute, !at::isnan(y).any().item<bool>()) << "compute_output=" << compute;
    y.backward(gy);
    grads[compute ? 0 : 1] = {x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad(), r.grad()};
  }
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << "gradient " << i;
}

TEST(FusedLinearCpu, GeluMlpComputesOnlyTheGradientsAskedFor) {
  at::manual_seed(5);
  const Mlp m = make_mlp(at::kFloat, 1, 6, 8, 16);
  // Frozen c_fc (fine-tuning only c_proj) and an input that needs no gradient.
  at::Tensor x = leaf(m.x, false), w1 = leaf(m.w_fc, false), b1 = leaf(m.b_fc, false);
  at::Tensor w2 = leaf(m.w_proj), b2 = leaf(m.b_proj);
  bmt::nn::gelu_mlp_fused(x, w1, b1, w2, b2, at::Tensor()).sum().backward();
  EXPECT_FALSE(w1.grad().defined());
  EXPECT_FALSE(x.grad().defined());
  at::Tensor w2r = leaf(m.w_proj), b2r = leaf(m.b_proj);
  at::linear(at::gelu(at::linear(m.x, m.w_fc, m.b_fc), "tanh"), w2r, b2r).sum().backward();
  expect_near(w2.grad(), w2r.grad(), 1e-5, "dw_proj");
  expect_near(b2.grad(), b2r.grad(), 1e-5, "db_proj");
  // Only the input's gradient (what a frozen model under an adapter asks for).
  at::Tensor x2 = leaf(m.x), w1c = leaf(m.w_fc, false), b1c = leaf(m.b_fc, false), w2c = leaf(m.w_proj, false);
  at::Tensor b2c = leaf(m.b_proj, false), xr = leaf(m.x);
  bmt::nn::gelu_mlp_fused(x2, w1c, b1c, w2c, b2c, at::Tensor()).sum().backward();
  at::linear(at::gelu(at::linear(xr, m.w_fc, m.b_fc), "tanh"), m.w_proj, m.b_proj).sum().backward();
  expect_near(x2.grad(), xr.grad(), 1e-5, "dx alone");
}

TEST(FusedLinearCpu, LinearResidualMatchesTorchAutograd) {
  at::manual_seed(6);
  const at::Tensor x0 = at::randn({3, 4, 12}), w0 = at::randn({20, 12}) * 0.3, b0 = at::randn({20});
  const at::Tensor r0 = at::randn({3, 4, 20}), gy = at::randn({3, 4, 20});
  at::Tensor x = leaf(x0), w = leaf(w0), b = leaf(b0), r = leaf(r0);
  at::Tensor y = bmt::nn::linear_residual_fused(x, w, b, r);
  y.backward(gy);
  at::Tensor xd = leaf(x0.to(at::kDouble)), wd = leaf(w0.to(at::kDouble)), bd = leaf(b0.to(at::kDouble));
  at::Tensor rd = leaf(r0.to(at::kDouble));
  (rd + at::linear(xd, wd, bd)).backward(gy.to(at::kDouble));
  expect_near(y, rd + at::linear(xd, wd, bd), 1e-5, "y");
  expect_near(x.grad(), xd.grad(), 1e-5, "dx");
  expect_near(w.grad(), wd.grad(), 1e-5, "dw");
  expect_near(b.grad(), bd.grad(), 1e-5, "db");
  EXPECT_TRUE(at::equal(r.grad(), gy));
}

// A user's F.gelu then F.linear: the fused node takes the gradient to the pre-activation (DGELU epilogue on the
// CPU twin), against torch's autograd through at::gelu in double; h itself gets no gradient from this path.
TEST(FusedLinearCpu, LinearAfterGeluMatchesTorchAutogradInDouble) {
  at::manual_seed(8);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16}) {
    const std::string what = c10::toString(st);
    const double rel = st == at::kFloat ? 1e-5 : 1.0 / 32;
    const Mlp m = make_mlp(st, 2, 5, 16, 40);
    const at::Tensor pre0 = at::linear(m.x, m.w_fc, m.b_fc), gy = at::randn({2, 5, 16}).to(st);
    at::Tensor pre = leaf(pre0), w = leaf(m.w_proj), b = leaf(m.b_proj);
    const at::Tensor h = at::gelu(pre, "tanh");
    const at::Tensor y = bmt::nn::linear_after_gelu_fused(h, pre, w, b);
    y.backward(gy);
    at::Tensor pred = leaf(pre0.to(at::kDouble)), wd = leaf(m.w_proj.to(at::kDouble)), bd = leaf(m.b_proj.to(at::kDouble));
    const at::Tensor yd = at::linear(at::gelu(pred, "tanh"), wd, bd);
    yd.backward(gy.to(at::kDouble));
    EXPECT_TRUE(at::equal(y, at::linear(h, m.w_proj, m.b_proj))) << what << ": the forward is the plain linear on h";
    expect_near(pre.grad(), pred.grad(), rel, what + " d pre");
    expect_near(w.grad(), wd.grad(), rel, what + " dw");
    expect_near(b.grad(), bd.grad(), rel, what + " db");
  }
  // Frozen weights: only the pre-activation's gradient; and a mismatched pre-activation is refused by name.
  const Mlp m = make_mlp(at::kFloat, 1, 3, 8, 12);
  at::Tensor pre = leaf(at::linear(m.x, m.w_fc, m.b_fc)), pre_ref = leaf(pre);
  bmt::nn::linear_after_gelu_fused(at::gelu(pre, "tanh"), pre, m.w_proj, m.b_proj).sum().backward();
  at::linear(at::gelu(pre_ref, "tanh"), m.w_proj, m.b_proj).sum().backward();
  expect_near(pre.grad(), pre_ref.grad(), 1e-5, "d pre with frozen weights");
  try {
    bmt::nn::linear_after_gelu_fused(at::gelu(pre, "tanh"), pre.narrow(-1, 0, 6), m.w_proj, m.b_proj);
    ADD_FAILURE() << "a pre-activation of another shape was accepted";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not match GELU's output"), std::string::npos) << e.what();
  }
}

TEST(FusedLinearCpu, DispatchersOnCpuAreTheSeparateOps) {
  at::manual_seed(7);
  const Mlp m = make_mlp(at::kBFloat16, 2, 3, 8, 16);
  at::Tensor w1 = leaf(m.w_fc), w2 = leaf(m.w_proj);
  const at::Tensor y = bmt::nn::gelu_mlp(m.x, w1, m.b_fc, w2, m.b_proj, m.residual);
  const at::Tensor want = m.residual + at::linear(at::gelu(at::linear(m.x, m.w_fc, m.b_fc), "tanh"), m.w_proj, m.b_proj);
  EXPECT_TRUE(at::equal(y, want));
  const at::Tensor y2 = bmt::nn::linear_residual(m.x, w1, m.b_fc, at::zeros({2, 3, 16}, m.x.options()));
  EXPECT_TRUE(at::equal(y2, at::zeros({2, 3, 16}, m.x.options()) + at::linear(m.x, m.w_fc, m.b_fc)));
}

TEST(FusedLinearCpu, ShapeErrorsNameTheLayer) {
  const Mlp m = make_mlp(at::kFloat, 1, 2, 8, 16);
  try {
    bmt::nn::gelu_mlp_fused(m.x, m.w_fc, m.b_fc, m.w_proj.t(), m.b_proj, at::Tensor());
    FAIL() << "no error";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("c_proj weight"), std::string::npos) << e.what();
  }
  try {
    bmt::nn::linear_residual_fused(m.x, m.w_fc, m.b_fc, at::zeros({1, 2, 8}));
    FAIL() << "no error";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("residual"), std::string::npos) << e.what();
  }
}

TEST(FusedLinearCpu, OutputsTakeInPlaceOpsAndStridedBiasesAreRead) {
  at::manual_seed(8);
  const Mlp m = make_mlp(at::kFloat, 2, 3, 8, 16);
  // Biases that are strided views (every other element of a longer vector).
  const at::Tensor b1_long = at::randn({32}), b2_long = at::randn({16});
  at::Tensor b1 = leaf(b1_long).slice(0, 0, 32, 2), b2 = leaf(b2_long).slice(0, 0, 16, 2);
  ASSERT_FALSE(b1.is_contiguous());
  at::Tensor w1 = leaf(m.w_fc), w2 = leaf(m.w_proj);
  at::Tensor y = bmt::nn::gelu_mlp_fused(m.x, w1, b1, w2, b2, at::Tensor());
  const at::Tensor want = at::linear(at::gelu(at::linear(m.x, m.w_fc, b1.detach()), "tanh"), m.w_proj, b2.detach());
  expect_near(y, want, 1e-5, "strided biases");
  y.mul_(2).sum().backward();  // an in-place op on the output (a view there would refuse it)
  ASSERT_TRUE(w2.grad().defined());
  at::Tensor r = leaf(m.residual);
  at::Tensor y2 = bmt::nn::linear_residual_fused(m.x, leaf(at::randn({8, 8})), b2, r);
  y2.add_(1).sum().backward();
  EXPECT_TRUE(at::equal(r.grad(), at::ones_like(m.residual)));
}

TEST(FusedLinearCpu, MixedDtypesAreAnErrorNotAReinterpretation) {
  const Mlp m = make_mlp(at::kBFloat16, 1, 2, 8, 16);
  try {
    bmt::nn::gelu_mlp_fused(m.x, m.w_fc.to(at::kFloat), m.b_fc, m.w_proj, m.b_proj, at::Tensor());
    FAIL() << "no error";
  } catch (const bmt::core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("input's dtype and device"), std::string::npos) << e.what();
  }
}
