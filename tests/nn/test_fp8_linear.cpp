// FP8: the scale/cast kernels' CPU twin (closed forms, rounding, saturation, zero tensors, inf/NaN, odd shapes, the
// transposed copy) and nn::fp8_linear's forward and both gradients against an fp64 reference within the bound FP8
// rounding gives (derived below), per-tensor and rowwise scaling, its fallback and its inf/NaN behaviour. On CPU the GEMMs are torch's CPU
// _scaled_mm and the casts our CPU twin: the code path a GPU runs, with other kernels. The CUDA kernels against
// this twin: tests/cuda/test_fp8_cuda.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>

#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_linear_internal.h"
#include "bmt/nn/fused_reductions.h"
#include "fp8_reference.h"

namespace k = bmt::core::kernels;
using bmt::nn::Fp8Format;
using fp8_test::check_fp8_linear;
using fp8_test::unit_roundoff;

namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

std::array<float, 3> stats_of(const std::vector<float>& x, k::Fp8Format f) {
  std::array<float, 3> s{};
  k::fp8_scale_cpu(x.data(), bmt::core::DType::kFloat32, static_cast<int64_t>(x.size()), f, s.data());
  return s;
}

}  // namespace

TEST(Fp8Cast, EncodesKnownValues) {
  const auto e4 = k::Fp8Format::kE4M3, e5 = k::Fp8Format::kE5M2;
  EXPECT_EQ(k::float_to_fp8(1.0f, e4), 0x38);
  EXPECT_EQ(k::float_to_fp8(-2.0f, e4), 0xc0);
  EXPECT_EQ(k::float_to_fp8(448.0f, e4), 0x7e);
  EXPECT_EQ(k::float_to_fp8(449.0f, e4), 0x7e);  // saturates: 480 would be the NaN code
  EXPECT_EQ(k::float_to_fp8(1e9f, e4), 0x7e);
  EXPECT_EQ(k::float_to_fp8(-kInf, e4), 0xfe);
  EXPECT_EQ(k::float_to_fp8(kNan, e4), 0x7f);
  EXPECT_EQ(k::float_to_fp8(std::ldexp(1.0f, -9), e4), 0x01);       // smallest subnormal
  EXPECT_EQ(k::float_to_fp8(std::ldexp(1.0f, -10), e4), 0x00);      // half of it: ties to even (0)
  EXPECT_EQ(k::float_to_fp8(3 * std::ldexp(1.0f, -10), e4), 0x02);  // 1.5 quanta: ties to even (2)
  EXPECT_EQ(k::float_to_fp8(1.0625f, e4), 0x38);                    // halfway 1 | 1.125: even mantissa 0
  EXPECT_EQ(k::float_to_fp8(1.1875f, e4), 0x3a);                    // halfway 1.125 | 1.25: even mantissa 2
  EXPECT_EQ(k::float_to_fp8(15.5f, e4), 0x58);                      // 15.5 rounds up into the next binade: 16
  EXPECT_EQ(k::float_to_fp8(1.0f, e5), 0x3c);
  EXPECT_EQ(k::float_to_fp8(57344.0f, e5), 0x7b);
  EXPECT_EQ(k::float_to_fp8(kInf, e5), 0x7b);
  EXPECT_EQ(k::float_to_fp8(std::ldexp(1.0f, -16), e5), 0x01);
  EXPECT_EQ(k::float_to_fp8(-0.0f, e5), 0x80);
  EXPECT_EQ(k::fp8_max(e4), 448.0f);
  EXPECT_EQ(k::fp8_max(e5), 57344.0f);
}

TEST(Fp8Cast, EveryCodeRoundTripsAndMatchesTorch) {
  for (auto f : {k::Fp8Format::kE4M3, k::Fp8Format::kE5M2}) {
    const at::ScalarType t = f == k::Fp8Format::kE4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
    for (int b = 0; b < 256; ++b) {
      const float v = k::fp8_to_float(static_cast<uint8_t>(b), f);
      // torch's decoding of the same byte
      const at::Tensor byte = at::full({1}, b, at::kByte);
      const float torch_v = byte.view(t).to(at::kFloat).item<float>();
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(torch_v)) << b;
        continue;
      }
      EXPECT_EQ(v, torch_v) << k::fp8_format_name(f) << " code " << b;
      if (std::isinf(v)) continue;  // E5M2's infinities saturate when encoded
      EXPECT_EQ(k::float_to_fp8(v, f), b) << k::fp8_format_name(f) << " value " << v;
    }
  }
}

