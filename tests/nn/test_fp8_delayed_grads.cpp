// Delayed scaling of the FP8 linears' output gradients (BMT_FP8_DELAYED_GRADS): the fused cast's CPU twin against
// torch's ops (the bytes are the gradient's E5M2 encoding with the given scale, the sums the bias gradient, the amax
// folded), nn::fp8_cast_grad_delayed's first call as the dynamic cast, and nn::fp8_linear / the fused FP8 MLP with the
// switch against the dynamic path: bit for bit while the scale is the same, within FP8 rounding when the gradient
// shrinks, NaN gradients marked for the skip logic, and the autograd node keeping the state alive past its module.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>

#include "bmt/core/kernels/fp8_cast_grad_internal.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_format_internal.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_linear_internal.h"
#include "bmt/nn/fp8_mlp.h"
#include "fp8_reference.h"
#include "bmt/runtime/env_switch_internal.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace k = bmt::core::kernels;
using bmt::nn::Fp8Format;

namespace {

constexpr float kE5M2Max = 57344.0f;

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-30);
}

// Restores the process-wide switch however the test ends.
struct DelayedGradsOn {
  DelayedGradsOn() { bmt::nn::set_fp8_delayed_grads_enabled(true); }
  ~DelayedGradsOn() { bmt::nn::set_fp8_delayed_grads_enabled(false); }
};

using fp8_test::LinearRun;
using fp8_test::run_linear;

}  // namespace

TEST(Fp8CastGradDelayed, TwinCastsTheGradientWithTheGivenScaleAndSumsItsColumns) {
  at::manual_seed(71);
  const int64_t rows = 40, cols = 24;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const bool dgelu : {false, true}) {
    const at::Tensor dy = (at::randn({rows, cols}) * 0.01).to(at::kBFloat16);
    const at::Tensor pre = (at::randn({rows, cols}) * 2.0).to(at::kBFloat16);
    // the gradient the cast sees: dy, or GELU's input gradient rounded to bf16 (torch's formula in double)
    const at::Tensor g = dgelu ? at::gelu_backward(dy.to(at::kDouble), pre.to(at::kDouble), "tanh").to(at::kBFloat16)
                               : dy;
    const float amax = g.abs().max().item<float>();
    for (const float headroom : {4.0f, 0.25f}) {  // the scale's range above the gradient's, then below (saturates)
      const float scale = kE5M2Max / (amax * headroom);
      for (const float start : {0.0f, 1e6f, nan}) {
        at::Tensor q = at::zeros({rows, cols}, at::kByte), qt = at::zeros({cols, rows}, at::kByte);
        at::Tensor sums = at::zeros({cols}, at::kFloat), sc = at::full({}, scale), am = at::full({}, start);
        k::fp8_cast_grad_delayed_cpu(dy.data_ptr(), dgelu ? pre.data_ptr() : nullptr, bmt::core::DType::kBFloat16,
                                     rows, cols, sc.data_ptr<float>(), am.data_ptr<float>(), k::Fp8Format::kE5M2,
                                     q.data_ptr<uint8_t>(), qt.data_ptr<uint8_t>(), sums.data_ptr(),
                                     bmt::core::DType::kFloat32);
        // bytes: E5M2 of g * scale (2 mantissa bits: within 2^-3 relative, or the smallest subnormal), saturated
        const at::Tensor decoded = q.view(at::kFloat8_e5m2).to(at::kDouble) / scale;
        const at::Tensor want = (g.to(at::kDouble) * scale).clamp(-kE5M2Max, kE5M2Max) / scale;
        const at::Tensor err = (decoded - want).abs();
        const at::Tensor bound = at::maximum(want.abs() * 0.125, at::full({}, std::ldexp(1.0, -16) / scale));
        EXPECT_TRUE((err <= bound).all().item<bool>()) << "dgelu " << dgelu << " headroom " << headroom;
        const at::Tensor normal = g.to(at::kDouble).abs() * scale > 1.0;  // (not flushed towards zero)
        EXPECT_EQ(headroom < 1.0f,
                  ((decoded.abs() < g.to(at::kDouble).abs() * 0.5) & normal).any().item<bool>())
            << "saturation only when the scale's range is below the gradient's";
        EXPECT_TRUE(at::equal(qt, q.t().contiguous())) << "the transposed copy holds the same bytes";
        // the bias gradient: the column sums of the values cast (double reference, fp32 rounding)
        EXPECT_LT(rel_diff(sums, g.to(at::kDouble).sum(0)), 1e-6);
        // the fold: max(start, amax), a NaN start staying NaN
        if (std::isnan(start)) EXPECT_TRUE(std::isnan(am.item<float>()));
        else EXPECT_EQ(am.item<float>(), std::max(start, amax));
      }
    }
  }
  // neither copy: only the sums; a NaN in the gradient folds NaN
  at::Tensor dy = at::randn({8, 8});
  dy[3][4] = nan;
  at::Tensor sums = at::zeros({8}), sc = at::ones({}), am = at::zeros({});
  k::fp8_cast_grad_delayed_cpu(dy.data_ptr(), nullptr, bmt::core::DType::kFloat32, 8, 8, sc.data_ptr<float>(),
                               am.data_ptr<float>(), k::Fp8Format::kE5M2, nullptr, nullptr, sums.data_ptr(),
                               bmt::core::DType::kFloat32);
  EXPECT_EQ(am.item<float>(), 0.0f) << "no cast: nothing folded";
  EXPECT_TRUE(std::isnan(sums[4].item<float>()) && !std::isnan(sums[3].item<float>()));
  // the CUDA variant's shape rule
  EXPECT_TRUE(k::fp8_cast_grad_cuda_applies(16384, 8192, dy.data_ptr(), nullptr, nullptr, nullptr));
  EXPECT_FALSE(k::fp8_cast_grad_cuda_applies(20, 12, dy.data_ptr(), nullptr, nullptr, nullptr));
  EXPECT_EQ(k::fp8_cast_grad_workspace_numel(130, 24), 3 * 24);
}

