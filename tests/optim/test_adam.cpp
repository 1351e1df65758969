// AdamOptimizer: fp32 bit for bit torch.optim.Adam's op sequence (L2 and decoupled), close to LibTorch's Adam /
// AdamW, BMTrain's hold_steps count, the half-precision paths against the fused kernel in fp32,
// loss-scale handling, param groups, skipping, state dicts and argument errors.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <memory>

#include "bmt/core/error.h"
#include "bmt/optim/adam.h"
#include "bmt/params/param_meta.h"
#include "opt_test_util.h"

using bmt::optim::AdamOptimizer;
using bmt::optim::AdamOptions;
using namespace bmt::optim::testing;

// torch.optim.Adam's single-tensor update (torch/optim/adam.py, the CPU default), transcribed op by op for this
// test (its Python: step += 1; L2: grad = grad.add(p, alpha=wd), decoupled: p.mul_(1 - lr * wd);
// exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2); bias corrections
// 1 - beta ** step as Python floats; denom = (exp_avg_sq.sqrt() / bc2 ** 0.5).add_(eps);
// p.addcdiv_(exp_avg, denom, value=-(lr / bc1))). tests/python/test_adam_torch.py compares with torch itself.
struct PythonAdamRef {
  std::vector<at::Tensor> p, m, v;
  double lr, beta1, beta2, eps, wd;
  bool decoupled;
  double step = 0;
  void update(const std::vector<at::Tensor>& grads, double lr_now) {
    at::NoGradGuard no_grad;
    step += 1;
    for (size_t i = 0; i < p.size(); ++i) {
      at::Tensor g = grads[i];
      if (decoupled) p[i].mul_(1 - lr_now * wd);
      else g = g.add(p[i], wd);
      m[i].lerp_(g, 1 - beta1);
      v[i].mul_(beta2).addcmul_(g, g, 1 - beta2);
      const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
      at::Tensor denom = (v[i].sqrt() / std::pow(bc2, 0.5)).add_(eps);
      p[i].addcdiv_(m[i], denom, -(lr_now / bc1));
    }
  }
};

TEST(AdamOptimizer, Fp32EqualsTorchAdamBitwise) {
  for (bool decoupled : {false, true}) {
    const int64_t hold = 3;
    AdamOptions opts(1e-2, {0.8, 0.99}, 1e-6, 0.05);
    opts.hold_steps(hold).decoupled_weight_decay(decoupled);
    auto ours = make_params(kShapes, at::kFloat, 1);
    PythonAdamRef ref{clone_params(ours, at::kFloat), {}, {}, 1e-2, 0.8, 0.99, 1e-6, 0.05, decoupled};
    for (const auto& t : ref.p) {
      ref.m.push_back(at::zeros_like(t.detach()));
      ref.v.push_back(at::zeros_like(t.detach()));
    }
    AdamOptimizer opt(ours, opts);
    at::Generator gen = at::detail::createCPUGenerator(7);
    for (int step = 0; step < 24; ++step) {
      std::vector<at::Tensor> grads;
      for (size_t i = 0; i < ours.size(); ++i) {
        grads.push_back(at::randn(ours[i].sizes(), gen));
        ours[i].mutable_grad() = grads.back() * 4;  // loss scale 4 (a power of two: exact)
      }
      opt.step(4.0);
      ref.update(grads, step < hold ? 0.0 : 1e-2);  // fp32: the first hold_steps updates at lr 0
      for (size_t i = 0; i < ours.size(); ++i)
        ASSERT_TRUE(at::equal(ours[i], ref.p[i])) << "decoupled " << decoupled << " step " << step + 1 << " param "
                                                  << i;
    }
  }
}