TEST(Fp8Cast, RelativeErrorWithinHalfAnUlpInTheNormalRange) {
  const at::Tensor x = at::randn({4096}, at::kFloat) * 20;
  for (auto f : {k::Fp8Format::kE4M3, k::Fp8Format::kE5M2}) {
    const double u = unit_roundoff(f == k::Fp8Format::kE4M3 ? 3 : 2);
    const double min_normal = std::ldexp(1.0, f == k::Fp8Format::kE4M3 ? -6 : -14);
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float v = x[i].item<float>();
      if (std::fabs(v) < min_normal) continue;
      const double q = k::fp8_to_float(k::float_to_fp8(v, f), f);
      EXPECT_LE(std::fabs(q - v), u * std::fabs(v)) << k::fp8_format_name(f) << " " << v;
    }
  }
}

TEST(Fp8Cast, ScaleClosedForms) {
  auto s = stats_of({1.0f, -3.0f, 2.0f}, k::Fp8Format::kE4M3);
  EXPECT_EQ(s[k::kFp8Amax], 3.0f);
  EXPECT_EQ(s[k::kFp8Scale], 448.0f / 3.0f);
  EXPECT_EQ(s[k::kFp8InvScale], 1.0f / (448.0f / 3.0f));
  s = stats_of({0.0f, -0.0f, 0.0f}, k::Fp8Format::kE5M2);  // a zero tensor: scale 1
  EXPECT_EQ(s[k::kFp8Amax], 0.0f);
  EXPECT_EQ(s[k::kFp8Scale], 1.0f);
  EXPECT_EQ(s[k::kFp8InvScale], 1.0f);
  s = stats_of({}, k::Fp8Format::kE4M3);  // empty: as zero
  EXPECT_EQ(s[k::kFp8Scale], 1.0f);
  s = stats_of({1.0f, kInf, 2.0f}, k::Fp8Format::kE4M3);  // inf: NaN scales, so the GEMM's products are NaN
  EXPECT_TRUE(std::isinf(s[k::kFp8Amax]));
  EXPECT_TRUE(std::isnan(s[k::kFp8Scale]) && std::isnan(s[k::kFp8InvScale]));
  s = stats_of({1.0f, kNan, kInf}, k::Fp8Format::kE5M2);
  EXPECT_TRUE(std::isnan(s[k::kFp8Amax]) && std::isnan(s[k::kFp8Scale]) && std::isnan(s[k::kFp8InvScale]));
  s = stats_of({1e-40f}, k::Fp8Format::kE4M3);  // subnormal amax: the scale stays finite
  EXPECT_TRUE(std::isfinite(s[k::kFp8Scale]) && s[k::kFp8Scale] > 0);
}

