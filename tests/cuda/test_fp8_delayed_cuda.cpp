// Delayed FP8 scaling on the GPU (tests/nn/test_fp8_delayed.cpp has the CPU side): the FP8 byte transpose, the
// delayed cast (scale given, amax folded) and the record kernel against their CPU twins bit for bit; cuBLASLt's FP8-output GEMM (GELU_AUX_BIAS and BIAS writing
// E4M3 with a scale, folding the amax) against the twin within one FP8 rounding plus the accumulation's bound, the
// amax to the accumulation's bound; nn::fp8_gelu_mlp with BMT_FP8_DELAYED_GELU's path against the dynamic cast
// within FP8 rounding, and its state moving on the device.
#include <gtest/gtest.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/core/kernels/fp8_delayed_scale_internal.h"
#include "bmt/core/kernels/gemm_epilogue_internal.h"
#include "bmt/nn/fp8_delayed_scale_internal.h"
#include "bmt/nn/fp8_linear_internal.h"
#include "bmt/nn/fp8_mlp.h"
#include "bmt/runtime/tensor_adapter_internal.h"
#include "fp8_cuda_device.h"

namespace k = bmt::core::kernels;
using bmt::nn::Fp8DelayedScale;
using bmt::nn::Fp8Format;

namespace {

using fp8_cuda_test::fp8_gemm_device;
using fp8_cuda_test::stream;

at::Tensor bytes(const at::Tensor& q) { return q.contiguous().view(at::kByte); }

double rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.cpu().to(at::kDouble), y = b.cpu().to(at::kDouble);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-30);
}

}  // namespace

TEST(Fp8TransposeCuda, MatchesTheCpuTwinBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // word tiles (multiples of 4, full and partial 64 x 64 tiles), the element-wise kernel (odd shapes), a GPT shape
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {48, 80}, {100, 36}, {7, 13}, {1, 3},
                                  {16384, 512}}) {
    const at::Tensor q = at::randint(0, 256, {rows, cols}, at::kByte);
    at::Tensor want = at::empty({cols, rows}, at::kByte), got = at::empty({cols, rows}, at::kByte).cuda();
    k::fp8_transpose_cpu(q.data_ptr<uint8_t>(), rows, cols, want.data_ptr<uint8_t>());
    const at::Tensor qg = q.cuda();
    k::fp8_transpose_cuda(qg.data_ptr<uint8_t>(), rows, cols, got.data_ptr<uint8_t>(), stream());
    EXPECT_TRUE(at::equal(got.cpu(), want)) << rows << "x" << cols;
  }
}

