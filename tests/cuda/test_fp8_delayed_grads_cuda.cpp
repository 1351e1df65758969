// The fused delayed gradient cast on the GPU (tests/nn/test_fp8_delayed_grads.cpp has the CPU side): against the CUDA
// ops it replaces (column_sum_cuda or dgelu_column_sum_cuda, then fp8_cast_delayed_cuda) bit for bit in the bytes
// and the folded amax and to fp32 rounding in the sums, and against the CPU twin; the FP8 MLP (its fused CUDA path,
// which also runs fp8_linear's dy cast for c_proj) with BMT_FP8_DELAYED_GRADS against the dynamic path.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/core/kernels/fp8_cast_grad_internal.h"
#include "bmt/nn/fp8_delayed_scale.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_mlp.h"
#include "bmt/runtime/tensor_adapter_internal.h"
#include "fp8_cuda_device.h"

namespace k = bmt::core::kernels;
using bmt::nn::Fp8Format;
using fp8_cuda_test::fp8_gemm_device;
using fp8_cuda_test::stream;

namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.cpu().to(at::kDouble), y = b.cpu().to(at::kDouble);
  return (x - y).norm().item<double>() / std::max(y.norm().item<double>(), 1e-30);
}

struct DelayedGradsOn {
  DelayedGradsOn() { bmt::nn::set_fp8_delayed_grads_enabled(true); }
  ~DelayedGradsOn() { bmt::nn::set_fp8_delayed_grads_enabled(false); }
};

}  // namespace

