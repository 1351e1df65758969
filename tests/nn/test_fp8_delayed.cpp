// Delayed FP8 scaling of the MLP's GELU output (nn::Fp8DelayedScale, core/kernels/fp8_delayed_scale) and the pieces
// it runs on: the epilogue GEMM writing FP8 itself (its CPU twin against the twin's own fp32 output scaled and
// encoded by float_to_fp8, saturation included), the FP8 byte transpose, the record's closed forms (history window,
// scale of its maximum, non-finite amaxes kept out and marked by a NaN inverse scale), and nn::fp8_gelu_mlp_fused
// with a delayed scale against the dynamic cast it replaces: bit for bit in fp32 when the delayed scale is the
// dynamic one (the same inputs twice), within FP8 rounding when it is not, NaN for a non-finite activation. The same
// for a GEMM input (nn::fp8_cast_delayed: the cast kernel takes the scale and folds the amax) in nn::fp8_linear,
// fp8_linear_residual and the FP8 MLP, under BMT_FP8_DELAYED_INPUTS.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>

#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/nn/fp8_delayed_scale_internal.h"
#include "bmt/nn/fp8_linear_internal.h"
#include "bmt/nn/fp8_mlp.h"
#include "fp8_reference.h"

namespace k = bmt::core::kernels;
using bmt::nn::Fp8DelayedScale;
using bmt::nn::Fp8Format;

namespace {

const float kE4M3Max = 448.0f;

at::Tensor bytes(const at::Tensor& q) { return q.contiguous().view(at::kByte); }

struct MlpRun {
  at::Tensor y, dx, dw1, db1, dw2, db2;
};

MlpRun run_mlp(const at::Tensor& x0, const at::Tensor& w10, const at::Tensor& b10, const at::Tensor& w20,
               const at::Tensor& b20, const at::Tensor& g, Fp8DelayedScale* scale) {
  at::Tensor x = x0.clone().requires_grad_(), w1 = w10.clone().requires_grad_(), b1 = b10.clone().requires_grad_();
  at::Tensor w2 = w20.clone().requires_grad_(), b2 = b20.clone().requires_grad_();
  const at::Tensor y =
      bmt::nn::fp8_gelu_mlp_fused(x, w1, b1, w2, b2, at::Tensor(), Fp8Format::kE5M2, true, scale);
  y.backward(g);
  return {y.detach(), x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
}

void expect_same(const MlpRun& a, const MlpRun& b, const char* what) {
  EXPECT_TRUE(at::equal(a.y, b.y)) << what << ": y";
  EXPECT_TRUE(at::equal(a.dx, b.dx)) << what << ": dx";
  EXPECT_TRUE(at::equal(a.dw1, b.dw1)) << what << ": dw_fc";
  EXPECT_TRUE(at::equal(a.db1, b.db1)) << what << ": db_fc";
  EXPECT_TRUE(at::equal(a.dw2, b.dw2)) << what << ": dw_proj";
  EXPECT_TRUE(at::equal(a.db2, b.db2)) << what << ": db_proj";
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-30);
}

}  // namespace