TEST(Fp8CastGradDelayed, FirstCallIsTheDynamicCastThenTheRecordedScale) {
  at::manual_seed(72);
  const at::Tensor dy = at::randn({32, 48}) * 0.01, pre = at::randn({32, 48});
  for (const bool dgelu : {false, true}) {
    bmt::nn::Fp8DelayedScale state(16, Fp8Format::kE5M2);
    at::Tensor db_dyn, db1, db2;
    const bmt::nn::Fp8Tensor dyn =
        dgelu ? bmt::nn::fp8_cast_dgelu_grad(bmt::nn::Fp8Scaling::kTensor, dy, pre, Fp8Format::kE5M2, true, true,
                                             &db_dyn, at::kFloat)
              : bmt::nn::fp8_cast_grad(bmt::nn::Fp8Scaling::kTensor, dy, Fp8Format::kE5M2, true, true, &db_dyn,
                                       at::kFloat);
    const at::Tensor none;
    const bmt::nn::Fp8Tensor first =
        bmt::nn::fp8_cast_grad_delayed(dy, dgelu ? pre : none, state, true, true, &db1, at::kFloat);
    ASSERT_TRUE(state.ready());
    EXPECT_TRUE(at::equal(first.data.view(at::kByte), dyn.data.view(at::kByte)));
    EXPECT_TRUE(at::equal(first.inv, dyn.inv) && at::equal(db1, db_dyn)) << "the first call is the dynamic cast";
    EXPECT_EQ(state.history()[0].item<float>(), dyn.stats[0].item<float>());
    // the same gradient again: the window's scale is the dynamic one, the twin's bytes the same (fp32 gradient: the
    // twin's fp64 GELU gradient rounds as torch's fp32 one), the sums within fp32 rounding
    const bmt::nn::Fp8Tensor second =
        bmt::nn::fp8_cast_grad_delayed(dy, dgelu ? pre : none, state, true, true, &db2, at::kFloat);
    EXPECT_FLOAT_EQ(second.inv.item<float>(), dyn.inv.item<float>());
    const double same = second.data.view(at::kByte).eq(dyn.data.view(at::kByte)).to(at::kDouble).mean().item<double>();
    EXPECT_GE(same, dgelu ? 0.999 : 1.0) << "dgelu " << dgelu;
    EXPECT_TRUE(at::equal(second.data_t.view(at::kByte), second.data.view(at::kByte).t().contiguous()));
    EXPECT_LT(rel_diff(db2, db_dyn), 1e-6);
    EXPECT_EQ(state.history()[0].item<float>(), dyn.stats[0].item<float>()) << "the second call's amax recorded";
    // a NaN gradient: a NaN inverse scale for this call (the step is skipped), the window keeps a 0
    at::Tensor bad = dy.clone();
    bad[2][5] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(std::isnan(
        bmt::nn::fp8_cast_grad_delayed(bad, dgelu ? pre : none, state, true, false, nullptr, at::kFloat).inv.item<float>()));
    EXPECT_EQ(state.history()[0].item<float>(), 0.0f);
  }
}