TEST(Fp8Cast, CastsOddShapesWithTheTransposedCopyInOnePass) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor x = (at::randn({7, 13}, at::kFloat) * 5).to(dt);
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const auto kf = f == Fp8Format::kE4M3 ? k::Fp8Format::kE4M3 : k::Fp8Format::kE5M2;
      const bmt::nn::Fp8Tensor q = bmt::nn::fp8_cast(x, f, true, true);
      ASSERT_EQ(q.data.sizes(), x.sizes());
      ASSERT_EQ(q.data_t.sizes(), (at::IntArrayRef{13, 7}));
      const float amax = x.to(at::kFloat).abs().max().item<float>();
      EXPECT_EQ(q.stats[0].item<float>(), amax);
      const float scale = q.stats[1].item<float>();
      EXPECT_EQ(scale, k::fp8_max(kf) / amax);
      const at::Tensor bytes = q.data.view(at::kByte), bytes_t = q.data_t.view(at::kByte);
      const at::Tensor xf = x.to(at::kFloat);
      for (int64_t r = 0; r < 7; ++r) {
        for (int64_t c = 0; c < 13; ++c) {
          const uint8_t want = k::float_to_fp8(xf[r][c].item<float>() * scale, kf);
          EXPECT_EQ(bytes[r][c].item<uint8_t>(), want);
          EXPECT_EQ(bytes_t[c][r].item<uint8_t>(), want);
        }
      }
      // the largest element lands on fp8_max exactly
      EXPECT_EQ(q.data.to(at::kFloat).abs().max().item<float>(), k::fp8_max(kf));
    }
  }
  const bmt::nn::Fp8Tensor z = bmt::nn::fp8_cast(at::zeros({3, 5}), Fp8Format::kE4M3, true, false);
  EXPECT_FALSE(z.data_t.defined());
  EXPECT_EQ(z.stats[1].item<float>(), 1.0f);
  EXPECT_TRUE((z.data.view(at::kByte) == 0).all().item<bool>());
  EXPECT_THROW(bmt::nn::fp8_cast(at::zeros({3}), Fp8Format::kE4M3, true, false), bmt::core::Error);
}

TEST(Fp8Linear, ForwardAndGradientsWithinTheFp8BoundFp32) {
  at::manual_seed(1);
  check_fp8_linear(at::kCPU, at::kFloat, Fp8Format::kE5M2, 64, 96, 48);
  check_fp8_linear(at::kCPU, at::kFloat, Fp8Format::kE4M3, 32, 128, 80);
}

TEST(Fp8Linear, ForwardAndGradientsWithinTheFp8BoundBf16) {
  at::manual_seed(2);
  check_fp8_linear(at::kCPU, at::kBFloat16, Fp8Format::kE5M2, 96, 64, 32);
  check_fp8_linear(at::kCPU, at::kBFloat16, Fp8Format::kE4M3, 48, 48, 64);
}

TEST(Fp8Linear, ShapesNotMultipleOf16FallBackToTheBf16PathBitForBit) {
  at::manual_seed(3);
  for (auto shape : {std::array<int64_t, 3>{10, 32, 32}, {32, 24, 32}, {32, 32, 40}}) {
    const at::Tensor x0 = at::randn({shape[0], shape[1]}), w0 = at::randn({shape[2], shape[1]}),
                     b0 = at::randn({shape[2]}), g = at::randn({shape[0], shape[2]});
    at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    at::Tensor xr = x0.clone().requires_grad_(), wr = w0.clone().requires_grad_(), br = b0.clone().requires_grad_();
    EXPECT_FALSE(bmt::nn::fp8_linear_applies(x, w));
    bmt::nn::fp8_linear(x, w, b).backward(g);
    bmt::nn::linear(xr, wr, br).backward(g);
    EXPECT_TRUE(at::equal(x.grad(), xr.grad()) && at::equal(w.grad(), wr.grad()) && at::equal(b.grad(), br.grad()));
  }
}

TEST(Fp8Linear, InfOrNanInTheInputMakesTheOutputNan) {
  for (float bad : {kInf, kNan}) {
    at::Tensor x = at::randn({16, 32});
    x[3][5] = bad;
    const at::Tensor y = bmt::nn::fp8_linear(x, at::randn({16, 32}), at::randn({16}));
    EXPECT_TRUE(y.isnan().all().item<bool>()) << bad;
  }
  // and in the gradient: every weight gradient NaN (the step's inf/NaN check skips the step)
  at::Tensor w = at::randn({16, 32}).requires_grad_();
  at::Tensor g = at::randn({16, 16});
  g[0][0] = kInf;
  bmt::nn::fp8_linear(at::randn({16, 32}), w, at::Tensor()).backward(g);
  EXPECT_TRUE(w.grad().isnan().all().item<bool>());
}