TEST(Fp8GemmEpilogueTwin, Fp8OutputIsTheScaledEncodingOfTheOutputAndItsAmax) {
  at::manual_seed(43);
  const int64_t rows = 16, inner = 32, cols = 48;
  const bmt::nn::Fp8Tensor aq = bmt::nn::fp8_cast(at::randn({rows, inner}), Fp8Format::kE4M3, true, false);
  const bmt::nn::Fp8Tensor wq = bmt::nn::fp8_cast(at::randn({cols, inner}) * 0.2, Fp8Format::kE4M3, true, false);
  const at::Tensor bias = at::randn({cols});
  for (const k::GemmEpilogue e : {k::GemmEpilogue::kGeluAuxBias, k::GemmEpilogue::kBias}) {
    const bool gelu = e == k::GemmEpilogue::kGeluAuxBias;
    at::Tensor out = at::empty({rows, cols}), aux = gelu ? at::empty({rows, cols}) : at::Tensor();
    ASSERT_TRUE(bmt::nn::fp8_gemm_epilogue(e, aq.data, Fp8Format::kE4M3, aq.inv, wq.data, Fp8Format::kE4M3, wq.inv,
                                           false, out, bias, aux, at::Tensor()));
    const float amax = out.abs().max().item<float>();
    // a scale that saturates the largest values (> 448 after scaling) and one that does not
    for (const float scale_factor : {0.5f, 3.0f}) {
      Fp8DelayedScale state(4);
      state.record_amax(at::full({}, amax * scale_factor));
      const float scale = state.scale().item<float>();
      EXPECT_FLOAT_EQ(scale, kE4M3Max / (amax * scale_factor));
      at::Tensor out8 = at::empty({rows, cols}, at::kFloat8_e4m3fn), aux8 = gelu ? at::empty({rows, cols}) : at::Tensor();
      ASSERT_TRUE(bmt::nn::fp8_gemm_epilogue_to_fp8(e, aq.data, Fp8Format::kE4M3, aq.inv, wq.data, Fp8Format::kE4M3,
                                                    wq.inv, false, out8, state, bias, aux8));
      const at::Tensor want = out.contiguous();
      at::Tensor want8 = at::empty({rows * cols}, at::kByte);
      int64_t saturated = 0;
      for (int64_t i = 0; i < rows * cols; ++i) {
        const float v = want.view({-1})[i].item<float>() * scale;
        want8[i] = static_cast<int64_t>(k::float_to_fp8(v, k::Fp8Format::kE4M3));
        saturated += std::fabs(v) > kE4M3Max;
      }
      EXPECT_TRUE(at::equal(bytes(out8).view({-1}), want8)) << k::gemm_epilogue_name(e) << " x" << scale_factor;
      EXPECT_EQ(state.amax().item<float>(), amax) << "the amax of the unscaled output";
      if (gelu) {
        EXPECT_TRUE(at::equal(aux8, aux)) << "the pre-activation as the 16/32-bit epilogue writes it";
      }
      EXPECT_EQ(saturated > 0, scale_factor < 1.0f) << "saturated values: " << saturated;
      // the record: this call's inverse scale, the next scale from the amax just folded in
      const float call_inv = state.record().item<float>();
      EXPECT_FLOAT_EQ(call_inv, 1.0f / scale);
      EXPECT_FLOAT_EQ(state.scale().item<float>(), kE4M3Max / std::max(amax, amax * scale_factor));
      EXPECT_EQ(state.amax().item<float>(), 0.0f) << "the record leaves the amax at 0 for the next producer";
    }
  }
}

TEST(Fp8GemmEpilogueTwin, Fp8OutputRefusesAResidualAndTheGradientEpilogues) {
  const bmt::nn::Fp8Tensor aq = bmt::nn::fp8_cast(at::randn({16, 16}), Fp8Format::kE4M3, true, false);
  Fp8DelayedScale state(2);
  state.record_amax(at::ones({}));
  const at::Tensor out8 = at::empty({16, 16}, at::kFloat8_e4m3fn), bias = at::zeros({16});
  k::Fp8GemmOperands f8;
  float inv = 1.0f, scale = 1.0f, amax = 0.0f;
  f8.a_inv_scale = f8.b_inv_scale = &inv, f8.out_scale = &scale, f8.out_amax = &amax;
  k::GemmEpilogueArgs g;
  g.rows = g.cols = g.inner = 16, g.a = g.b = aq.data.data_ptr(), g.out = out8.data_ptr(), g.fp8 = &f8;
  g.dtype = bmt::core::DType::kFloat32;
  const at::Tensor res = at::zeros({16, 16});
  g.residual = res.data_ptr();
  EXPECT_THROW(k::gemm_epilogue_cpu(g), std::exception);
  g.residual = nullptr, g.epilogue = k::GemmEpilogue::kDGelu, g.aux = res.data_ptr();
  try {
    k::gemm_epilogue_cpu(g);
    ADD_FAILURE() << "an FP8 output of the dgelu epilogue was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("FP8 output"), std::string::npos) << e.what();
  }
  f8.out_amax = nullptr, g.epilogue = k::GemmEpilogue::kBias, g.aux = nullptr;
  EXPECT_THROW(k::gemm_epilogue_cpu(g), std::exception) << "an FP8 output without its amax";
  // the nn face: the output's format must be the state's
  EXPECT_THROW(bmt::nn::fp8_gemm_epilogue_to_fp8(k::GemmEpilogue::kBias, aq.data, Fp8Format::kE4M3, aq.inv, aq.data,
                                                 Fp8Format::kE4M3, aq.inv, false,
                                                 at::empty({16, 16}, at::kFloat8_e5m2), state, bias, at::Tensor()),
               std::exception);
}