TEST(Fp8DelayedGrads, LinearAndMlpCastTheirGradientsWithTheDelayedScales) {
  at::manual_seed(73);
  const at::Tensor x = at::randn({32, 48}), w = at::randn({64, 48}) * 0.2, b = at::randn({64}) * 0.1;
  const at::Tensor g = at::randn({32, 64}) * 0.01;
  const LinearRun dyn = run_linear(x, w, b, g, nullptr);
  bmt::nn::Fp8LinearScales off;
  run_linear(x, w, b, g, &off);
  EXPECT_FALSE(off.grad.ready()) << "switch off (the default): the gradient state is not used";
  DelayedGradsOn on;
  bmt::nn::Fp8LinearScales s;
  for (const char* call : {"first call (dynamic)", "second call (delayed, the same scale)"}) {
    const LinearRun r = run_linear(x, w, b, g, &s);
    EXPECT_TRUE(at::equal(r.y, dyn.y) && at::equal(r.dx, dyn.dx) && at::equal(r.dw, dyn.dw)) << call;
    EXPECT_LT(rel_diff(r.db, dyn.db), 1e-6) << call;
  }
  EXPECT_EQ(s.grad.history()[1].item<float>(), g.abs().max().item<float>());
  EXPECT_FALSE(s.input.ready() || s.weight.ready()) << "the forward's states are BMT_FP8_DELAYED_INPUTS's";
  // a smaller gradient (not a power of two): cast with the window's larger amax, within FP8 rounding, not equal
  const at::Tensor gs = g * 0.3;
  const LinearRun dyn_small = run_linear(x, w, b, gs, nullptr), del_small = run_linear(x, w, b, gs, &s);
  EXPECT_TRUE(at::equal(del_small.y, dyn_small.y));
  EXPECT_FALSE(at::equal(del_small.dx, dyn_small.dx));
  EXPECT_LT(rel_diff(del_small.dx, dyn_small.dx), 0.15);
  EXPECT_LT(rel_diff(del_small.dw, dyn_small.dw), 0.15);
  EXPECT_LT(rel_diff(del_small.db, dyn_small.db), 1e-6) << "the bias gradient is exact either way";
  // E4M3 gradients: the E5M2 state is not used (dynamic casts)
  bmt::nn::Fp8LinearScales e4;
  at::Tensor xi = x.clone().requires_grad_();
  bmt::nn::fp8_linear(xi, w, b, Fp8Format::kE4M3, bmt::nn::Fp8Scaling::kTensor, true, &e4).backward(g);
  EXPECT_FALSE(e4.grad.ready());
  // the node keeps the state: the layer's scales gone before the backward, the backward still records into it
  auto owned = std::make_unique<bmt::nn::Fp8LinearScales>();
  run_linear(x, w, b, g, owned.get());
  const bmt::nn::Fp8DelayedScale kept = owned->grad.share();
  at::Tensor xk = x.clone().requires_grad_();
  const at::Tensor yk = bmt::nn::fp8_linear(xk, w, b, Fp8Format::kE5M2, bmt::nn::Fp8Scaling::kTensor, true, owned.get());
  owned.reset();
  yk.backward(gs);
  EXPECT_TRUE(at::equal(xk.grad(), del_small.dx)) << "the same window maximum: the same scale as the run above";
  EXPECT_EQ(kept.history()[0].item<float>(), gs.abs().max().item<float>()) << "recorded after its module was gone";
  // the fused FP8 MLP: c_proj's dy and c_fc's d pre with their states, the dynamic path on the first two calls
  const int64_t hidden = 64;
  const at::Tensor w1 = at::randn({hidden, 48}) * 0.2, b1 = at::randn({hidden}) * 0.1;
  const at::Tensor w2 = at::randn({48, hidden}) * 0.1, b2 = at::randn({48}) * 0.1, gm = at::randn({32, 48}) * 0.01;
  auto run_mlp = [&](bmt::nn::Fp8LinearScales* fc, bmt::nn::Fp8LinearScales* proj, const at::Tensor& grad) {
    at::Tensor xi = x.clone().requires_grad_(), w1i = w1.clone().requires_grad_(), b1i = b1.clone().requires_grad_();
    at::Tensor w2i = w2.clone().requires_grad_(), b2i = b2.clone().requires_grad_();
    const at::Tensor y = bmt::nn::fp8_gelu_mlp_fused(xi, w1i, b1i, w2i, b2i, at::Tensor(), Fp8Format::kE5M2, true,
                                                     nullptr, fc, proj);
    y.backward(grad);
    return std::vector<at::Tensor>{xi.grad(), w1i.grad(), b1i.grad(), w2i.grad(), b2i.grad()};
  };
  bmt::nn::set_fp8_delayed_grads_enabled(false);
  const auto mdyn = run_mlp(nullptr, nullptr, gm), mdyn_small = run_mlp(nullptr, nullptr, gm * 0.3);
  bmt::nn::set_fp8_delayed_grads_enabled(true);
  bmt::nn::Fp8LinearScales fc, proj;
  for (int call = 0; call < 2; ++call) {
    const auto m = run_mlp(&fc, &proj, gm);
    for (size_t i = 0; i < m.size(); ++i) EXPECT_LT(rel_diff(m[i], mdyn[i]), 2e-3) << "call " << call << " grad " << i;
    EXPECT_TRUE(at::equal(m[3], mdyn[3])) << "c_proj's wgrad: dy's bytes the same on call " << call;
  }
  EXPECT_EQ(proj.grad.history()[0].item<float>(), gm.abs().max().item<float>());
  EXPECT_TRUE(fc.grad.ready()) << "d pre's amax recorded";
  const auto msmall = run_mlp(&fc, &proj, gm * 0.3);
  for (size_t i = 0; i < msmall.size(); ++i) EXPECT_LT(rel_diff(msmall[i], mdyn_small[i]), 0.15) << "grad " << i;
  EXPECT_FALSE(at::equal(msmall[0], mdyn_small[0])) << "dx from the delayed scales";
}