TEST(Fp8Linear, NoGradForwardEqualsTheGradForward) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({32, 48}), w = at::randn({16, 48}).requires_grad_(), b = at::randn({16});
  const at::Tensor with_grad = bmt::nn::fp8_linear(x, w, b);
  at::Tensor without;
  {
    at::NoGradGuard no_grad;
    without = bmt::nn::fp8_linear(x, w, b);
  }
  EXPECT_TRUE(at::equal(with_grad.detach(), without));  // a recompute under checkpointing sees the same values
}

TEST(Fp8Linear, BackwardOnlyIsTheLinearForwardWithTheFp8Gradients) {
  // Fp8LinearScales::backward_only (the LM head under --fp8-head-backward): the output is nn::linear's bit for bit,
  // the three gradients are the full FP8 node's bit for bit (the same casts of dy, x and W; W's amax taken afresh
  // equals the forward cast's), per tensor and rowwise.
  for (const auto scaling : {bmt::nn::Fp8Scaling::kTensor, bmt::nn::Fp8Scaling::kRow}) {
    at::manual_seed(5);
    const at::Tensor x0 = at::randn({32, 48}), w0 = at::randn({16, 48}), b0 = at::randn({16}), g = at::randn({32, 16});
    const auto leaf = [](const at::Tensor& t) { return t.clone().requires_grad_(); };
    const at::Tensor xf = leaf(x0), wf = leaf(w0), bf = leaf(b0), xb = leaf(x0), wb = leaf(w0), bb = leaf(b0);
    bmt::nn::Fp8LinearScales backward_only;
    backward_only.backward_only = true;
    const at::Tensor yf = bmt::nn::fp8_linear(xf, wf, bf, Fp8Format::kE5M2, scaling);
    const at::Tensor yb = bmt::nn::fp8_linear(xb, wb, bb, Fp8Format::kE5M2, scaling, true, &backward_only);
    EXPECT_TRUE(at::equal(yb.detach(), bmt::nn::linear(x0, w0, b0))) << "the forward must be the unquantised GEMM";
    EXPECT_FALSE(at::equal(yb.detach(), yf.detach())) << "the full FP8 forward rounds; this one must not";
    yf.backward(g);
    yb.backward(g);
    EXPECT_TRUE(at::equal(xb.grad(), xf.grad()));
    EXPECT_TRUE(at::equal(wb.grad(), wf.grad()));
    EXPECT_TRUE(at::equal(bb.grad(), bf.grad()));
    EXPECT_FALSE(at::equal(wb.grad(), at::mm(g.t(), x0))) << "wgrad must be the FP8 GEMM, not the fp32 one";
  }
}

// ----------------------------------------------------------------------------------------------- rowwise scaling

namespace {

// The reference of one row's cast: the per-tensor twin applied to that row alone.
void expect_row_cast(const at::Tensor& row_f32, k::Fp8Format f, const at::Tensor& bytes, float inv,
                     const std::string& what) {
  const std::vector<float> v(row_f32.data_ptr<float>(), row_f32.data_ptr<float>() + row_f32.numel());
  const auto s = stats_of(v, f);
  EXPECT_TRUE(inv == s[k::kFp8InvScale] || (std::isnan(inv) && std::isnan(s[k::kFp8InvScale]))) << what << " inv";
  std::vector<uint8_t> want(v.size());
  k::fp8_cast_cpu(v.data(), bmt::core::DType::kFloat32, 1, static_cast<int64_t>(v.size()), s.data(), f, want.data(),
                  nullptr);
  if (std::isnan(s[k::kFp8Scale])) return;  // NaN scales: NaN bytes (checked by the linear's tests)
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(bytes[static_cast<int64_t>(i)].item<uint8_t>(), want[i]) << what;
}

}  // namespace