TEST(Fp8Transpose, TwinIsTheTransposeByteForByte) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{48, 80}, {7, 13}, {1, 64}, {0, 5}}) {
    const at::Tensor q = at::randint(0, 256, {rows, cols}, at::kByte).view(at::kFloat8_e4m3fn);
    const at::Tensor t = bmt::nn::fp8_transpose(q);
    ASSERT_EQ(t.sizes(), (std::vector<int64_t>{cols, rows}));
    EXPECT_EQ(t.scalar_type(), at::kFloat8_e4m3fn);
    EXPECT_TRUE(at::equal(bytes(t), bytes(q).t().contiguous())) << rows << "x" << cols;
  }
  EXPECT_THROW(bmt::nn::fp8_transpose(at::zeros({4, 4})), std::exception) << "not float8";
  EXPECT_THROW(bmt::nn::fp8_transpose(at::zeros({4}, at::kFloat8_e4m3fn)), std::exception) << "not 2-D";
}

TEST(Fp8DelayedScale, RecordKeepsTheLastAmaxesAndScalesByTheirMaximum) {
  EXPECT_THROW(Fp8DelayedScale(0), std::exception);
  Fp8DelayedScale s(3);
  EXPECT_FALSE(s.ready());
  EXPECT_THROW(s.scale(), std::exception) << "no scale before the first record";
  EXPECT_THROW(s.record(), std::exception) << "nothing to record";
  auto record = [&](float amax) { s.record_amax(at::full({}, amax)); };
  auto history = [&] { return std::vector<float>(s.history().data_ptr<float>(), s.history().data_ptr<float>() + 3); };
  record(2.0f);
  EXPECT_TRUE(s.ready());
  EXPECT_EQ(history(), (std::vector<float>{2, 0, 0}));
  EXPECT_FLOAT_EQ(s.scale().item<float>(), kE4M3Max / 2.0f);
  record(8.0f);
  record(1.0f);
  EXPECT_EQ(history(), (std::vector<float>{1, 8, 2}));
  EXPECT_FLOAT_EQ(s.scale().item<float>(), kE4M3Max / 8.0f) << "the window's maximum";
  record(1.0f);
  EXPECT_FLOAT_EQ(s.scale().item<float>(), kE4M3Max / 8.0f);
  record(1.0f);
  EXPECT_EQ(history(), (std::vector<float>{1, 1, 1}));
  EXPECT_FLOAT_EQ(s.scale().item<float>(), kE4M3Max) << "8 left the window of 3";
  // a producer's non-finite amax: this call's inverse scale is NaN, the history keeps a 0 in its place
  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    s.amax().fill_(bad);
    EXPECT_TRUE(std::isnan(s.record().item<float>())) << bad;
    EXPECT_EQ(history()[0], 0.0f) << bad;
    EXPECT_FALSE(std::isnan(s.scale().item<float>())) << "a non-finite amax must not poison the next steps";
    EXPECT_EQ(s.amax().item<float>(), 0.0f);
  }
  // an all-zero window: scale 1
  Fp8DelayedScale z(1);
  z.record_amax(at::zeros({}));
  EXPECT_EQ(z.scale().item<float>(), 1.0f);
  EXPECT_THROW(z.record_amax(at::zeros({2})), std::exception) << "one amax";
  EXPECT_THROW(z.record_amax(at::zeros({}, at::kDouble)), std::exception) << "float32";
}