// LibTorch's C++ Adam / AdamW are not op for op torch.optim's (exp_avg by mul_ + add_ rather than lerp_): close.
TEST(AdamOptimizer, Fp32CloseToLibTorchAdamAndAdamW) {
  for (bool decoupled : {false, true}) {
    auto ours = make_params(kShapes, at::kFloat, 1);
    auto theirs = clone_params(ours, at::kFloat);
    AdamOptimizer opt(ours, AdamOptions(1e-3, {0.9, 0.999}, 1e-8, 0.01).decoupled_weight_decay(decoupled));
    std::unique_ptr<torch::optim::Optimizer> ref;
    if (decoupled)
      ref = std::make_unique<torch::optim::AdamW>(theirs, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    else
      ref = std::make_unique<torch::optim::Adam>(theirs, torch::optim::AdamOptions(1e-3).weight_decay(0.01));
    at::Generator gen = at::detail::createCPUGenerator(7);
    for (int step = 0; step < 100; ++step) {
      for (size_t i = 0; i < ours.size(); ++i) {
        at::Tensor g = at::randn(ours[i].sizes(), gen);
        ours[i].mutable_grad() = g.clone();
        theirs[i].mutable_grad() = g.clone();
      }
      opt.step();
      ref->step();
    }
    double worst = 0;
    for (size_t i = 0; i < ours.size(); ++i) worst = std::max(worst, max_rel_err(ours[i], theirs[i]));
    std::printf("fp32 (decoupled %d) vs LibTorch after 100 steps: max relative error %.3g\n", decoupled, worst);
    EXPECT_LE(worst, 4e-6);  // a few ulps of drift over 100 steps
  }
}

// BMTrain's hold_steps count: fp32 parameters hold their first h updates, half-precision ones h - 1.
TEST(AdamOptimizer, HoldStepsCountIsBmtrains) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t h : {1, 2, 4}) {
      auto p = make_params({{33}}, dt, 21);
      AdamOptimizer opt(p, AdamOptions(0.1).hold_steps(h));
      int64_t held = 0;
      for (int step = 0; step < h + 2; ++step) {
        at::Tensor before = p[0].detach().clone();
        p[0].mutable_grad() = at::randn({33}).to(dt);
        opt.step();
        if (at::equal(p[0], before)) {
          EXPECT_EQ(held, step) << "a held update after an applied one";
          ++held;
        }
      }
      EXPECT_EQ(held, dt == at::kFloat ? h : h - 1) << c10::toString(dt) << " hold_steps " << h;
    }
  }
}

TEST(AdamOptimizer, LossScaleIsDividedOut) {
  auto a = make_params(kShapes, at::kFloat, 2);
  auto b = clone_params(a, at::kFloat);
  AdamOptimizer oa(a, AdamOptions(1e-2, {0.8, 0.99}, 1e-6, 0.1));
  AdamOptimizer ob(b, AdamOptions(1e-2, {0.8, 0.99}, 1e-6, 0.1));
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      at::Tensor g = at::randn(a[i].sizes());
      a[i].mutable_grad() = g * 1024;  // exact: power of two
      b[i].mutable_grad() = g.clone();
    }
    oa.step(1024.0);
    ob.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << i;
}

// Half-precision parameters with fp32 main gradients: the fp32 master follows exactly the trajectory of an fp32
// run, and the parameter is its round-to-nearest-even copy. Documented tolerance against torch AdamW in fp32:
// master 1e-6 relative; parameter within half an ulp of its dtype (2^-8 relative for bf16, 2^-11 for fp16).
TEST(AdamOptimizer, HalfParamsWithFp32MainGradFollowFp32Reference) {
  for (at::ScalarType dt : {at::kBFloat16, at::kHalf}) {
    auto half = make_params(kShapes, dt, 3);
    auto ref32 = clone_params(half, at::kFloat);
    auto torch32 = clone_params(half, at::kFloat);
    AdamOptimizer opt(half, AdamOptions(1e-3, {0.9, 0.999}, 1e-8, 0.05));
    FusedAdamRef ref(ref32, 1e-3, 0.9, 0.999, 1e-8, 0.05);
    torch::optim::AdamW tref(torch32, torch::optim::AdamWOptions(1e-3).weight_decay(0.05));
    for (int step = 0; step < 50; ++step) {
      for (size_t i = 0; i < half.size(); ++i) {
        at::Tensor g = at::randn(half[i].sizes());
        bmt::set_main_grad(half[i], g.clone());
        ref32[i].mutable_grad() = g.clone();
        torch32[i].mutable_grad() = g.clone();
      }
      opt.step();
      ref.step();
      tref.step();
    }
    double half_ulp = dt == at::kBFloat16 ? 1.0 / 256 : 1.0 / 2048;  // unit roundoff 2^-8 / 2^-11
    for (size_t i = 0; i < half.size(); ++i) {
      const auto* s = opt.find_state(half[i]);
      ASSERT_NE(s, nullptr);
      EXPECT_TRUE(at::equal(s->master, ref32[i])) << i;
      EXPECT_TRUE(at::equal(half[i], ref32[i].to(dt))) << i;
      EXPECT_LE(max_rel_err(s->master, torch32[i]), 1e-6);
      EXPECT_LE(max_rel_err(half[i].to(at::kFloat), torch32[i], 1e-3), half_ulp * 1.01);
      bmt::forget_param(half[i]);
    }
  }
}