TEST(Fp8DelayedGrads, LinearInPiecesIsTheLinearChunked) {
  // fp8_linear_parts: the output in pieces of one node; values and every gradient those of fp8_linear's output
  // chunked, with dynamic and with delayed gradient scales (the pieces' gradients concatenated by the twin on CPU); a
  // piece left unused gets a zero gradient
  at::manual_seed(74);
  const at::Tensor x = at::randn({32, 48}), w = at::randn({96, 48}) * 0.2, b = at::randn({96}) * 0.1;
  const at::Tensor g = at::randn({32, 96}) * 0.01;
  auto run = [&](bool pieces, bmt::nn::Fp8LinearScales* s, bool drop_last) {
    at::Tensor xi = x.clone().requires_grad_(), wi = w.clone().requires_grad_(), bi = b.clone().requires_grad_();
    std::vector<at::Tensor> ys =
        pieces ? bmt::nn::fp8_linear_parts(xi, wi, bi, 3, Fp8Format::kE5M2, bmt::nn::Fp8Scaling::kTensor, true, s)
               : bmt::nn::fp8_linear(xi, wi, bi, Fp8Format::kE5M2, bmt::nn::Fp8Scaling::kTensor, true, s).chunk(3, -1);
    const std::vector<at::Tensor> gs = g.chunk(3, -1);
    at::Tensor loss = (ys[0] * gs[0]).sum() + (ys[1] * gs[1]).sum();
    if (!drop_last) loss = loss + (ys[2] * gs[2]).sum();
    loss.backward();
    return std::vector<at::Tensor>{at::cat({ys[0], ys[1], ys[2]}, 1).detach(), xi.grad(), wi.grad(), bi.grad()};
  };
  for (const bool drop : {false, true}) {
    const auto want = run(false, nullptr, drop), got = run(true, nullptr, drop);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << "dynamic, item " << i;
  }
  DelayedGradsOn on;
  bmt::nn::Fp8LinearScales whole, pieces;
  for (int call = 0; call < 3; ++call) {
    const auto want = run(false, &whole, false), got = run(true, &pieces, false);
    for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << "delayed, call " << call << " item " << i;
    EXPECT_LT(rel_diff(got[3], want[3]), 1e-6);
  }
  EXPECT_EQ(pieces.grad.history()[0].item<float>(), g.abs().max().item<float>());
  EXPECT_THROW(bmt::nn::fp8_linear_parts(x, w, b, 5), std::exception) << "96 features do not split into 5";
}