TEST(Fp8DelayedGelu, MlpWritesTheGeluOutputInFp8WithTheDelayedScale) {
  at::manual_seed(47);
  const int64_t rows = 32, dim = 32, hidden = 64;
  const at::Tensor x = at::randn({rows, dim}), w1 = at::randn({hidden, dim}) * 0.2, b1 = at::randn({hidden}) * 0.1;
  const at::Tensor w2 = at::randn({dim, hidden}) * 0.1, b2 = at::randn({dim}) * 0.1, g = at::randn({rows, dim});
  const MlpRun dynamic = run_mlp(x, w1, b1, w2, b2, g, nullptr);
  Fp8DelayedScale s(4);
  // first call: nothing recorded yet, so the dynamic cast, whose amax is recorded
  expect_same(run_mlp(x, w1, b1, w2, b2, g, &s), dynamic, "first call (dynamic)");
  ASSERT_TRUE(s.ready());
  const float amax1 = s.history()[0].item<float>();
  EXPECT_GT(amax1, 0.0f);
  // (the forward and the backward each record once per call; the backward does not run the forward again)
  // second call, same inputs: the delayed scale is the dynamic one, so in fp32 the FP8 GEMM's own h bytes and the
  // transposed copy are the dynamic cast's, bit for bit
  expect_same(run_mlp(x, w1, b1, w2, b2, g, &s), dynamic, "second call (delayed, the same scale)");
  EXPECT_EQ(s.history()[0].item<float>(), amax1) << "the GEMM's amax of h is the dynamic cast's";
  EXPECT_EQ(s.history()[1].item<float>(), amax1);
  // smaller inputs: the delayed scale (of the window's larger amax) is no longer h's own; within FP8 rounding of the
  // dynamic path, and not equal to it
  const at::Tensor xs = x * 0.25;
  const MlpRun dyn_small = run_mlp(xs, w1, b1, w2, b2, g, nullptr);
  const MlpRun del_small = run_mlp(xs, w1, b1, w2, b2, g, &s);
  EXPECT_FALSE(at::equal(del_small.y, dyn_small.y)) << "another scale gives other bytes";
  EXPECT_LT(rel_diff(del_small.y, dyn_small.y), 0.08);
  EXPECT_LT(rel_diff(del_small.dw2, dyn_small.dw2), 0.08);
  EXPECT_LT(rel_diff(del_small.dx, dyn_small.dx), 0.12);
  const float amax_small = s.history()[0].item<float>();
  EXPECT_LT(amax_small, amax1);
  EXPECT_FLOAT_EQ(s.scale().item<float>(), kE4M3Max / amax1) << "the window still holds the larger amax";
  // an inf pre-activation (c_fc's bias): h's bytes would saturate to finite values, so the NaN inverse scale must
  // make the output NaN (the step is skipped), as the dynamic cast's NaN scale does
  at::Tensor bi = b1.clone();
  bi[5] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(run_mlp(x, w1, bi, w2, b2, g, nullptr).y.isnan().all().item<bool>()) << "dynamic: every output NaN";
  const MlpRun bad = run_mlp(x, w1, bi, w2, b2, g, &s);
  EXPECT_TRUE(bad.y.isnan().all().item<bool>()) << "delayed: every output NaN";
  EXPECT_EQ(s.history()[0].item<float>(), 0.0f) << "the non-finite amax is not kept";
  // the window (newest first: 0, the small amax, amax1, amax1) has amax1 for its maximum: the dynamic scale again
  expect_same(run_mlp(x, w1, b1, w2, b2, g, &s), dynamic, "after the skipped step");
}

// Delayed scaling of a GEMM input (nn::fp8_cast_delayed, core's fp8_cast_delayed_cpu): the cast takes the state's
// scale and folds the tensor's amax in the same pass.
TEST(Fp8CastDelayed, TwinCastsWithTheGivenScaleAndFoldsTheAmax) {
  at::manual_seed(53);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t rows = 24, cols = 40;
  for (const float start : {0.0f, 100.0f, nan}) {
    for (const bool with_nan : {false, true}) {
      at::Tensor x = at::randn({rows, cols}) * 3.0;
      if (with_nan) x[3][7] = nan;
      const float scale = kE4M3Max / 5.0f;  // |x| above 5 saturates
      float amax = start;
      at::Tensor q = at::empty({rows, cols}, at::kByte), qt = at::empty({cols, rows}, at::kByte);
      k::fp8_cast_delayed_cpu(x.data_ptr(), bmt::core::DType::kFloat32, rows, cols, &scale, &amax,
                              k::Fp8Format::kE4M3, q.data_ptr<uint8_t>(), qt.data_ptr<uint8_t>());
      int64_t saturated = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const float v = x[r][c].item<float>() * scale;
          const auto want = static_cast<int64_t>(k::float_to_fp8(v, k::Fp8Format::kE4M3));
          ASSERT_EQ(q[r][c].item<int64_t>(), want) << r << "," << c;
          ASSERT_EQ(qt[c][r].item<int64_t>(), want) << r << "," << c;
          saturated += std::fabs(v) > kE4M3Max;
        }
      }
      EXPECT_GT(saturated, 0) << "the scale saturates |x| > 5";
      if (with_nan || std::isnan(start)) {
        EXPECT_TRUE(std::isnan(amax)) << "a NaN on either side wins (start " << start << ")";
      } else {
        EXPECT_EQ(amax, std::max(start, x.abs().max().item<float>())) << "start " << start;
      }
    }
  }
}