TEST(Fp8CastRowwise, EachRowAndEachColumnByItsOwnAmax) {
  at::manual_seed(5);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    // rows and columns of very different magnitudes, a zero row and a zero column, a NaN in row 5 / column 7
    at::Tensor x = at::randn({12, 20}) * at::pow(2.0, -at::arange(12).to(at::kFloat)).unsqueeze(1) *
                   at::pow(2.0, -at::arange(20).to(at::kFloat) / 2).unsqueeze(0);
    x[2].zero_();
    x.select(1, 4).zero_();
    x[5][7] = kNan;
    x = x.to(dt);
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const auto kf = f == Fp8Format::kE4M3 ? k::Fp8Format::kE4M3 : k::Fp8Format::kE5M2;
      const bmt::nn::Fp8Tensor q = bmt::nn::fp8_cast_rowwise(x, f, true, true);
      ASSERT_EQ(q.data.sizes(), x.sizes());
      ASSERT_EQ(q.data_t.sizes(), (at::IntArrayRef{20, 12}));
      ASSERT_EQ(q.inv.sizes(), (at::IntArrayRef{12}));
      ASSERT_EQ(q.inv_t.sizes(), (at::IntArrayRef{20}));
      const at::Tensor xf = x.to(at::kFloat).contiguous(), xt = xf.t().contiguous();
      for (int64_t r = 0; r < 12; ++r)
        expect_row_cast(xf[r].contiguous(), kf, q.data.view(at::kByte)[r], q.inv[r].item<float>(),
                        "row " + std::to_string(r));
      for (int64_t c = 0; c < 20; ++c)
        expect_row_cast(xt[c].contiguous(), kf, q.data_t.view(at::kByte)[c], q.inv_t[c].item<float>(),
                        "column " + std::to_string(c));
      EXPECT_EQ(q.inv[2].item<float>(), 1.0f);    // a zero row: scale 1
      EXPECT_EQ(q.inv_t[4].item<float>(), 1.0f);  // a zero column
      EXPECT_TRUE(std::isnan(q.inv[5].item<float>()) && std::isnan(q.inv_t[7].item<float>()));
      EXPECT_TRUE(std::isfinite(q.inv[6].item<float>()) && std::isfinite(q.inv_t[6].item<float>()));
    }
  }
  const bmt::nn::Fp8Tensor only_t = bmt::nn::fp8_cast_rowwise(at::ones({3, 5}), Fp8Format::kE4M3, false, true);
  EXPECT_FALSE(only_t.data.defined());
  EXPECT_FALSE(only_t.inv.defined());
  EXPECT_TRUE(at::equal(only_t.inv_scale_t(), at::full({5}, 1.0f / 448.0f)));
  EXPECT_THROW(bmt::nn::fp8_cast_rowwise(at::zeros({3}), Fp8Format::kE4M3, true, false), bmt::core::Error);
}

TEST(Fp8Linear, RowwiseForwardAndGradientsWithinTheFp8Bound) {
  at::manual_seed(6);
  check_fp8_linear(at::kCPU, at::kFloat, Fp8Format::kE5M2, 64, 96, 48, bmt::nn::Fp8Scaling::kRow);
  check_fp8_linear(at::kCPU, at::kBFloat16, Fp8Format::kE4M3, 48, 48, 64, bmt::nn::Fp8Scaling::kRow);
}

// Why rowwise: with tokens of very different magnitudes, per-tensor scales flush the small ones to zero in E4M3
// (below amax 2^-9 / 448), rowwise scales keep each token's own precision.
TEST(Fp8Linear, RowwiseKeepsSmallTokensThatPerTensorScalesLose) {
  at::manual_seed(7);
  const at::Tensor x = at::randn({32, 64}) * at::pow(2.0, -at::arange(32).to(at::kFloat)).unsqueeze(1);
  const at::Tensor w = at::randn({48, 64}) * 0.05;
  const at::Tensor exact = x.to(at::kDouble).mm(w.to(at::kDouble).t());
  auto row_error = [&](bmt::nn::Fp8Scaling s) {  // relative error of the smallest token's output row
    const at::Tensor y = bmt::nn::fp8_linear(x, w, at::Tensor(), Fp8Format::kE4M3, s).to(at::kDouble);
    return ((y[31] - exact[31]).norm() / exact[31].norm()).item<double>();
  };
  const double per_tensor = row_error(bmt::nn::Fp8Scaling::kTensor), rowwise = row_error(bmt::nn::Fp8Scaling::kRow);
  EXPECT_GT(per_tensor, 0.5) << "per-tensor scales were expected to flush a token 2^-31 below the largest";
  EXPECT_LT(rowwise, 0.1);
}