TEST(Fp8Recipe, DelayedTurnsOnTheThreeDelayedScalingsAndCurrentTurnsThemOff) {
  namespace nn = bmt::nn;
  const nn::Fp8Recipe prev = nn::fp8_recipe();
  const bool gelu = nn::fp8_delayed_gelu_enabled(), inputs = nn::fp8_delayed_inputs_enabled(),
             grads = nn::fp8_delayed_grads_enabled();
  nn::set_fp8_recipe(nn::Fp8Recipe::kDelayed);
  EXPECT_EQ(nn::fp8_recipe(), nn::Fp8Recipe::kDelayed);
  EXPECT_TRUE(nn::fp8_delayed_gelu_enabled() && nn::fp8_delayed_inputs_enabled() && nn::fp8_delayed_grads_enabled());
  nn::set_fp8_delayed_grads_enabled(false);  // (a switch set after the recipe wins)
  EXPECT_FALSE(nn::fp8_delayed_grads_enabled());
  EXPECT_TRUE(nn::fp8_delayed_inputs_enabled());
  nn::set_fp8_recipe(nn::Fp8Recipe::kCurrent);
  EXPECT_FALSE(nn::fp8_delayed_gelu_enabled() || nn::fp8_delayed_inputs_enabled() || nn::fp8_delayed_grads_enabled());
  for (nn::Fp8Recipe r : {nn::Fp8Recipe::kCurrent, nn::Fp8Recipe::kDelayed})
    EXPECT_EQ(nn::fp8_recipe_from_name(nn::fp8_recipe_name(r), "test"), r);
  try {
    nn::fp8_recipe_from_name("rowwise", "--fp8-recipe");
    ADD_FAILURE() << "an unknown recipe name was accepted";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--fp8-recipe"), std::string::npos) << what;
    EXPECT_NE(what.find("'rowwise'"), std::string::npos) << what;
    EXPECT_NE(what.find("'delayed'"), std::string::npos) << what;
  }
  nn::set_fp8_recipe(prev);
  nn::set_fp8_delayed_gelu_enabled(gelu), nn::set_fp8_delayed_inputs_enabled(inputs);
  nn::set_fp8_delayed_grads_enabled(grads);
}

TEST(Fp8Recipe, AnUnsetSwitchFollowsItsDefaultAndASetVariableWins) {
  // (the recipe's switches: enabled(default) with the recipe's choice as the default, read on every call)
  ::unsetenv("BMT_TEST_RECIPE_SWITCH_UNSET");
  bmt::EnvSwitch unset("BMT_TEST_RECIPE_SWITCH_UNSET", false);
  EXPECT_TRUE(unset.enabled(true));
  EXPECT_FALSE(unset.enabled(false));
  EXPECT_FALSE(unset.enabled());
  ::setenv("BMT_TEST_RECIPE_SWITCH_OFF", "0", 1);
  bmt::EnvSwitch off("BMT_TEST_RECIPE_SWITCH_OFF", true);
  EXPECT_FALSE(off.enabled(true));
  ::setenv("BMT_TEST_RECIPE_SWITCH_ON", "1", 1);
  bmt::EnvSwitch on("BMT_TEST_RECIPE_SWITCH_ON", false);
  EXPECT_TRUE(on.enabled(false));
  unset.set(true);
  EXPECT_TRUE(unset.enabled(false));
}