TEST(Fp8CastDelayedCuda, MatchesTheCpuTwinBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // the 8-wide transposing tiles (multiples of 8, full and partial tiles), the element-wise tiles (odd shapes), the
  // row-major-only cast (vector and scalar), a GPT activation; each with an amax slot below and above the tensor's
  // and NaN, a tensor holding a NaN, and a scale that saturates part of it
  int cases = 0;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {72, 136}, {100, 36}, {7, 13}, {1, 3},
                                  {16384, 256}}) {
    for (const at::ScalarType dt : {at::kBFloat16, at::kFloat}) {
      for (const int layout : {0, 1, 2}) {  // both copies, row-major only, transposed only
        for (const float start : {0.0f, 1e6f, nan}) {
          for (const bool with_nan : {false, true}) {
            at::Tensor x = (at::randn({rows, cols}) * 3.0).to(dt);
            if (with_nan) x.view(-1)[x.numel() / 2] = nan;
            const float scale = 448.0f / 6.0f;  // (|x| above 6 saturates)
            const Fp8Format f = layout == 1 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
            const bool want_q = layout != 2, want_qt = layout != 1;
            at::Tensor q = at::zeros({rows, cols}, at::kByte), qt = at::zeros({cols, rows}, at::kByte);
            at::Tensor amax = at::full({}, start), sc = at::full({}, scale);
            k::fp8_cast_delayed_cpu(x.data_ptr(), bmt::to_core_dtype(dt), rows, cols, sc.data_ptr<float>(),
                                    amax.data_ptr<float>(), bmt::nn::core_format(f),
                                    want_q ? q.data_ptr<uint8_t>() : nullptr, want_qt ? qt.data_ptr<uint8_t>() : nullptr);
            const at::Tensor xg = x.cuda(), sg = sc.cuda();
            at::Tensor qg = at::zeros_like(q).cuda(), qtg = at::zeros_like(qt).cuda(), ag = at::full({}, start).cuda();
            k::fp8_cast_delayed_cuda(xg.data_ptr(), bmt::to_core_dtype(dt), rows, cols, sg.data_ptr<float>(),
                                     ag.data_ptr<float>(), bmt::nn::core_format(f),
                                     want_q ? qg.data_ptr<uint8_t>() : nullptr,
                                     want_qt ? qtg.data_ptr<uint8_t>() : nullptr, stream());
            const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " layout " +
                                     std::to_string(layout) + " start " + std::to_string(start) +
                                     (with_nan ? " with NaN" : "");
            EXPECT_TRUE(at::equal(qg.cpu(), q)) << what;
            EXPECT_TRUE(at::equal(qtg.cpu(), qt)) << what;
            const float a = ag.item<float>(), b = amax.item<float>();
            EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << what << ": amax " << a << " vs " << b;
            // the closed form: the fold is max(start, max |x|), a NaN on either side winning
            const float xmax = x.abs().max().item<float>();
            const bool nan_wins = with_nan || std::isnan(start);
            if (nan_wins) EXPECT_TRUE(std::isnan(b)) << what;
            else EXPECT_EQ(b, std::max(start, xmax)) << what;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 6 * 2 * 3 * 3 * 2);
}

TEST(Fp8DelayedRecordCuda, MatchesTheCpuTwinBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t len = 5;
  at::Tensor cpu = at::zeros({len + 3}), gpu = cpu.cuda();  // history, scale, inv, amax
  cpu[len] = 1.0f, cpu[len + 1] = 1.0f;
  gpu.copy_(cpu);
  auto state = [&](at::Tensor& t) {
    k::Fp8DelayedState s;
    float* p = t.data_ptr<float>();
    s.history = p, s.len = len, s.scale = p + len, s.inv = p + len + 1, s.amax = p + len + 2;
    return s;
  };
  int i = 0;
  for (const float amax : {3.5f, 0.0f, 1e-30f, 200.0f, inf, 7.0f, nan, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f}) {
    cpu[len + 2] = amax;
    gpu[len + 2].fill_(amax);
    at::Tensor ci = at::empty({}), gi = at::empty({}).cuda();
    k::fp8_delayed_record_cpu(state(cpu), ci.data_ptr<float>());
    k::fp8_delayed_record_cuda(state(gpu), gi.data_ptr<float>(), stream());
    const at::Tensor g = gpu.cpu();
    EXPECT_TRUE(at::equal(g, cpu)) << "record " << i << " (amax " << amax << "): " << g << " vs " << cpu;
    const float a = gi.item<float>(), b = ci.item<float>();
    EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << "record " << i << ": call inverse scale " << a;
    ++i;
  }
}

TEST(Fp8GemmEpilogueCuda, Fp8OutputMatchesTheCpuTwin) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(51);
  struct Shape { int64_t rows, inner, cols; };
  for (const Shape s : {Shape{64, 128, 256}, Shape{256, 256, 1024}}) {
    const std::string what = std::to_string(s.rows) + "x" + std::to_string(s.inner) + "x" + std::to_string(s.cols);
    const bmt::nn::Fp8Tensor aq = bmt::nn::fp8_cast(at::randn({s.rows, s.inner}), Fp8Format::kE4M3, true, false);
    const bmt::nn::Fp8Tensor wq =
        bmt::nn::fp8_cast(at::randn({s.cols, s.inner}) * 0.05, Fp8Format::kE4M3, true, false);
    const at::Tensor bias = (at::randn({s.cols}) * 0.1).to(at::kBFloat16);
    const at::Tensor abs_product = (aq.data.to(at::kDouble).abs() * aq.inv.item<double>())
                                       .mm((wq.data.to(at::kDouble).abs() * wq.inv.item<double>()).t());
    for (const k::GemmEpilogue e : {k::GemmEpilogue::kGeluAuxBias, k::GemmEpilogue::kBias}) {
      const bool gelu = e == k::GemmEpilogue::kGeluAuxBias;
      for (const bool fast : {true, false}) {
        const std::string tag = what + " " + k::gemm_epilogue_name(e) + (fast ? " fast" : "");
        // the twin (CPU) and cuBLASLt, each from a state whose scale is 448 / 3 (a delayed amax of 3)
        Fp8DelayedScale sc(2), sg(2);
        sc.record_amax(at::full({}, 3.0f));
        sg.record_amax(at::full({}, 3.0f).cuda());
        at::Tensor want = at::empty({s.rows, s.cols}, at::kFloat8_e4m3fn), got = want.cuda();
        at::Tensor aux_c = gelu ? at::empty({s.rows, s.cols}, at::kBFloat16) : at::Tensor();
        at::Tensor aux_g = gelu ? aux_c.cuda() : at::Tensor();
        ASSERT_TRUE(bmt::nn::fp8_gemm_epilogue_to_fp8(e, aq.data, Fp8Format::kE4M3, aq.inv, wq.data, Fp8Format::kE4M3,
                                                      wq.inv, fast, want, sc, bias, aux_c));
        const bool ran = bmt::nn::fp8_gemm_epilogue_to_fp8(
            e, aq.data.cuda(), Fp8Format::kE4M3, aq.inv.cuda(), wq.data.cuda(), Fp8Format::kE4M3, wq.inv.cuda(), fast,
            got, sg, bias.cuda(), aux_g);
        ASSERT_TRUE(ran) << tag << ": cuBLASLt has no algorithm for an FP8 output (BMT_FP8_DELAYED_GELU cannot help)";
        // values: one E4M3 rounding apart (2^-3 relative at most for normals; the smallest subnormal step 2^-9 / scale
        // absolute), plus the accumulations' difference, bounded per element by sum_k |a||b|: fast accumulation
        // ~2^-14 per addition; without it cuBLASLt splits K at small shapes and rounds the partial sums to bf16 (the H100
        // of session 25: 4e-4 at outputs near zero at 256x256x1024, several FP8 steps there), two roundings of 2^-9
        const float scale = 448.0f / 3.0f;
        const at::Tensor g = got.cpu().to(at::kDouble) / scale, w = want.to(at::kDouble) / scale;
        const at::Tensor err = (g - w).abs();
        const at::Tensor acc_bound =
            abs_product * (fast ? static_cast<double>(s.inner) * std::ldexp(1.0, -14) : std::ldexp(1.0, -8));
        const at::Tensor allowed = at::maximum(g.abs(), w.abs()) * 0.125 + std::ldexp(1.0, -9) / scale + acc_bound;
        const at::Tensor bad = (err > allowed).nonzero();
        EXPECT_EQ(bad.size(0), 0) << tag << ": max error " << err.max().item<double>() << " at magnitude "
                                  << w.abs().max().item<double>();
        for (int64_t i = 0; i < std::min<int64_t>(bad.size(0), 6); ++i) {  // (what a failure looks like)
          const int64_t r = bad[i][0].item<int64_t>(), c = bad[i][1].item<int64_t>();
          std::printf("[diag] %s (%lld, %lld): gpu %.6g (byte %d), twin %.6g (byte %d)\n", tag.c_str(),
                      static_cast<long long>(r), static_cast<long long>(c), g[r][c].item<double>() * scale,
                      bytes(got).cpu()[r][c].item<int>(), w[r][c].item<double>() * scale, bytes(want)[r][c].item<int>());
        }
        // (most bytes are the same: a flip needs a value within the accumulation error of a rounding boundary)
        const double same = bytes(got).cpu().eq(bytes(want)).to(at::kDouble).mean().item<double>();
        EXPECT_GT(same, 0.9) << tag << ": share of identical bytes";
        const float amax_c = sc.amax().item<float>(), amax_g = sg.amax().item<float>();
        const double amax_slack = fast ? static_cast<double>(s.inner) * std::ldexp(1.0, -14) * 3.0 : 1e-3;
        EXPECT_NEAR(amax_g, amax_c, amax_c * 1e-2 + amax_slack) << tag << ": the amax of the unscaled output";
        if (gelu) {
          EXPECT_LT(rel(aux_g, aux_c), 1e-2) << tag << ": the pre-activation";
        }
        // the record on each side moves the scale to the amax just folded in
        sc.record(), sg.record();
        EXPECT_NEAR(sg.scale().item<float>(), sc.scale().item<float>(), sc.scale().item<float>() * 1e-2) << tag;
      }
    }
  }
}

// nn::fp8_gelu_mlp on the GPU with a delayed GELU scale (BMT_FP8_DELAYED_GELU=1) against the dynamic cast: the first
// call is the dynamic path (nothing recorded), later calls write h in E4M3 from c_fc's GEMM; within FP8 rounding.
TEST(Fp8GeluMlpCuda, DelayedGeluMatchesTheDynamicCast) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(52);
  auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16).cuda(); };
  const int64_t rows = 2048, d = 768;
  const std::vector<at::Tensor> inputs = {bf(at::randn({rows, d})), bf(at::randn({4 * d, d}) * 0.04),
                                          bf(at::randn({4 * d}) * 0.1), bf(at::randn({d, 4 * d}) * 0.02),
                                          bf(at::randn({d}) * 0.1), bf(at::randn({rows, d}))};
  const at::Tensor g = bf(at::randn({rows, d}));
  const bool before = bmt::nn::fp8_delayed_gelu_enabled();
  bmt::nn::set_fp8_delayed_gelu_enabled(true);
  auto run = [&](Fp8DelayedScale* scale) {
    std::vector<at::Tensor> p;
    for (const at::Tensor& t : inputs) p.push_back(t.clone().requires_grad_());
    const at::Tensor y = bmt::nn::fp8_gelu_mlp(p[0], p[1], p[2], p[3], p[4], p[5], Fp8Format::kE5M2, true, scale);
    y.backward(g);
    std::vector<at::Tensor> r = {y.detach()};
    for (const at::Tensor& t : p) r.push_back(t.grad());
    return r;
  };
  const auto dynamic = run(nullptr);
  Fp8DelayedScale s(16);
  const auto first = run(&s);
  ASSERT_TRUE(s.ready());
  EXPECT_TRUE(s.history().is_cuda());
  // (the same path twice: equal up to any reduction whose order a GPU does not fix)
  for (size_t i = 0; i < dynamic.size(); ++i) EXPECT_LT(rel(first[i], dynamic[i]), 1e-6) << "first call, " << i;
  const float amax1 = s.history()[0].item<float>();
  for (int call = 0; call < 3; ++call) {
    const auto delayed = run(&s);
    const char* names[] = {"y", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj", "dresidual"};
    for (size_t i = 0; i < dynamic.size(); ++i)
      EXPECT_LT(rel(delayed[i], dynamic[i]), i == 0 ? 1e-2 : 5e-2) << "call " << call << ": " << names[i];
    EXPECT_NEAR(s.history()[0].item<float>(), amax1, amax1 * 1e-2) << "the GEMM's amax of h, call " << call;
  }
  bmt::nn::set_fp8_delayed_gelu_enabled(before);
}