// Half-precision gradients (param.grad in the parameter's dtype): equal to an fp32 run on the same (quantised)
// gradients.
TEST(AdamOptimizer, HalfGradsMatchFp32RunOnQuantisedGrads) {
  for (at::ScalarType dt : {at::kBFloat16, at::kHalf}) {
    auto half = make_params(kShapes, dt, 4);
    auto ref32 = clone_params(half, at::kFloat);
    AdamOptimizer opt(half, AdamOptions(2e-3, {0.9, 0.95}, 1e-8, 0.1));
    FusedAdamRef ref(ref32, 2e-3, 0.9, 0.95, 1e-8, 0.1);
    for (int step = 0; step < 20; ++step) {
      for (size_t i = 0; i < half.size(); ++i) {
        at::Tensor g = at::randn(half[i].sizes()).to(dt);
        half[i].mutable_grad() = g;
        ref32[i].mutable_grad() = g.to(at::kFloat);
      }
      opt.step(2.0);
      ref.step(2.0);
    }
    for (size_t i = 0; i < half.size(); ++i) {
      EXPECT_TRUE(at::equal(opt.find_state(half[i])->master, ref32[i])) << i;
      EXPECT_TRUE(at::equal(half[i], ref32[i].to(dt))) << i;
    }
  }
}

TEST(AdamOptimizer, ParamGroupsUseTheirOwnOptions) {
  auto a = make_params({{10}, {33}}, at::kFloat, 5);
  auto b = clone_params(a, at::kFloat);
  std::vector<bmt::optim::ParamGroupSpec> specs = {{{a[0]}, {{"lr", 1e-2}, {"weight_decay", 0.5}}},
                                                   {{a[1]}, {{"beta1", 0.5}, {"eps", 1e-3}}}};
  AdamOptimizer grouped(specs, AdamOptions(1e-3));
  AdamOptimizer first({b[0]}, AdamOptions(1e-2, {0.9, 0.999}, 1e-8, 0.5));
  AdamOptimizer second({b[1]}, AdamOptions(1e-3, {0.5, 0.999}, 1e-3, 0.0));
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < 2; ++i) {
      at::Tensor g = at::randn(a[i].sizes());
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    grouped.step();
    first.step();
    second.step();
  }
  EXPECT_TRUE(at::equal(a[0], b[0]));
  EXPECT_TRUE(at::equal(a[1], b[1]));
  EXPECT_EQ(grouped.group_options(0).lr(), 1e-2);
  EXPECT_EQ(grouped.param_groups()[1].options().get_lr(), 1e-3);
}

TEST(AdamOptimizer, SkipsParamsWithoutGradOrRequiresGrad) {
  auto p = make_params({{5}, {6}, {7}}, at::kFloat, 6);
  p[2].requires_grad_(false);
  auto before = clone_params(p, at::kFloat);
  AdamOptimizer opt(p, AdamOptions(0.1));
  p[0].mutable_grad() = at::ones({5});
  p[2].mutable_grad() = at::ones({7});  // ignored: does not require grad
  opt.step();
  EXPECT_FALSE(at::equal(p[0], before[0]));
  EXPECT_TRUE(at::equal(p[1], before[1]));
  EXPECT_TRUE(at::equal(p[2], before[2]));
  EXPECT_NE(opt.find_state(p[0]), nullptr);
  EXPECT_EQ(opt.find_state(p[1]), nullptr);
  EXPECT_EQ(opt.find_state(p[0])->step, 1);
}

