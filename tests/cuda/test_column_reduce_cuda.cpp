// The CUDA column reductions against their CPU twins (fp64 sums), and nn::linear / nn::layer_norm's fused
// gradients on the GPU against at::linear / at::layer_norm's: every input dtype, fp32 and bf16 outputs, vector
// and scalar paths (misaligned base, a column count that is not a multiple of the vector width), one row, many
// slabs. Determinism: two runs give the same bits.
#include <gtest/gtest.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace k = bmt::core::kernels;

namespace {

void* stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// fp32 sums of up to 16384 terms against an fp64 reference: within 1e-5 of the sum of the terms' magnitudes.
void expect_close_to_sum(const at::Tensor& got, const at::Tensor& want, const at::Tensor& abs_sum, const std::string& what) {
  const at::Tensor err = (got.cpu().to(at::kDouble) - want.to(at::kDouble)).abs();
  const at::Tensor allowed = abs_sum.to(at::kDouble) * 1e-5 + 1e-6;
  EXPECT_TRUE((err <= allowed).all().item<bool>()) << what << ": max error " << err.max().item<double>();
}

}  // namespace

TEST(ColumnReduceCuda, ColumnSumMatchesCpuTwin) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(11);
  struct Shape { int64_t rows, cols, offset; };
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const Shape s : {Shape{1, 1, 0}, Shape{1, 768, 0}, Shape{7, 13, 0}, Shape{1000, 768, 0}, Shape{1000, 768, 1},
                          Shape{16384, 2304, 0}, Shape{3001, 3075, 0}, Shape{20000, 8, 0}}) {
      const std::string what = std::string(c10::toString(st)) + " " + std::to_string(s.rows) + "x" +
                               std::to_string(s.cols) + " offset " + std::to_string(s.offset);
      at::Tensor flat = (at::randn({s.rows * s.cols + s.offset}) * 2).to(st);
      at::Tensor m = flat.narrow(0, s.offset, s.rows * s.cols).view({s.rows, s.cols});
      at::Tensor m_gpu_flat = flat.cuda();
      const void* src = static_cast<const char*>(m_gpu_flat.data_ptr()) + s.offset * flat.element_size();
      at::Tensor want = at::empty({s.cols}, at::kFloat);
      k::column_sum_cpu(m.contiguous().data_ptr(), bmt::to_core_dtype(st), s.rows, s.cols, want.data_ptr(),
                        bmt::core::DType::kFloat32);
      const at::Tensor abs_sum = m.to(at::kDouble).abs().sum(0);
      at::Tensor ws = at::empty({k::column_reduce_workspace_numel(s.rows, s.cols, bmt::to_core_dtype(st))},
                                at::TensorOptions().device(at::kCUDA).dtype(at::kFloat));
      at::Tensor got = at::empty({s.cols}, ws.options());
      k::column_sum_cuda(src, bmt::to_core_dtype(st), s.rows, s.cols, got.data_ptr(), bmt::core::DType::kFloat32,
                         ws.data_ptr<float>(), stream());
      expect_close_to_sum(got, want, abs_sum, what);
      at::Tensor again = at::empty_like(got);
      k::column_sum_cuda(src, bmt::to_core_dtype(st), s.rows, s.cols, again.data_ptr(), bmt::core::DType::kFloat32,
                         ws.data_ptr<float>(), stream());
      EXPECT_TRUE(at::equal(got, again)) << what << ": not deterministic";
      // bf16 output: the fp32 sum rounded once.
      at::Tensor got_bf16 = at::empty({s.cols}, ws.options().dtype(at::kBFloat16));
      k::column_sum_cuda(src, bmt::to_core_dtype(st), s.rows, s.cols, got_bf16.data_ptr(), bmt::core::DType::kBFloat16,
                         ws.data_ptr<float>(), stream());
      EXPECT_TRUE(at::equal(got_bf16, got.to(at::kBFloat16))) << what;
    }
  }
}

