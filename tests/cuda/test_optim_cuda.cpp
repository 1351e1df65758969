// Optimizers on CUDA parameters: AdamOptimizer (fused CUDA kernel for half parameters, torch's foreach Adam for
// fp32 ones) and AdamOffloadOptimizer (pinned staging, CPU update, copy stream) must give bit-identical
// parameters to AdamOptimizer on CPU copies (fp32 on the GPU: torch's foreach sequence bit for bit, within float
// rounding of the CPU's); the global inf/NaN check must see CUDA gradients.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <limits>

#include "bmt/core/error.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/adam_offload.h"
#include "bmt/optim/grad_utils.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/pending_update.h"
#include "opt_test_util.h"

using bmt::optim::AdamOffloadOptimizer;
using bmt::optim::AdamOptimizer;
using bmt::optim::AdamOptions;
using namespace bmt::optim::testing;

namespace {

std::vector<at::Tensor> to_cuda(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().to(at::kCUDA).requires_grad_(true));
  return out;
}

}  // namespace

TEST(CudaOptim, AdamAndOffloadOnGpuMatchCpuBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    auto cpu = make_params(kShapes, dt, 51);
    auto gpu = to_cuda(cpu);
    auto off = to_cuda(cpu);
    AdamOptions opts(1e-3, {0.9, 0.999}, 1e-8, 0.01);
    AdamOptimizer ref(cpu, opts), on_gpu(gpu, opts);
    AdamOffloadOptimizer offload(off, opts);
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < cpu.size(); ++i) {
        at::Tensor g = at::randn(cpu[i].sizes());
        bool main32 = (step + static_cast<int>(i)) % 2 == 0 && dt != at::kFloat;
        if (main32) {  // an fp32 main gradient for some half parameters
          bmt::set_main_grad(cpu[i], g.clone());
          bmt::set_main_grad(gpu[i], g.to(at::kCUDA));
          bmt::set_main_grad(off[i], g.to(at::kCUDA));
        } else {
          for (auto* v : {&cpu, &gpu, &off}) bmt::forget_param((*v)[i]);
          cpu[i].mutable_grad() = g.to(dt);
          gpu[i].mutable_grad() = g.to(dt).to(at::kCUDA);
          off[i].mutable_grad() = g.to(dt).to(at::kCUDA);
        }
      }
      ref.step(2.0);
      on_gpu.step(2.0);
      offload.step_params(std::vector<size_t>{4, 5}, 2.0);  // early start of the largest
      offload.step(2.0);
    }
    torch::cuda::synchronize();
    for (size_t i = 0; i < cpu.size(); ++i) {
      // fp32: torch's CUDA foreach ops against its CPU single-tensor ones (e.g. CUDA's lerp contracts to an FMA).
      if (dt == at::kFloat) EXPECT_LE(max_rel_err(gpu[i].cpu(), cpu[i]), 1e-6) << "AdamOptimizer param " << i;
      else EXPECT_TRUE(at::equal(cpu[i], gpu[i].cpu())) << c10::toString(dt) << " AdamOptimizer param " << i;
      EXPECT_TRUE(at::equal(cpu[i], off[i].cpu())) << c10::toString(dt) << " AdamOffloadOptimizer param " << i;
      for (auto* v : {&cpu, &gpu, &off}) bmt::forget_param((*v)[i]);
    }
  }
}

// fp32 parameters on the GPU: torch.optim.Adam's default there (its foreach path, torch/optim/adam.py
// _multi_tensor_adam) transcribed op by op, L2 and decoupled weight decay, loss scale, hold_steps: bit for bit.
// (tests/python/test_adam_torch.py with BMT_TEST_DEVICE=cuda compares with torch itself.)
TEST(CudaOptim, Fp32OnGpuEqualsTorchForeachAdamBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const double lr = 1e-2, b1 = 0.8, b2 = 0.99, eps = 1e-6, wd = 0.05;
  for (bool decoupled : {false, true}) {
    auto ours = to_cuda(make_params(kShapes, at::kFloat, 57));
    std::vector<at::Tensor> p, m, v;
    for (const auto& t : ours) {
      p.push_back(t.detach().clone());
      m.push_back(at::zeros_like(p.back()));
      v.push_back(at::zeros_like(p.back()));
    }
    AdamOptimizer opt(ours, AdamOptions(lr, {b1, b2}, eps, wd).hold_steps(2).decoupled_weight_decay(decoupled));
    for (int step = 1; step <= 20; ++step) {
      std::vector<at::Tensor> g;
      for (size_t i = 0; i < ours.size(); ++i) {
        g.push_back(at::randn(ours[i].sizes()).to(at::kCUDA));
        ours[i].mutable_grad() = g.back() * 4;  // loss scale 4: exact
      }
      opt.step(4.0);
      const double lr_now = step <= 2 ? 0.0 : lr;
      if (decoupled) at::_foreach_mul_(p, 1 - lr_now * wd);
      else g = at::_foreach_add(g, p, wd);
      at::_foreach_lerp_(m, g, 1 - b1);
      at::_foreach_mul_(v, b2);
      at::_foreach_addcmul_(v, g, g, 1 - b2);
      std::vector<at::Scalar> step_size, bc2_sqrt;
      for (size_t i = 0; i < p.size(); ++i) {
        step_size.push_back(-(lr_now / (1 - std::pow(b1, static_cast<double>(step)))));
        bc2_sqrt.push_back(std::pow(1 - std::pow(b2, static_cast<double>(step)), 0.5));
      }
      auto denom = at::_foreach_sqrt(v);
      at::_foreach_div_(denom, bc2_sqrt);
      at::_foreach_add_(denom, eps);
      at::_foreach_addcdiv_(p, m, denom, step_size);
      for (size_t i = 0; i < p.size(); ++i)
        ASSERT_TRUE(at::equal(ours[i], p[i])) << "decoupled " << decoupled << " step " << step << " param " << i;
    }
  }
}