TEST(Fp8CastGradDelayedCuda, MatchesTheSeparateCudaOpsAndTheTwin) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  int cases = 0;
  // full and partial 64 x 64 tiles, one tile row, a GPT MLP gradient
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {72, 136}, {8, 200}, {16384, 1024}}) {
    for (const at::ScalarType dt : {at::kBFloat16, at::kFloat}) {
      for (const bool dgelu : {false, true}) {
        for (const int layout : {0, 1, 2}) {  // both copies, row-major only, transposed only
          for (const bool with_nan : {false, true}) {
            const auto opts = at::TensorOptions().dtype(dt).device(at::kCUDA);
            at::Tensor dy = at::randn({rows, cols}, opts) * 0.01, pre = at::randn({rows, cols}, opts) * 2.0;
            if (with_nan) dy.view(-1)[dy.numel() / 3] = nan;
            const bool want_q = layout != 2, want_qt = layout != 1;
            const auto bytes = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
            // the fused kernel
            at::Tensor q = at::zeros({rows, cols}, bytes), qt = at::zeros({cols, rows}, bytes);
            at::Tensor sums = at::zeros({cols}, opts.dtype(at::kFloat)), amax = at::zeros({}, opts.dtype(at::kFloat));
            const at::Tensor scale = at::full({}, 57344.0f / 0.03f, opts.dtype(at::kFloat));  // part saturates
            at::Tensor ws = at::empty({k::fp8_cast_grad_workspace_numel(rows, cols)}, opts.dtype(at::kFloat));
            const void* pre_ptr = dgelu ? pre.data_ptr() : nullptr;
            const bmt::core::DType cdt = bmt::to_core_dtype(dt);
            ASSERT_TRUE(k::fp8_cast_grad_cuda_applies(rows, cols, dy.data_ptr(), pre_ptr, q.data_ptr<uint8_t>(),
                                                      qt.data_ptr<uint8_t>()));
            k::fp8_cast_grad_delayed_cuda(dy.data_ptr(), pre_ptr, cdt, rows, cols, scale.data_ptr<float>(),
                                          amax.data_ptr<float>(), k::Fp8Format::kE5M2,
                                          want_q ? q.data_ptr<uint8_t>() : nullptr,
                                          want_qt ? qt.data_ptr<uint8_t>() : nullptr, sums.data_ptr(),
                                          bmt::core::DType::kFloat32, ws.data_ptr<float>(), stream());
            // the separate CUDA ops: g (d pre written in dtype), its sums, then the delayed cast
            at::Tensor g = dy, ref_sums = at::zeros_like(sums), ref_amax = at::zeros_like(amax);
            at::Tensor ref_q = at::zeros_like(q), ref_qt = at::zeros_like(qt);
            at::Tensor ws2 = at::empty({k::column_reduce_workspace_numel(rows, cols, cdt)}, opts.dtype(at::kFloat));
            if (dgelu) {
              g = at::empty_like(dy);
              k::dgelu_column_sum_cuda(dy.data_ptr(), pre.data_ptr(), cdt, rows, cols, g.data_ptr(),
                                       ref_sums.data_ptr(), bmt::core::DType::kFloat32, ws2.data_ptr<float>(),
                                       stream());
            } else {
              k::column_sum_cuda(dy.data_ptr(), cdt, rows, cols, ref_sums.data_ptr(), bmt::core::DType::kFloat32,
                                 ws2.data_ptr<float>(), stream());
            }
            k::fp8_cast_delayed_cuda(g.data_ptr(), cdt, rows, cols, scale.data_ptr<float>(), ref_amax.data_ptr<float>(),
                                     k::Fp8Format::kE5M2, want_q ? ref_q.data_ptr<uint8_t>() : nullptr,
                                     want_qt ? ref_qt.data_ptr<uint8_t>() : nullptr, stream());
            const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + " " +
                                     c10::toString(dt) + (dgelu ? " dgelu" : "") + " layout " +
                                     std::to_string(layout) + (with_nan ? " NaN" : "");
            EXPECT_TRUE(at::equal(q, ref_q)) << what;
            EXPECT_TRUE(at::equal(qt, ref_qt)) << what;
            const float a = amax.item<float>(), b = ref_amax.item<float>();
            EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << what << ": amax " << a << " vs " << b;
            if (!with_nan) {
              EXPECT_LT(rel(sums, ref_sums), 1e-5) << what;
              // the twin. Its GELU gradient is fp64, the kernel's fp32, whose 1 + t cancels where gelu' is near 0
              // (pre ~ -0.75 and the tails, pre < -4): up to ~5e-7 absolute error in gelu' (torch's fp32 formula on
              // a CPU, 65536 x 256 values), which this scale (2e6) magnifies past one E5M2 step in ~1% of the bytes
              // (0.8% on an H100). Bound per byte: one E5M2 step (a quarter of the value) plus that error with 8x
              // margin, scale * |dy| * 4e-6. The bit-exact reference is the separate CUDA ops above.
              const at::Tensor dc = dy.cpu(), pc = pre.cpu();
              at::Tensor tq = at::zeros({rows, cols}, at::kByte), ts = at::zeros({cols}), ta = at::zeros({});
              const at::Tensor sc = scale.cpu();
              k::fp8_cast_grad_delayed_cpu(dc.data_ptr(), dgelu ? pc.data_ptr() : nullptr, cdt, rows, cols,
                                           sc.data_ptr<float>(), ta.data_ptr<float>(), k::Fp8Format::kE5M2,
                                           tq.data_ptr<uint8_t>(), nullptr, ts.data_ptr(),
                                           bmt::core::DType::kFloat32);
              if (want_q) {
                const at::Tensor got = q.cpu(), same = got.eq(tq);
                EXPECT_GE(same.to(at::kDouble).mean().item<double>(), dgelu ? 0.97 : 1.0) << what;
                // every other byte one E5M2 step away (in scaled units: a quarter of the value, or 2^-16 near 0)
                const at::Tensor a = got.view(at::kFloat8_e5m2).to(at::kDouble);
                const at::Tensor b = tq.view(at::kFloat8_e5m2).to(at::kDouble);
                const at::Tensor gelu_error = dgelu ? dc.to(at::kDouble).abs() * (sc.item<double>() * 4e-6)
                                                    : at::zeros_like(a);
                EXPECT_TRUE(((a - b).abs() <= at::maximum(a.abs(), b.abs()) * 0.25 + gelu_error + std::ldexp(1.0, -16))
                                .all()
                                .item<bool>())
                    << what;
              }
              EXPECT_LT(rel(sums, ts), 1e-5) << what;
              EXPECT_LT(std::fabs(a - ta.item<float>()), 1e-2 * ta.item<float>()) << what;
            } else {
              EXPECT_TRUE(std::isnan(a)) << what;
            }
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 2 * 2 * 3 * 2);
}

TEST(Fp8CastGradDelayedCuda, PiecesEqualTheirConcatenation) {
  // the pieces read in place: bytes, amax and sums bit for bit those of the concatenated gradient (the same values at
  // the same tile positions), at GPT's c_attn shape and with pieces narrower than a tile
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const auto f32 = bf16.dtype(at::kFloat), bytes = bf16.dtype(at::kByte);
  for (const auto& [rows, piece, parts] : {std::tuple<int64_t, int64_t, int>{16384, 2048, 3}, {72, 40, 3}, {64, 96, 2}}) {
    std::vector<at::Tensor> ps;
    const void* ptrs[3] = {};
    for (int i = 0; i < parts; ++i) ps.push_back(at::randn({rows, piece}, bf16) * 0.01), ptrs[i] = ps.back().data_ptr();
    const at::Tensor whole = at::cat(ps, 1);
    const int64_t cols = piece * parts;
    const at::Tensor scale = at::full({}, 57344.0f / 0.05f, f32);
    at::Tensor q1 = at::zeros({rows, cols}, bytes), qt1 = at::zeros({cols, rows}, bytes), s1 = at::zeros({cols}, f32);
    at::Tensor q2 = at::zeros_like(q1), qt2 = at::zeros_like(qt1), s2 = at::zeros_like(s1);
    at::Tensor a1 = at::zeros({}, f32), a2 = at::zeros({}, f32);
    at::Tensor ws = at::empty({k::fp8_cast_grad_workspace_numel(rows, cols)}, f32), ws2 = at::empty_like(ws);
    const std::string what = std::to_string(rows) + "x" + std::to_string(piece) + "x" + std::to_string(parts);
    ASSERT_TRUE(k::fp8_cast_grad_parts_cuda_applies(rows, cols, ptrs, parts, q1.data_ptr<uint8_t>(),
                                                    qt1.data_ptr<uint8_t>())) << what;
    k::fp8_cast_grad_parts_delayed_cuda(ptrs, parts, bmt::core::DType::kBFloat16, rows, cols, scale.data_ptr<float>(),
                                        a1.data_ptr<float>(), k::Fp8Format::kE5M2, q1.data_ptr<uint8_t>(),
                                        qt1.data_ptr<uint8_t>(), s1.data_ptr(), bmt::core::DType::kFloat32,
                                        ws.data_ptr<float>(), stream());
    k::fp8_cast_grad_delayed_cuda(whole.data_ptr(), nullptr, bmt::core::DType::kBFloat16, rows, cols,
                                  scale.data_ptr<float>(), a2.data_ptr<float>(), k::Fp8Format::kE5M2,
                                  q2.data_ptr<uint8_t>(), qt2.data_ptr<uint8_t>(), s2.data_ptr(),
                                  bmt::core::DType::kFloat32, ws2.data_ptr<float>(), stream());
    EXPECT_TRUE(at::equal(q1, q2) && at::equal(qt1, qt2)) << what;
    EXPECT_TRUE(at::equal(s1, s2) && at::equal(a1, a2)) << what;
    EXPECT_GT(a1.item<float>(), 0.0f) << what;
  }
}

TEST(Fp8DelayedGradsCuda, LinearAndMlpMatchTheDynamicPath) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(81);
  const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const int64_t rows = 512, in = 256, hidden = 1024;
  const at::Tensor x = at::randn({rows, in}, opts), w1 = at::randn({hidden, in}, opts) * 0.05;
  const at::Tensor b1 = at::randn({hidden}, opts) * 0.1, w2 = at::randn({in, hidden}, opts) * 0.03;
  const at::Tensor b2 = at::randn({in}, opts) * 0.1, gy = at::randn({rows, in}, opts) * 1e-3;
  // the MLP (fused CUDA path): dynamic, then delayed twice with the same gradient, then with a smaller one
  auto run = [&](bmt::nn::Fp8LinearScales* fc, bmt::nn::Fp8LinearScales* proj, double factor) {
    at::Tensor xi = x.clone().requires_grad_(), w1i = w1.clone().requires_grad_(), b1i = b1.clone().requires_grad_();
    at::Tensor w2i = w2.clone().requires_grad_(), b2i = b2.clone().requires_grad_();
    const at::Tensor y =
        bmt::nn::fp8_gelu_mlp(xi, w1i, b1i, w2i, b2i, at::Tensor(), Fp8Format::kE5M2, true, nullptr, fc, proj);
    y.backward(gy * factor);
    return std::vector<at::Tensor>{xi.grad(), w1i.grad(), b1i.grad(), w2i.grad(), b2i.grad()};
  };
  const auto dyn = run(nullptr, nullptr, 1.0), dyn_small = run(nullptr, nullptr, 0.3);
  DelayedGradsOn on;
  bmt::nn::Fp8LinearScales fc, proj;
  for (int call = 0; call < 2; ++call) {
    const auto r = run(&fc, &proj, 1.0);
    for (size_t i = 0; i < r.size(); ++i) EXPECT_LT(rel(r[i], dyn[i]), 1e-2) << "call " << call << " grad " << i;
  }
  EXPECT_TRUE(fc.grad.ready() && proj.grad.ready());
  const auto small = run(&fc, &proj, 0.3);
  for (size_t i = 0; i < small.size(); ++i) EXPECT_LT(rel(small[i], dyn_small[i]), 0.1) << "grad " << i;
  EXPECT_FALSE(at::equal(small[0], dyn_small[0])) << "dx from the delayed scales";
  EXPECT_GT(proj.grad.history()[0].item<float>(), 0.0f);
}