TEST(Fp8CastDelayed, FirstCallIsTheDynamicCastThenTheRecordedScale) {
  at::manual_seed(59);
  const at::Tensor x = at::randn({32, 48}) * 2.0;
  Fp8DelayedScale s(2);
  const bmt::nn::Fp8Tensor dyn = bmt::nn::fp8_cast(x, Fp8Format::kE4M3, true, true);
  const bmt::nn::Fp8Tensor first = bmt::nn::fp8_cast_delayed(x, s, true, true);
  ASSERT_TRUE(s.ready());
  EXPECT_TRUE(at::equal(bytes(first.data), bytes(dyn.data)) && at::equal(bytes(first.data_t), bytes(dyn.data_t)));
  EXPECT_EQ(first.inv.item<float>(), dyn.inv.item<float>());
  const float amax = x.abs().max().item<float>();
  EXPECT_EQ(s.history()[0].item<float>(), amax);
  // the same tensor again: its own amax is the window's, so the bytes and inverse scale are the dynamic cast's
  const bmt::nn::Fp8Tensor again = bmt::nn::fp8_cast_delayed(x, s, true, false);
  EXPECT_TRUE(at::equal(bytes(again.data), bytes(dyn.data)));
  EXPECT_FALSE(again.data_t.defined()) << "only the copy asked for";
  EXPECT_EQ(again.inv.item<float>(), dyn.inv.item<float>());
  // four times larger: cast with the old scale (a quarter of the values saturate or more), the new amax recorded
  const at::Tensor big = x * 4.0;
  const bmt::nn::Fp8Tensor sat = bmt::nn::fp8_cast_delayed(big, s, true, false);
  EXPECT_EQ(sat.inv.item<float>(), dyn.inv.item<float>()) << "this call's bytes were written with the old scale";
  const at::Tensor decoded = sat.data.to(at::kFloat) * sat.inv;
  EXPECT_FLOAT_EQ(decoded.abs().max().item<float>(), amax) << "saturated at the old range";
  EXPECT_EQ(s.history()[0].item<float>(), 4.0f * amax);
  EXPECT_FLOAT_EQ(s.scale().item<float>(), kE4M3Max / (4.0f * amax)) << "the next scale covers the larger tensor";
  // a NaN in the input: NaN inverse scale for this call (its step is skipped), the window keeps a 0
  at::Tensor bad = x.clone();
  bad[1][2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(bmt::nn::fp8_cast_delayed(bad, s, true, false).inv.item<float>()));
  EXPECT_EQ(s.history()[0].item<float>(), 0.0f);
  EXPECT_THROW(bmt::nn::fp8_cast_delayed(at::zeros({4}), s, true, false), std::exception) << "not 2-D";
}

namespace {

using fp8_test::LinearRun;
using fp8_test::run_linear;

bool same(const LinearRun& a, const LinearRun& b) {
  return at::equal(a.y, b.y) && at::equal(a.dx, b.dx) && at::equal(a.dw, b.dw) && at::equal(a.db, b.db);
}

// Restores the process-wide switch however the test ends.
struct DelayedInputsOn {
  DelayedInputsOn() { bmt::nn::set_fp8_delayed_inputs_enabled(true); }
  ~DelayedInputsOn() { bmt::nn::set_fp8_delayed_inputs_enabled(false); }
};

}  // namespace