// set_grad_transfer_dtype(kBFloat16): fp32 main gradients are rounded to bf16 on the GPU before the copy, so the
// result equals the CPU optimizer fed the same gradients rounded to bf16 (bit for bit: the same CPU kernel).
TEST(CudaOptim, OffloadBf16GradTransferEqualsRoundedGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto cpu = make_params(kShapes, at::kBFloat16, 52);
  auto off = to_cuda(cpu);
  AdamOptions opts(1e-3, {0.9, 0.95}, 1e-8, 0.1);
  AdamOptimizer ref(cpu, opts);
  AdamOffloadOptimizer offload(off, opts);
  offload.set_grad_transfer_dtype(at::kBFloat16);
  EXPECT_THROW(offload.set_grad_transfer_dtype(at::kInt), bmt::core::Error);
  bool differs_from_fp32 = false;
  for (int step = 0; step < 4; ++step) {
    for (size_t i = 0; i < cpu.size(); ++i) {
      at::Tensor g = at::randn(cpu[i].sizes());
      differs_from_fp32 = differs_from_fp32 || !at::equal(g, g.to(at::kBFloat16).to(at::kFloat));
      bmt::set_main_grad(cpu[i], g.to(at::kBFloat16).to(at::kFloat));
      bmt::set_main_grad(off[i], g.to(at::kCUDA));
    }
    ref.step();
    offload.step_params(std::vector<size_t>{0, 3});
    offload.step();
  }
  torch::cuda::synchronize();
  EXPECT_TRUE(differs_from_fp32);
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(at::equal(cpu[i], off[i].cpu())) << "param " << i;
    bmt::forget_param(cpu[i]);
    bmt::forget_param(off[i]);
  }
}

TEST(CudaOptim, AsyncOffloadOnGpuMatchesCpuBitwise) {
  // Plain parameters are outside any Block: the asynchronous step applies them before step() returns, and the
  // current stream is ordered after their copies back (no synchronize before reading them).
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    auto cpu = make_params(kShapes, dt, 53);
    auto off = to_cuda(cpu);
    AdamOptions opts(1e-3, {0.9, 0.999}, 1e-8, 0.01);
    AdamOptimizer ref(cpu, opts);
    AdamOffloadOptimizer offload(off, opts);
    offload.set_async_step(true);
    for (int step = 0; step < 4; ++step) {
      for (size_t i = 0; i < cpu.size(); ++i) {
        at::Tensor g = at::randn(cpu[i].sizes());
        cpu[i].mutable_grad() = g.to(dt);
        off[i].mutable_grad() = g.to(dt).to(at::kCUDA);
      }
      ref.step(2.0);
      offload.step_params(std::vector<size_t>{5}, 2.0);
      offload.step(2.0);
      EXPECT_EQ(bmt::num_pending_updates(), 0u);
      for (size_t i = 0; i < cpu.size(); ++i)
        EXPECT_TRUE(at::equal(cpu[i], off[i].cpu())) << c10::toString(dt) << " step " << step << " param " << i;
      ref.zero_grad();
      offload.zero_grad();
    }
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (cpu[i].numel() > 0) {
        EXPECT_TRUE(at::equal(ref.find_state(cpu[i])->exp_avg, offload.find_state(off[i])->exp_avg)) << i;
      }
      for (auto* v : {&cpu, &off}) bmt::forget_param((*v)[i]);
    }
  }
}

TEST(CudaOptim, InfNanCheckSeesCudaGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto ps = to_cuda(make_params({{1000}, {0}, {33}}, at::kBFloat16, 52));
  for (auto& p : ps) p.mutable_grad() = at::zeros_like(p);
  EXPECT_FALSE(bmt::optim::grads_have_inf_nan(ps, nullptr));
  ps[2].mutable_grad()[32] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(bmt::optim::grads_have_inf_nan(ps, nullptr));
  ps[2].mutable_grad().zero_();
  ps[0].mutable_grad()[999] = -std::numeric_limits<float>::infinity();
  EXPECT_TRUE(bmt::optim::grads_have_inf_nan(ps, nullptr));
  EXPECT_NEAR(bmt::optim::global_grad_norm({ps[2]}, 2.0, nullptr), 0.0, 0.0);
}