TEST(ColumnReduceCuda, LayerNormParamGradsMatchCpuTwin) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(12);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 768}, {9, 20}, {16384, 768}, {4097, 2048}}) {
      const std::string what = std::string(c10::toString(st)) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      at::Tensor x = (at::randn({rows, cols}) * 2 + 1).to(st), dy = at::randn({rows, cols}).to(st);
      at::Tensor xf = x.to(at::kFloat);
      at::Tensor mean = xf.mean(1), rstd = at::rsqrt(xf.var(1, false) + 1e-5);
      at::Tensor want_g = at::empty({cols}), want_b = at::empty({cols});
      k::layer_norm_param_grads_cpu(dy.data_ptr(), x.data_ptr(), bmt::to_core_dtype(st), mean.data_ptr<float>(),
                                    rstd.data_ptr<float>(), rows, cols, want_g.data_ptr(), want_b.data_ptr(),
                                    bmt::core::DType::kFloat32);
      const at::Tensor xhat = (xf - mean.unsqueeze(1)) * rstd.unsqueeze(1);
      const at::Tensor abs_g = (dy.to(at::kDouble) * xhat.to(at::kDouble)).abs().sum(0), abs_b = dy.to(at::kDouble).abs().sum(0);
      at::Tensor xg = x.cuda(), dyg = dy.cuda(), mg = mean.cuda(), rg = rstd.cuda();
      at::Tensor ws = at::empty({2 * k::column_reduce_workspace_numel(rows, cols, bmt::to_core_dtype(st))},
                                xg.options().dtype(at::kFloat));
      at::Tensor got_g = at::empty({cols}, ws.options()), got_b = at::empty({cols}, ws.options());
      k::layer_norm_param_grads_cuda(dyg.data_ptr(), xg.data_ptr(), bmt::to_core_dtype(st), mg.data_ptr<float>(),
                                     rg.data_ptr<float>(), rows, cols, got_g.data_ptr(), got_b.data_ptr(),
                                     bmt::core::DType::kFloat32, ws.data_ptr<float>(), stream());
      expect_close_to_sum(got_g, want_g, abs_g, what + " dgamma");
      expect_close_to_sum(got_b, want_b, abs_b, what + " dbeta");
    }
  }
}

// The fused GELU gradient + column sum against its CPU twin: each d pre within one ulp of the twin's (fp32 tanhf
// against fp64 tanh may round the other way; for a very negative pre, gelu' cancels in fp32), the sums those of the kernel's own stored values (fp32 sums, the
// column_sum bound), its amax partials the FP8 scale statistics of what it stored, bit for bit; deterministic.
// Vector and scalar paths (misaligned base, a column count not a multiple of the vector width), many slabs.
TEST(ColumnReduceCuda, DGeluColumnSumMatchesCpuTwin) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(14);
  struct Shape { int64_t rows, cols, offset; };
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const Shape s : {Shape{1, 1, 0}, Shape{7, 13, 0}, Shape{1000, 768, 0}, Shape{1000, 768, 1},
                          Shape{16384, 3072, 0}, Shape{3001, 3075, 0}}) {
      const std::string what = std::string(c10::toString(st)) + " " + std::to_string(s.rows) + "x" +
                               std::to_string(s.cols) + " offset " + std::to_string(s.offset);
      const bmt::core::DType dt = bmt::to_core_dtype(st);
      const int64_t n = s.rows * s.cols;
      const at::Tensor dy_flat = at::randn({n + s.offset}).to(st), pre_flat = (at::randn({n + s.offset}) * 3).to(st);
      const at::Tensor dy = dy_flat.narrow(0, s.offset, n).view({s.rows, s.cols}).contiguous();
      const at::Tensor pre = pre_flat.narrow(0, s.offset, n).view({s.rows, s.cols}).contiguous();
      at::Tensor want = at::empty({s.rows, s.cols}, st), want_sums = at::empty({s.cols}, at::kFloat);
      k::dgelu_column_sum_cpu(dy.data_ptr(), pre.data_ptr(), dt, s.rows, s.cols, want.data_ptr(), want_sums.data_ptr(),
                              bmt::core::DType::kFloat32);
      const at::Tensor dyg = dy_flat.cuda(), preg = pre_flat.cuda();
      const at::Tensor dgrad_flat = at::empty({n + s.offset}, dyg.options());
      const auto at_offset = [&](const at::Tensor& t) {
        return static_cast<char*>(t.data_ptr()) + s.offset * t.element_size();
      };
      const auto f32 = dyg.options().dtype(at::kFloat);
      at::Tensor ws = at::empty({k::column_reduce_workspace_numel(s.rows, s.cols, dt)}, f32);
      at::Tensor partials = at::empty({k::column_sum_amax_partials(s.rows, s.cols, dt)}, f32.dtype(at::kInt));
      at::Tensor sums = at::empty({s.cols}, f32), again = at::empty_like(sums);
      k::dgelu_column_sum_cuda(at_offset(dyg), at_offset(preg), dt, s.rows, s.cols, at_offset(dgrad_flat),
                               sums.data_ptr(), bmt::core::DType::kFloat32, ws.data_ptr<float>(), stream(),
                               static_cast<uint32_t*>(partials.data_ptr()));
      const at::Tensor got = dgrad_flat.narrow(0, s.offset, n).view({s.rows, s.cols}).cpu();
      const double ulp = st == at::kFloat ? 1e-5 : st == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;  // relative
      const double tiny = st == at::kHalf ? 6e-8 : 1e-30;
      // (+ |dy| 4e-6: gelu' of a very negative pre cancels in fp32, an absolute error of a few fp32 ulps of 1)
      const at::Tensor err = (got.to(at::kDouble) - want.to(at::kDouble)).abs();
      const at::Tensor tol = want.to(at::kDouble).abs() * ulp + dy.to(at::kDouble).abs() * 4e-6 + tiny;
      EXPECT_TRUE((err <= tol).all().item<bool>())
          << what << ": max d pre error " << err.max().item<double>();
      const at::Tensor own = got.to(at::kDouble);
      expect_close_to_sum(sums, own.sum(0), own.abs().sum(0), what + " (sums)");
      float stats_want[3];
      k::fp8_scale_cpu(got.data_ptr(), dt, n, k::Fp8Format::kE4M3, stats_want);
      at::Tensor stats = at::empty({3}, f32);
      k::fp8_scale_from_partials_cuda(static_cast<const uint32_t*>(partials.data_ptr()), partials.numel(),
                                      k::Fp8Format::kE4M3, stats.data_ptr<float>(), stream());
      EXPECT_EQ(stats.cpu()[0].item<float>(), stats_want[0]) << what << ": amax";
      k::dgelu_column_sum_cuda(at_offset(dyg), at_offset(preg), dt, s.rows, s.cols, at_offset(dgrad_flat),
                               again.data_ptr(), bmt::core::DType::kFloat32, ws.data_ptr<float>(), stream());
      EXPECT_TRUE(at::equal(sums, again)) << what << ": not deterministic";
    }
  }
}