TEST(Fp8DelayedInputs, LinearAndMlpCastTheirOperandsWithTheDelayedScales) {
  at::manual_seed(61);
  const at::Tensor x = at::randn({32, 48}), w = at::randn({64, 48}) * 0.2, b = at::randn({64}) * 0.1;
  const at::Tensor g = at::randn({32, 64});
  const LinearRun dyn = run_linear(x, w, b, g, nullptr);
  bmt::nn::Fp8LinearScales off;
  run_linear(x, w, b, g, &off);
  EXPECT_FALSE(off.input.ready() || off.weight.ready()) << "switch off (the default): the states are not used";
  DelayedInputsOn on;
  bmt::nn::Fp8LinearScales s;
  // first call: dynamic casts, amaxes recorded; second: the recorded scales are the dynamic ones, and dgrad reads the
  // weight's transposed copy the forward's delayed cast wrote: every output and gradient bit for bit
  for (const char* call : {"first call (dynamic)", "second call (delayed, the same scales)"})
    EXPECT_TRUE(same(run_linear(x, w, b, g, &s), dyn)) << call;
  EXPECT_EQ(s.input.history()[1].item<float>(), x.abs().max().item<float>());
  EXPECT_EQ(s.weight.history()[1].item<float>(), w.abs().max().item<float>());
  // smaller inputs (not a power of two, which would only move FP8's exponents): the window's larger amax scales them,
  // within FP8 rounding of the dynamic path and not equal; dx does not read x
  const at::Tensor xs = x * 0.3;
  const LinearRun dyn_small = run_linear(xs, w, b, g, nullptr), del_small = run_linear(xs, w, b, g, &s);
  EXPECT_FALSE(at::equal(del_small.y, dyn_small.y));
  EXPECT_LT(rel_diff(del_small.y, dyn_small.y), 0.08);
  EXPECT_LT(rel_diff(del_small.dw, dyn_small.dw), 0.08);
  EXPECT_TRUE(at::equal(del_small.dx, dyn_small.dx));
  // a smaller weight: its delayed scale too, in the forward and in dgrad's transposed copy
  const at::Tensor ws = w * 0.3;
  const LinearRun dyn_w = run_linear(x, ws, b, g, nullptr), del_w = run_linear(x, ws, b, g, &s);
  EXPECT_FALSE(at::equal(del_w.y, dyn_w.y) || at::equal(del_w.dx, dyn_w.dx));
  EXPECT_LT(rel_diff(del_w.y, dyn_w.y), 0.08);
  EXPECT_LT(rel_diff(del_w.dx, dyn_w.dx), 0.08);
  // the residual form takes the same states
  bmt::nn::Fp8LinearScales sr;
  const at::Tensor res = at::randn({32, 64});
  for (int i = 0; i < 2; ++i)
    EXPECT_TRUE(at::equal(bmt::nn::fp8_linear_residual(x, w, b, res, Fp8Format::kE5M2, bmt::nn::Fp8Scaling::kTensor,
                                                       &sr),
                          dyn.y + res));
  EXPECT_TRUE(sr.input.ready() && sr.weight.ready());
  // the FP8 MLP: the fused function with c_fc's and c_proj's states, bit for bit the dynamic path on the first two
  // calls (every gradient: the weights' transposed copies are the forward's)
  const int64_t hidden = 64;
  const at::Tensor w1 = at::randn({hidden, 48}) * 0.2, b1 = at::randn({hidden}) * 0.1;
  const at::Tensor w2 = at::randn({48, hidden}) * 0.1, b2 = at::randn({48}) * 0.1, gm = at::randn({32, 48});
  const MlpRun mdyn = run_mlp(x, w1, b1, w2, b2, gm, nullptr);
  bmt::nn::Fp8LinearScales fc, proj;
  for (const char* call : {"MLP first call", "MLP second call"}) {
    at::Tensor xi = x.clone().requires_grad_(), w1i = w1.clone().requires_grad_(), b1i = b1.clone().requires_grad_();
    at::Tensor w2i = w2.clone().requires_grad_(), b2i = b2.clone().requires_grad_();
    const at::Tensor y = bmt::nn::fp8_gelu_mlp_fused(xi, w1i, b1i, w2i, b2i, at::Tensor(), Fp8Format::kE5M2, true,
                                                     nullptr, &fc, &proj);
    y.backward(gm);
    expect_same({y.detach(), xi.grad(), w1i.grad(), b1i.grad(), w2i.grad(), b2i.grad()}, mdyn, call);
  }
  EXPECT_EQ(fc.input.history()[0].item<float>(), x.abs().max().item<float>());
  EXPECT_EQ(fc.weight.history()[0].item<float>(), w1.abs().max().item<float>());
  EXPECT_EQ(proj.weight.history()[0].item<float>(), w2.abs().max().item<float>());
  EXPECT_FALSE(proj.input.ready()) << "c_proj's input is h, which the MLP casts itself";
}