TEST(Fp8Linear, RowwiseNonFiniteValueMakesItsOwnRowsNan) {
  at::Tensor x = at::randn({16, 32});
  x[3][5] = kInf;
  const at::Tensor y = bmt::nn::fp8_linear(x, at::randn({16, 32}), at::randn({16}), Fp8Format::kE4M3,
                                           bmt::nn::Fp8Scaling::kRow);
  EXPECT_TRUE(y[3].isnan().all().item<bool>());
  EXPECT_TRUE(y[4].isfinite().all().item<bool>());  // the other tokens keep their values (the loss is NaN anyway)
  // a non-finite gradient reaches the weight gradient: the step's inf/NaN check skips the step
  at::Tensor w = at::randn({16, 32}).requires_grad_();
  at::Tensor g = at::randn({16, 16});
  g[0][0] = kInf;
  bmt::nn::fp8_linear(at::randn({16, 32}), w, at::Tensor(), Fp8Format::kE4M3, bmt::nn::Fp8Scaling::kRow).backward(g);
  EXPECT_TRUE(w.grad()[0].isnan().all().item<bool>());
}

TEST(Fp8Linear, ScalingSwitchParsesAndSets) {
  const bmt::nn::Fp8Scaling before = bmt::nn::fp8_scaling();
  bmt::nn::set_fp8_scaling(bmt::nn::Fp8Scaling::kRow);
  EXPECT_EQ(bmt::nn::fp8_scaling(), bmt::nn::Fp8Scaling::kRow);
  bmt::nn::set_fp8_scaling(before);
  EXPECT_EQ(bmt::nn::fp8_scaling(), before);
}

TEST(Fp8Linear, ResidualVariantIsTheResidualPlusTheLinear) {
  at::manual_seed(8);
  const at::Tensor x0 = at::randn({2, 16, 64}), w0 = at::randn({32, 64}) * 0.1, b0 = at::randn({32});
  const at::Tensor r0 = at::randn({2, 16, 32}), g = at::randn({2, 16, 32});
  auto run = [&](bool fused) {
    at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    at::Tensor r = r0.clone().requires_grad_();
    const at::Tensor y = fused ? bmt::nn::fp8_linear_residual(x, w, b, r) : r + bmt::nn::fp8_linear(x, w, b);
    y.backward(g);
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), b.grad(), r.grad()};
  };
  const auto fused = run(true), separate = run(false);
  // (on CPUs the residual is added after the GEMM: the same ops in the same order)
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_TRUE(at::equal(fused[i], separate[i])) << "output/gradient " << i;
  EXPECT_TRUE(at::equal(fused[4], g)) << "the residual's gradient is dy";
  try {
    bmt::nn::fp8_linear_residual(x0, w0, b0, at::randn({2, 16, 16}));
    ADD_FAILURE() << "a residual of the wrong shape was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("residual [2, 16, 16] does not match the output [2, 16, 32]"),
              std::string::npos)
        << e.what();
  }
}