TEST(AdamOptimizer, ZeroGradKeepsBuffersAndZerosMainGrads) {
  auto p = make_params({{4}, {4}}, at::kBFloat16, 8);
  AdamOptimizer opt(p);
  p[0].mutable_grad() = at::ones({4}, at::kBFloat16);
  at::Tensor main = at::ones({4});
  bmt::set_main_grad(p[1], main);
  opt.zero_grad();
  ASSERT_TRUE(p[0].grad().defined());
  EXPECT_EQ(p[0].grad().abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(main.abs().sum().item<float>(), 0.0f);
  opt.zero_grad(/*set_to_none=*/true);
  EXPECT_FALSE(p[0].grad().defined());
  bmt::forget_param(p[1]);
}

TEST(AdamOptimizer, BadArgumentsAreErrors) {
  auto p = make_params({{3}}, at::kFloat, 9);
  using E = bmt::core::Error;
  EXPECT_THROW(AdamOptimizer(p, AdamOptions(-1e-3)), E);
  EXPECT_THROW(AdamOptimizer(p, AdamOptions(1e-3, {1.0, 0.999})), E);
  EXPECT_THROW(AdamOptimizer(p, AdamOptions(1e-3, {0.9, 1.0})), E);
  EXPECT_THROW(AdamOptimizer(p, AdamOptions(1e-3, {-0.1, 0.999})), E);
  EXPECT_THROW(AdamOptimizer(p, AdamOptions(1e-3, {0.9, 0.999}, 0.0)), E);
  EXPECT_THROW(AdamOptimizer(p, AdamOptions(1e-3, {0.9, 0.999}, -1e-8)), E);
  EXPECT_THROW(AdamOptimizer(p, AdamOptions(1e-3, {0.9, 0.999}, 1e-8, -0.1)), E);
  std::vector<bmt::optim::ParamGroupSpec> bad = {{p, {{"momentum", 0.9}}}};
  EXPECT_THROW(AdamOptimizer(bad, AdamOptions()), E);
  std::vector<torch::optim::OptimizerParamGroup> foreign;
  foreign.emplace_back(p, std::make_unique<torch::optim::AdamWOptions>(1e-3));
  EXPECT_THROW(AdamOptimizer(foreign, AdamOptions()), E);
  EXPECT_THROW(AdamOptimizer({at::zeros({3}, at::kInt)}), E);
  EXPECT_THROW(AdamOptimizer({p[0], p[0]}), E);
  AdamOptimizer ok(p);
  p[0].mutable_grad() = at::ones({4});
  EXPECT_THROW(ok.step(), E);  // gradient of the wrong size
  p[0].mutable_grad() = at::ones({3});
  EXPECT_THROW(ok.step(0.0), E);
  EXPECT_THROW(ok.step(std::nan("")), E);
}

TEST(AdamOptimizer, StateDictRoundTrip) {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    auto a = make_params(kShapes, dt, 10);
    AdamOptimizer oa(a, AdamOptions(1e-2, {0.9, 0.99}, 1e-8, 0.1));
    auto grads = [&](int seed) {
      at::Generator gen = at::detail::createCPUGenerator(seed);
      std::vector<at::Tensor> gs;
      for (auto& p : a) gs.push_back(at::randn(p.sizes(), gen).to(dt));
      return gs;
    };
    for (int s = 0; s < 3; ++s) {
      auto gs = grads(s);
      for (size_t i = 0; i < a.size(); ++i) a[i].mutable_grad() = gs[i];
      oa.step();
    }
    auto b = clone_params(a, dt);
    AdamOptimizer ob(b, AdamOptions(0.5));
    std::string path = ::testing::TempDir() + "/bmt_adam_sd.pt";
    bmt::optim::save_state_dict(oa.state_dict(), path);
    ob.load_state_dict(bmt::optim::load_state_dict_file(path));
    EXPECT_EQ(ob.group_options(0).lr(), 1e-2);
    // torch::save / torch::load of the optimizer object go through the same state dict.
    auto c = clone_params(a, dt);
    AdamOptimizer oc(c);
    torch::save(oa, path);
    torch::load(oc, path);
    std::remove(path.c_str());
    for (int s = 3; s < 6; ++s) {
      auto gs = grads(s);
      for (size_t i = 0; i < a.size(); ++i) {
        a[i].mutable_grad() = gs[i];
        b[i].mutable_grad() = gs[i].clone();
        c[i].mutable_grad() = gs[i].clone();
      }
      oa.step();
      ob.step();
      oc.step();
    }
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::equal(a[i], b[i])) << i;
      EXPECT_TRUE(at::equal(a[i], c[i])) << i;
      EXPECT_EQ(ob.find_state(b[i])->step, 6);
    }
  }
}