TEST(ColumnReduceCuda, FusedLinearAndLayerNormGradientsMatchTorch) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(bmt::nn::fused_reductions_enabled()) << "BMT_FUSED_REDUCTIONS=0 in the environment";
  at::manual_seed(13);
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  at::Tensor x0 = at::randn({4, 512, 768}, opts), w0 = at::randn({2304, 768}, opts) * 0.02, b0 = at::randn({2304}, opts);
  at::Tensor dy = at::randn({4, 512, 2304}, opts);
  at::Tensor x1 = leaf(x0), w1 = leaf(w0), b1 = leaf(b0), x2 = leaf(x0), w2 = leaf(w0), b2 = leaf(b0);
  at::Tensor y1 = bmt::nn::linear(x1, w1, b1);
  ASSERT_NE(y1.grad_fn()->name().find("LinearReducedBiasGradFn"), std::string::npos) << y1.grad_fn()->name();
  at::Tensor y2 = at::linear(x2, w2, b2);
  EXPECT_TRUE(at::equal(y1, y2));
  y1.backward(dy);
  y2.backward(dy);
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.to(at::kFloat) - b.to(at::kFloat)).abs().max() / b.to(at::kFloat).abs().max()).item<double>();
  };
  EXPECT_LT(rel(x1.grad(), x2.grad()), 1e-2);  // bf16 GEMM outputs, maybe other kernels: a few ulps
  EXPECT_LT(rel(w1.grad(), w2.grad()), 1e-2);
  EXPECT_LT(rel(b1.grad(), b2.grad()), 1e-2);

  at::Tensor h0 = at::randn({4, 512, 768}, opts) * 3, g0 = at::randn({768}, opts), be0 = at::randn({768}, opts);
  at::Tensor dz = at::randn({4, 512, 768}, opts);
  at::Tensor h1 = leaf(h0), g1 = leaf(g0), be1 = leaf(be0), h2 = leaf(h0), g2 = leaf(g0), be2 = leaf(be0);
  at::Tensor z1 = bmt::nn::layer_norm(h1, 768, g1, be1, 1e-5);
  ASSERT_NE(z1.grad_fn()->name().find("LayerNormReducedParamGradsFn"), std::string::npos) << z1.grad_fn()->name();
  at::Tensor z2 = at::layer_norm(h2, {768}, g2, be2, 1e-5);
  EXPECT_TRUE(at::equal(z1, z2));
  z1.backward(dz);
  z2.backward(dz);
  EXPECT_TRUE(at::equal(h1.grad(), h2.grad()));  // torch's input-gradient kernel in both
  EXPECT_LT(rel(g1.grad(), g2.grad()), 1e-2);
  EXPECT_LT(rel(be1.grad(), be2.grad()), 1e-2);
}