// A cast with an earlier cast's statistics (the backward's transposed weight): the same bytes as a fresh cast of
// the same values, sharing the earlier statistics instead of taking new ones; of other values, those statistics
// applied as they are; per-tensor statistics only.
TEST(Fp8Cast, KnownScaleCastIsTheCastWithoutItsScalePass) {
  at::manual_seed(32);
  const at::Tensor x = (at::randn({7, 13}) * 3).to(at::kBFloat16);
  const bmt::nn::Fp8Tensor fwd = bmt::nn::fp8_cast(x, Fp8Format::kE4M3, true, false);
  const bmt::nn::Fp8Tensor got = bmt::nn::fp8_cast_known_scale(x, Fp8Format::kE4M3, false, true, fwd);
  const bmt::nn::Fp8Tensor want = bmt::nn::fp8_cast(x, Fp8Format::kE4M3, false, true);
  EXPECT_FALSE(got.data.defined());
  EXPECT_TRUE(at::equal(got.data_t.view(at::kByte), want.data_t.view(at::kByte)));
  EXPECT_TRUE(at::equal(got.stats, want.stats) && at::equal(got.inv, want.inv));
  EXPECT_EQ(got.stats.data_ptr(), fwd.stats.data_ptr());  // shared, not recomputed
  const at::Tensor half = x * 0.5;  // (exact in bf16)
  const bmt::nn::Fp8Tensor h = bmt::nn::fp8_cast_known_scale(half, Fp8Format::kE4M3, true, false, fwd);
  const float scale = fwd.stats[1].item<float>();
  const at::Tensor hf = half.to(at::kFloat), bytes = h.data.view(at::kByte);
  for (int64_t r = 0; r < 7; ++r)
    for (int64_t c = 0; c < 13; ++c)
      EXPECT_EQ(bytes[r][c].item<uint8_t>(), k::float_to_fp8(hf[r][c].item<float>() * scale, k::Fp8Format::kE4M3));
  const bmt::nn::Fp8Tensor rows = bmt::nn::fp8_cast_rowwise(x, Fp8Format::kE4M3, true, false);
  EXPECT_THROW(bmt::nn::fp8_cast_known_scale(x, Fp8Format::kE4M3, true, false, rows), bmt::core::Error);
  EXPECT_THROW(bmt::nn::fp8_cast_known_scale(x, Fp8Format::kE4M3, true, false, bmt::nn::Fp8Tensor()),
               bmt::core::Error);
}

// nn::fp8_cast_grad: the bias gradient (when asked for) is nn::column_sum's and the copies are fp8_cast_as's, for
// both scalings and with or without the bias (the CUDA variant, whose amax comes from the sum, is checked against
// the separate ops in tests/cuda/test_fp8_cuda.cpp).
TEST(Fp8Linear, GradientCastWithTheBiasGradientEqualsTheSeparateOps) {
  at::manual_seed(31);
  const at::Tensor dy = (at::randn({48, 32}) * 4).to(at::kBFloat16);
  for (bmt::nn::Fp8Scaling scaling : {bmt::nn::Fp8Scaling::kTensor, bmt::nn::Fp8Scaling::kRow}) {
    at::Tensor db;
    const bmt::nn::Fp8Tensor got =
        bmt::nn::fp8_cast_grad(scaling, dy, bmt::nn::Fp8Format::kE5M2, true, true, &db, at::kFloat);
    const bmt::nn::Fp8Tensor want = bmt::nn::fp8_cast_as(scaling, dy, bmt::nn::Fp8Format::kE5M2, true, true);
    ASSERT_TRUE(db.defined());
    EXPECT_TRUE(at::equal(db, bmt::nn::column_sum(dy, at::kFloat)));
    EXPECT_EQ(db.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(got.data.view(at::kByte), want.data.view(at::kByte)));
    EXPECT_TRUE(at::equal(got.data_t.view(at::kByte), want.data_t.view(at::kByte)));
    EXPECT_TRUE(at::equal(got.inv_scale(), want.inv_scale()) && at::equal(got.inv_scale_t(), want.inv_scale_t()));
    // without a bias nothing is summed
    const bmt::nn::Fp8Tensor plain =
        bmt::nn::fp8_cast_grad(scaling, dy, bmt::nn::Fp8Format::kE5M2, false, true, nullptr, at::kFloat);
    EXPECT_FALSE(plain.data.defined());
    EXPECT_TRUE(at::equal(plain.data_t.view(at::kByte), want.data_t.view(at::kByte)));
    // neither copy asked for: only the sums, no cast
    at::Tensor db_only;
    const bmt::nn::Fp8Tensor none =
        bmt::nn::fp8_cast_grad(scaling, dy, bmt::nn::Fp8Format::kE5M2, false, false, &db_only, at::kFloat);
    EXPECT_TRUE(at::equal(db_only, db));
    EXPECT_FALSE(none.data.defined() || none.data_t.defined() || none.inv.defined());
  }
}