TEST(AdamOptimizer, LoadingAnotherModelsStateIsAnError) {
  auto a = make_params({{4, 5}, {3}}, at::kFloat, 11);
  AdamOptimizer oa(a);
  for (auto& p : a) p.mutable_grad() = at::ones_like(p);
  oa.step();
  auto sd = oa.state_dict();
  AdamOptimizer fewer(make_params({{4, 5}}, at::kFloat, 12));
  EXPECT_THROW(fewer.load_state_dict(sd), bmt::core::Error);
  AdamOptimizer reshaped(make_params({{5, 4}, {3}}, at::kFloat, 13));
  EXPECT_THROW(reshaped.load_state_dict(sd), bmt::core::Error);
  AdamOptimizer same(make_params({{4, 5}, {3}}, at::kFloat, 14));
  sd.erase("state.1.exp_avg");
  EXPECT_THROW(same.load_state_dict(sd), bmt::core::Error);
}

// decoupled_weight_decay by param group (ParamGroupSpec), and kept with hold_steps across load_state_dict (the
// state dict does not carry them).
TEST(AdamOptimizer, DecoupledOptionByGroupAndKeptOnLoad) {
  auto a = make_params({{10}, {33}}, at::kFloat, 31);
  auto b = clone_params(a, at::kFloat);
  std::vector<bmt::optim::ParamGroupSpec> specs = {{{a[0]}, {{"decoupled_weight_decay", 1}}}, {{a[1]}, {}}};
  AdamOptimizer grouped(specs, AdamOptions(1e-2, {0.9, 0.999}, 1e-8, 0.5).hold_steps(1));
  AdamOptimizer first({b[0]}, AdamOptions(1e-2, {0.9, 0.999}, 1e-8, 0.5).hold_steps(1).decoupled_weight_decay(true));
  AdamOptimizer second({b[1]}, AdamOptions(1e-2, {0.9, 0.999}, 1e-8, 0.5).hold_steps(1));
  EXPECT_TRUE(grouped.group_options(0).decoupled_weight_decay());
  EXPECT_FALSE(grouped.group_options(1).decoupled_weight_decay());
  for (int step = 0; step < 4; ++step) {
    if (step == 2) grouped.load_state_dict(grouped.state_dict());
    for (size_t i = 0; i < 2; ++i) {
      at::Tensor g = at::randn(a[i].sizes());
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    grouped.step();
    first.step();
    second.step();
  }
  EXPECT_TRUE(at::equal(a[0], b[0]));
  EXPECT_TRUE(at::equal(a[1], b[1]));
  EXPECT_TRUE(grouped.group_options(0).decoupled_weight_decay());
  EXPECT_EQ(grouped.group_options(0).hold_steps(), 1);
  std::vector<bmt::optim::ParamGroupSpec> bad = {{{b[0]}, {{"decoupled_weight_decay", 0.5}}}};
  EXPECT_THROW(AdamOptimizer(bad, AdamOptions()), bmt::core::Error);
}
