// The CUDA FP8 scale and cast against their CPU twin, bit for bit (statistics and bytes; every input dtype, both
// formats, with and without the transposed copy, vector and scalar paths, odd shapes, a misaligned base, zero and
// inf/NaN tensors), and nn::fp8_linear on the GPU (cuBLASLt's FP8 GEMMs through at::_scaled_mm) against the fp64
// reference within the FP8 bound (tests/nn/fp8_reference.h). Needs compute capability 8.9+ for the GEMMs.
// (Shapes whose rows and columns are multiples of 8 take the 8-wide transposing cast, the others the 32 x 32 one.)
// The same for the rowwise cast (per-row and per-column scales) and the rowwise FP8 linear; the FP8 epilogue GEMMs
// against their CPU twin and nn::fp8_gelu_mlp's fused path against its separate path and the twin.
#include <gtest/gtest.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <cmath>
#include <limits>

#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/core/kernels/fp8_cast_internal.h"
#include "bmt/nn/fp8_linear_internal.h"
#include "bmt/nn/fp8_linear.h"
#include "bmt/nn/fp8_mlp.h"
#include "bmt/nn/fused_linear.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/runtime/tensor_adapter_internal.h"
#include "fp8_reference.h"
#include "fp8_cuda_device.h"

namespace k = bmt::core::kernels;

namespace {

using fp8_cuda_test::fp8_gemm_device;
using fp8_cuda_test::stream;

// The device statistics {amax, scale, inv_scale} and the inverse scale's own copy against the CPU twin's (a NaN
// equals a NaN).
void expect_stats(const at::Tensor& stats, const at::Tensor& inv_copy, const float (&want)[3], const std::string& what) {
  const at::Tensor got = stats.cpu();
  for (int i = 0; i < 3; ++i) {
    const float g = got[i].item<float>(), w = want[i];
    EXPECT_TRUE(g == w || (std::isnan(g) && std::isnan(w))) << what << ": stat " << i << " " << g << " vs " << w;
  }
  const float inv = inv_copy.item<float>(), want_inv = want[k::kFp8InvScale];
  EXPECT_TRUE(inv == want_inv || (std::isnan(inv) && std::isnan(want_inv))) << what << ": inverse scale copy " << inv;
}

// Runs both variants on x (a CPU tensor viewed from `offset` elements into its storage) and compares.
void compare(const at::Tensor& flat, int64_t offset, int64_t rows, int64_t cols, k::Fp8Format f, bool rowwise,
             bool transposed, const std::string& what) {
  const at::Tensor x = flat.narrow(0, offset, rows * cols).contiguous();
  const bmt::core::DType dt = bmt::to_core_dtype(flat.scalar_type());
  float want_stats[3];
  at::Tensor want_q = at::zeros({rows * cols}, at::kByte), want_qt = at::zeros({rows * cols}, at::kByte);
  k::fp8_scale_cpu(x.data_ptr(), dt, rows * cols, f, want_stats);
  k::fp8_cast_cpu(x.data_ptr(), dt, rows, cols, want_stats, f, rowwise ? want_q.data_ptr<uint8_t>() : nullptr,
                  transposed ? want_qt.data_ptr<uint8_t>() : nullptr);

  const at::Tensor gpu_flat = flat.cuda();
  const void* src = static_cast<const char*>(gpu_flat.data_ptr()) + offset * flat.element_size();
  const auto opts = at::TensorOptions().device(at::kCUDA);
  at::Tensor stats = at::empty({3}, opts.dtype(at::kFloat));
  at::Tensor ws = at::empty({k::fp8_scale_workspace_numel(rows * cols)}, opts.dtype(at::kInt));
  at::Tensor q = at::zeros({rows * cols}, opts.dtype(at::kByte)), qt = at::zeros_like(q);
  at::Tensor inv_copy = at::full({}, -1.0f, opts.dtype(at::kFloat));
  k::fp8_scale_cuda(src, dt, rows * cols, f, stats.data_ptr<float>(), static_cast<uint32_t*>(ws.data_ptr()),
                    stream(), inv_copy.data_ptr<float>());
  k::fp8_cast_cuda(src, dt, rows, cols, stats.data_ptr<float>(), f, rowwise ? q.data_ptr<uint8_t>() : nullptr,
                   transposed ? qt.data_ptr<uint8_t>() : nullptr, stream());
  expect_stats(stats, inv_copy, want_stats, what);
  if (std::isnan(want_stats[k::kFp8Scale])) {  // NaN scales: every byte a NaN (the sign may differ)
    if (rowwise) {
      EXPECT_TRUE((q.cpu().bitwise_and(0x7f) == 0x7f).all().item<bool>()) << what;
    }
    return;
  }
  EXPECT_TRUE(at::equal(q.cpu(), want_q)) << what << ": row-major bytes differ";
  EXPECT_TRUE(at::equal(qt.cpu(), want_qt)) << what << ": transposed bytes differ";
}

}  // namespace

TEST(Fp8CastCuda, MatchesCpuTwinBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(21);
  struct Shape { int64_t rows, cols, offset; };
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const Shape s : {Shape{1, 1, 0}, Shape{7, 13, 0}, Shape{33, 65, 0}, Shape{256, 1024, 0},
                          Shape{256, 1024, 1}, Shape{1000, 4097, 0}, Shape{4096, 768, 0},
                          // the 8-wide transposing path: partial 64 x 64 tiles, and bases 16-byte aligned or not
                          Shape{40, 72, 0}, Shape{4096, 768, 8}, Shape{64, 64, 4}, Shape{24, 8, 0}}) {
      for (k::Fp8Format f : {k::Fp8Format::kE4M3, k::Fp8Format::kE5M2}) {
        // a wide range of magnitudes (finite in fp16), so subnormals, ties and the maximum all occur
        const at::Tensor flat = (at::randn({s.rows * s.cols + s.offset}) *
                                 at::exp(at::randn({s.rows * s.cols + s.offset}) * 1.5)).to(st);
        for (auto [rowwise, transposed] : {std::pair{true, false}, {false, true}, {true, true}}) {
          const std::string what = std::string(c10::toString(st)) + " " + k::fp8_format_name(f) + " " +
                                   std::to_string(s.rows) + "x" + std::to_string(s.cols) + " offset " +
                                   std::to_string(s.offset) + (rowwise ? " q" : "") + (transposed ? " qt" : "");
          compare(flat, s.offset, s.rows, s.cols, f, rowwise, transposed, what);
        }
      }
    }
  }
}

TEST(Fp8CastCuda, ZeroAndNonFiniteTensors) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (k::Fp8Format f : {k::Fp8Format::kE4M3, k::Fp8Format::kE5M2}) {
    compare(at::zeros({64 * 48}, at::kBFloat16), 0, 64, 48, f, true, true, "zeros");
    for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      at::Tensor t = at::randn({64 * 48});
      t[1234] = bad;
      compare(t.to(at::kBFloat16), 0, 64, 48, f, true, false, "with " + std::to_string(bad));
      compare(t, 0, 64, 48, f, true, true, "fp32 with " + std::to_string(bad));
    }
  }
}

// The amax a column sum takes on the side (column_sum_cuda's partial maxima, reduced by
// fp8_scale_from_partials_cuda) gives the scale pass's statistics bit for bit: every dtype, vector and scalar
// paths, many slabs, zeros, inf and NaN.
TEST(Fp8CastCuda, ColumnSumAmaxGivesTheScaleStatistics) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(23);
  struct Case { int64_t rows, cols; float poison; };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const Case c : {Case{1, 1, 0}, Case{7, 13, 0}, Case{1000, 4097, 0}, Case{16384, 768, 0}, Case{20000, 8, 0},
                         Case{64, 48, -1}, Case{333, 264, inf}, Case{333, 264, nan}}) {
      at::Tensor x = (at::randn({c.rows, c.cols}) * at::exp(at::randn({c.rows, c.cols}) * 1.5)).to(st);
      if (c.poison < 0) x.zero_();
      if (c.poison > 0 || std::isnan(c.poison)) x.view(-1)[x.numel() / 3] = c.poison;
      const std::string what = std::string(c10::toString(st)) + " " + std::to_string(c.rows) + "x" +
                               std::to_string(c.cols) + " poison " + std::to_string(c.poison);
      const bmt::core::DType dt = bmt::to_core_dtype(st);
      for (k::Fp8Format f : {k::Fp8Format::kE4M3, k::Fp8Format::kE5M2}) {
        float want[3];
        k::fp8_scale_cpu(x.data_ptr(), dt, x.numel(), f, want);
        const at::Tensor xg = x.cuda();
        const auto opts = xg.options();
        at::Tensor ws = at::empty({k::column_reduce_workspace_numel(c.rows, c.cols, dt)}, opts.dtype(at::kFloat));
        at::Tensor partials = at::empty({k::column_sum_amax_partials(c.rows, c.cols, dt)}, opts.dtype(at::kInt));
        at::Tensor sums = at::empty({c.cols}, opts.dtype(at::kFloat)), plain = at::empty_like(sums);
        k::column_sum_cuda(xg.data_ptr(), dt, c.rows, c.cols, sums.data_ptr(), bmt::core::DType::kFloat32,
                           ws.data_ptr<float>(), stream(), static_cast<uint32_t*>(partials.data_ptr()));
        k::column_sum_cuda(xg.data_ptr(), dt, c.rows, c.cols, plain.data_ptr(), bmt::core::DType::kFloat32,
                           ws.data_ptr<float>(), stream());
        EXPECT_TRUE(((sums == plain) | (sums.isnan() & plain.isnan())).all().item<bool>()) << what << ": sums changed";
        at::Tensor stats = at::empty({3}, opts.dtype(at::kFloat)), inv = at::full({}, -1.0f, opts.dtype(at::kFloat));
        k::fp8_scale_from_partials_cuda(static_cast<const uint32_t*>(partials.data_ptr()), partials.numel(), f,
                                        stats.data_ptr<float>(), stream(), inv.data_ptr<float>());
        expect_stats(stats, inv, want, what);
      }
    }
  }
}

// nn::fp8_cast_grad (the bias gradient's column sum taking dy's amax) against nn::column_sum + nn::fp8_cast: the
// same bytes, statistics and sums.
TEST(Fp8CastCuda, CastWithTheBiasGradientEqualsTheSeparateOps) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(24);
  for (at::ScalarType st : {at::kBFloat16, at::kFloat}) {
    const at::Tensor dy = (at::randn({4096, 768}) * 3).to(st).cuda();
    at::Tensor db;
    const bmt::nn::Fp8Tensor got = bmt::nn::fp8_cast_grad(bmt::nn::Fp8Scaling::kTensor, dy, bmt::nn::Fp8Format::kE5M2,
                                                          true, true, &db, at::kFloat);
    const bmt::nn::Fp8Tensor want = bmt::nn::fp8_cast(dy, bmt::nn::Fp8Format::kE5M2, true, true);
    EXPECT_TRUE(at::equal(db, bmt::nn::column_sum(dy, at::kFloat))) << c10::toString(st);
    EXPECT_TRUE(at::equal(got.stats, want.stats) && at::equal(got.inv, want.inv)) << c10::toString(st);
    EXPECT_TRUE(at::equal(got.data.view(at::kByte), want.data.view(at::kByte))) << c10::toString(st);
    EXPECT_TRUE(at::equal(got.data_t.view(at::kByte), want.data_t.view(at::kByte))) << c10::toString(st);
  }
}

// nn::fp8_cast_dgelu_grad (the FP8 MLP's d pre, its bias gradient and its amax in one kernel) against
// nn::dgelu_column_sum + nn::fp8_cast: the same bytes, statistics and sums; and that kernel's d pre against torch's
// gelu_backward within one bf16 ulp (plus fp32's cancellation for a very negative pre).
TEST(Fp8CastCuda, DGeluCastEqualsTheSeparateOps) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(25);
  struct FusedGuard {  // (the fused path whatever the environment says, restored however the test ends)
    const bool before = bmt::nn::fp8_dgelu_fused_enabled();
    FusedGuard() { bmt::nn::set_fp8_dgelu_fused_enabled(true); }
    ~FusedGuard() { bmt::nn::set_fp8_dgelu_fused_enabled(before); }
  } fused;
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor dmid = at::randn({4096, 3072}, opts), pre = at::randn({4096, 3072}, opts) * 3;
  at::Tensor db;
  const bmt::nn::Fp8Tensor got = bmt::nn::fp8_cast_dgelu_grad(bmt::nn::Fp8Scaling::kTensor, dmid, pre,
                                                               bmt::nn::Fp8Format::kE5M2, true, true, &db, at::kFloat);
  const auto [dpre, sums] = bmt::nn::dgelu_column_sum(dmid, pre, at::kFloat);
  const bmt::nn::Fp8Tensor want = bmt::nn::fp8_cast(dpre, bmt::nn::Fp8Format::kE5M2, true, true);
  EXPECT_TRUE(at::equal(db, sums));
  EXPECT_TRUE(at::equal(got.stats, want.stats) && at::equal(got.inv, want.inv));
  EXPECT_TRUE(at::equal(got.data.view(at::kByte), want.data.view(at::kByte)));
  EXPECT_TRUE(at::equal(got.data_t.view(at::kByte), want.data_t.view(at::kByte)));
  const at::Tensor torch_dpre = at::gelu_backward(dmid, pre, "tanh").to(at::kDouble);
  const at::Tensor err = (dpre.to(at::kDouble) - torch_dpre).abs();
  const at::Tensor tol = torch_dpre.abs() / 128 + dmid.to(at::kDouble).abs() * 4e-6 + 1e-30;
  EXPECT_TRUE((err <= tol).all().item<bool>()) << "max error against gelu_backward " << err.max().item<double>();
}

// The FP8 MLP's gradients with the fused GELU-gradient kernel and with torch's gelu_backward then the column sum:
// the same up to d pre's rare one-ulp differences (fp32 gelu' in either).
TEST(Fp8LinearCuda, MlpGradientsWithTheFusedDGeluMatchTheSeparateOps) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(30);
  const auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16).cuda(); };
  const int64_t rows = 2048, d = 768;
  const std::vector<at::Tensor> inputs = {bf(at::randn({rows, d})), bf(at::randn({4 * d, d}) * 0.04),
                                          bf(at::randn({4 * d}) * 0.1), bf(at::randn({d, 4 * d}) * 0.02),
                                          bf(at::randn({d}) * 0.1), bf(at::randn({rows, d}))};
  const at::Tensor g = bf(at::randn({rows, d}));
  const bool before = bmt::nn::fp8_dgelu_fused_enabled();
  auto run = [&](bool fused) {
    bmt::nn::set_fp8_dgelu_fused_enabled(fused);
    std::vector<at::Tensor> p;
    for (const at::Tensor& t : inputs) p.push_back(t.clone().requires_grad_());
    bmt::nn::fp8_gelu_mlp(p[0], p[1], p[2], p[3], p[4], p[5], bmt::nn::Fp8Format::kE5M2).backward(g);
    std::vector<at::Tensor> grads;
    for (const at::Tensor& t : p) grads.push_back(t.grad());
    return grads;
  };
  const auto fused = run(true), separate = run(false);
  bmt::nn::set_fp8_dgelu_fused_enabled(before);
  for (size_t i = 0; i < fused.size(); ++i) {
    const at::Tensor a = fused[i].cpu().to(at::kDouble), b = separate[i].cpu().to(at::kDouble);
    EXPECT_LT((a - b).norm().item<double>() / b.norm().item<double>(), 5e-3) << "gradient " << i;
  }
}

TEST(Fp8LinearCuda, ForwardAndGradientsWithinTheFp8Bound) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(22);
  for (auto grad : {bmt::nn::Fp8Format::kE5M2, bmt::nn::Fp8Format::kE4M3}) {
    fp8_test::check_fp8_linear(at::kCUDA, at::kBFloat16, grad, 256, 768, 512);
    fp8_test::check_fp8_linear(at::kCUDA, at::kBFloat16, grad, 64, 2048, 96);
    fp8_test::check_fp8_linear(at::kCUDA, at::kFloat, grad, 128, 256, 64);
  }
}

TEST(Fp8LinearCuda, MatchesTheCpuPathClosely) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(23);
  // Same casts (bit-identical bytes and scales), different GEMMs: the CPU path accumulates in fp32, the forward on
  // the GPU in the tensor cores' fast-accumulation mode, whose partial sums keep about 14 mantissa bits (no
  // promotion to fp32 along k; DeepSeek-V3's report measured this on Hopper). Each of the k additions then rounds at
  // most 2^-14 of the running sum, bounded by sum_k |x||w|: the bound is k * 2^-14 * max sum_k |x||w|. A wrong
  // GEMM (layout, scale) is off by the order of the sums themselves, 64x this bound at k = 256.
  const int64_t k = 256;
  const at::Tensor x = at::randn({128, k}), w = at::randn({64, k}) * 0.05, b = at::randn({64});
  const at::Tensor cpu = bmt::nn::fp8_linear(x, w, b);
  const at::Tensor gpu = bmt::nn::fp8_linear(x.cuda(), w.cuda(), b.cuda()).cpu();
  const double tol = static_cast<double>(k) * std::ldexp(1.0, -14) * (x.abs().mm(w.abs().t())).max().item<double>();
  EXPECT_LE((cpu - gpu).abs().max().item<double>(), tol);
}

TEST(Fp8CastRowwiseCuda, MatchesCpuTwinBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(24);
  struct Shape { int64_t rows, cols, offset; };
  // 8-wide and element-wise transposing paths, vector and scalar row passes, partial tiles, a misaligned base, rows
  // longer than a block's stride, more than one block row of the column maxima
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const Shape s : {Shape{1, 1, 0}, Shape{7, 13, 0}, Shape{40, 72, 0}, Shape{256, 1024, 0},
                          Shape{256, 1024, 1}, Shape{130, 4104, 0}, Shape{1000, 97, 0}}) {
      for (k::Fp8Format f : {k::Fp8Format::kE4M3, k::Fp8Format::kE5M2}) {
        const int64_t n = s.rows * s.cols + s.offset;
        at::Tensor flat = (at::randn({n}) * at::exp(at::randn({n}) * 1.5)).to(st);
        if (s.rows > 3) flat.narrow(0, s.offset + 2 * s.cols, s.cols).zero_();  // a zero row
        const at::Tensor x = flat.narrow(0, s.offset, s.rows * s.cols);
        const bmt::core::DType dt = bmt::to_core_dtype(st);
        at::Tensor want_q = at::zeros({s.rows * s.cols}, at::kByte), want_qt = at::zeros_like(want_q);
        at::Tensor want_inv = at::zeros({s.rows}), want_inv_t = at::zeros({s.cols});
        const at::Tensor xc = x.contiguous();
        k::fp8_cast_rowwise_cpu(xc.data_ptr(), dt, s.rows, s.cols, f, want_q.data_ptr<uint8_t>(),
                                want_inv.data_ptr<float>(), want_qt.data_ptr<uint8_t>(), want_inv_t.data_ptr<float>());
        const at::Tensor gflat = flat.cuda();
        const void* src = static_cast<const char*>(gflat.data_ptr()) + s.offset * flat.element_size();
        const auto opts = at::TensorOptions().device(at::kCUDA);
        at::Tensor q = at::zeros({s.rows * s.cols}, opts.dtype(at::kByte)), qt = at::zeros_like(q);
        at::Tensor inv = at::zeros({s.rows}, opts.dtype(at::kFloat)), inv_t = at::zeros({s.cols}, opts.dtype(at::kFloat));
        at::Tensor ws = at::full({s.cols}, 12345, opts.dtype(at::kInt));  // garbage: the cast must clear it
        k::fp8_cast_rowwise_cuda(src, dt, s.rows, s.cols, f, q.data_ptr<uint8_t>(), inv.data_ptr<float>(),
                                 qt.data_ptr<uint8_t>(), inv_t.data_ptr<float>(),
                                 static_cast<uint32_t*>(ws.data_ptr()), stream());
        const std::string what = std::string(c10::toString(st)) + " " + k::fp8_format_name(f) + " " +
                                 std::to_string(s.rows) + "x" + std::to_string(s.cols) + " offset " +
                                 std::to_string(s.offset);
        EXPECT_TRUE(at::equal(inv.cpu(), want_inv)) << what << ": row inverse scales differ";
        EXPECT_TRUE(at::equal(inv_t.cpu(), want_inv_t)) << what << ": column inverse scales differ";
        EXPECT_TRUE(at::equal(q.cpu(), want_q)) << what << ": row-major bytes differ";
        EXPECT_TRUE(at::equal(qt.cpu(), want_qt)) << what << ": transposed bytes differ";
      }
    }
  }
}

TEST(Fp8LinearCuda, RowwiseWithinTheFp8Bound) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(25);
  // bf16: torch's rowwise FP8 kernels; fp32: unit-scale FP8 GEMMs scaled after (the other output dtypes' path)
  fp8_test::check_fp8_linear(at::kCUDA, at::kBFloat16, bmt::nn::Fp8Format::kE4M3, 256, 768, 512,
                             bmt::nn::Fp8Scaling::kRow);
  fp8_test::check_fp8_linear(at::kCUDA, at::kBFloat16, bmt::nn::Fp8Format::kE4M3, 64, 2048, 96,
                             bmt::nn::Fp8Scaling::kRow);
  fp8_test::check_fp8_linear(at::kCUDA, at::kFloat, bmt::nn::Fp8Format::kE4M3, 128, 256, 64,
                             bmt::nn::Fp8Scaling::kRow);
}

// The FP8 epilogue GEMMs (cuBLASLt with FP8 operands and the BIAS + residual, GELU_AUX_BIAS and DGELU epilogues)
// against their CPU twin on the same FP8 bytes and scales: one bf16 rounding apart (2^-7 with slack for fp32
// accumulation order and cuBLASLt's tanh), plus a floor for sums near zero. The bias and GELU epilogues must have
// an algorithm (the fused MLP's forward relies on them); DGELU falls back by design where it has none (reported).
TEST(Fp8GemmEpilogueCuda, MatchesTheCpuTwin) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(26);
  using bmt::nn::Fp8Format;
  struct Shape { int64_t rows, inner, cols; };
  for (const Shape s : {Shape{64, 128, 256}, Shape{256, 768, 1024}, Shape{128, 1024, 256}}) {
    const std::string what = std::to_string(s.rows) + "x" + std::to_string(s.inner) + "x" + std::to_string(s.cols);
    const at::Tensor a = at::randn({s.rows, s.inner}).cuda(), w = (at::randn({s.cols, s.inner}) * 0.05).cuda();
    const bmt::nn::Fp8Tensor aq = bmt::nn::fp8_cast(a, Fp8Format::kE5M2, true, false);
    const bmt::nn::Fp8Tensor wq = bmt::nn::fp8_cast(w, Fp8Format::kE4M3, true, false);
    const at::Tensor aq_c = aq.data.cpu(), ai_c = aq.inv.cpu(), wq_c = wq.data.cpu(), wi_c = wq.inv.cpu();
    const at::Tensor bias = at::randn({s.cols}).to(at::kBFloat16), res = at::randn({s.rows, s.cols}).to(at::kBFloat16);
    const double floor = 1e-4 * std::sqrt(static_cast<double>(s.inner));
    const at::Tensor abs_product = (aq_c.to(at::kDouble).abs() * ai_c.item<double>())
                                       .mm((wq_c.to(at::kDouble).abs() * wi_c.item<double>()).t());
    auto both = [&](k::GemmEpilogue e, bool fast, const at::Tensor& b, const at::Tensor& aux_in, const at::Tensor& r,
                    at::Tensor* aux_out_gpu, at::Tensor* aux_out_cpu) {
      const bool keeps_aux = e == k::GemmEpilogue::kGeluAuxBias;
      at::Tensor want = at::empty({s.rows, s.cols}, at::kBFloat16), got = at::empty_like(want).cuda();
      at::Tensor aux_c = keeps_aux ? at::empty_like(want) : aux_in, aux_g = keeps_aux ? at::empty_like(got) : aux_in.defined() ? aux_in.cuda() : aux_in;
      EXPECT_TRUE(bmt::nn::fp8_gemm_epilogue(e, aq_c, Fp8Format::kE5M2, ai_c, wq_c, Fp8Format::kE4M3, wi_c, fast, want,
                                             b, aux_c, r));
      const bool ran = bmt::nn::fp8_gemm_epilogue(e, aq.data, Fp8Format::kE5M2, aq.inv, wq.data, Fp8Format::kE4M3,
                                                  wq.inv, fast, got, b.defined() ? b.cuda() : b, aux_g,
                                                  r.defined() ? r.cuda() : r);
      if (aux_out_gpu) *aux_out_gpu = aux_g, *aux_out_cpu = aux_c;
      if (!ran) return false;
      const at::Tensor g = got.cpu().to(at::kDouble), wd = want.to(at::kDouble);
      // fast accumulation keeps ~14 mantissa bits in its partial sums (see MatchesTheCpuPathClosely): each of the
      // `inner` additions may round 2^-14 of the running sum, bounded by sum_k |a||b| (an H100 showed 0.031 at a
      // product of 8.4 with K = 768, more than one bf16 rounding of the result)
      at::Tensor allowed = at::maximum(g.abs(), wd.abs()) * (1.0 / 128) + floor;
      if (fast) allowed = allowed + abs_product * (static_cast<double>(s.inner) * std::ldexp(1.0, -14));
      if (e == k::GemmEpilogue::kGeluAuxBias && fast) allowed = allowed * 1.2;  // GELU's slope is at most ~1.13
      const at::Tensor err = (g - wd).abs();
      EXPECT_TRUE((err <= allowed).all().item<bool>())
          << what << " " << k::gemm_epilogue_name(e) << (fast ? " fast" : "") << ": max error "
          << err.max().item<double>() << " at magnitude " << wd.abs().max().item<double>();
      return true;
    };
    EXPECT_TRUE(both(k::GemmEpilogue::kBias, false, bias, {}, res, nullptr, nullptr)) << what << ": no FP8 bias GEMM";
    EXPECT_TRUE(both(k::GemmEpilogue::kBias, true, bias, {}, {}, nullptr, nullptr)) << what;
    at::Tensor aux_g, aux_c;
    EXPECT_TRUE(both(k::GemmEpilogue::kGeluAuxBias, true, bias, {}, {}, &aux_g, &aux_c)) << what << ": no FP8 GELU";
    EXPECT_TRUE(both(k::GemmEpilogue::kGeluAuxBias, false, bias, {}, {}, &aux_g, &aux_c)) << what;
    const at::Tensor pre = aux_c;  // the twin's pre-activation, read by both DGELUs
    if (!both(k::GemmEpilogue::kDGelu, false, {}, pre, {}, nullptr, nullptr))
      std::printf("[note] %s: cuBLASLt has no FP8 DGELU algorithm; nn::fp8_gelu_mlp computes it after the GEMM\n",
                  what.c_str());
  }
}

// nn::fp8_gelu_mlp on the GPU (the fused path: epilogue GEMMs) against the same function with the epilogues off
// (the separate composition) and against the fused function on CPU (the twin), on bf16 inputs: within FP8 rounding
// of each other (GELU on the fp32 sum flips a few elements of h by one FP8 ulp, see tests/nn/test_fp8_mlp.cpp).
TEST(Fp8GeluMlpCuda, FusedMatchesTheSeparatePathAndTheCpuTwin) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(27);
  auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  // (small enough for the fp64 twin; the GEMM shapes of a GPT layer are in Fp8GemmEpilogueCuda above)
  const int64_t rows = 512, in = 256, hidden = 1024, out = 256;
  const at::Tensor x = bf(at::randn({rows, in})), w1 = bf(at::randn({hidden, in}) * 0.06), b1 = bf(at::randn({hidden}) * 0.1);
  const at::Tensor w2 = bf(at::randn({out, hidden}) * 0.02), b2 = bf(at::randn({out}) * 0.1), r = bf(at::randn({rows, out}));
  const at::Tensor g = bf(at::randn({rows, out}));
  struct Result { at::Tensor y, dx, dw1, db1, dw2, db2; };
  auto run = [&](at::Device dev, bool fused_cpu) {
    std::vector<at::Tensor> p;
    for (const at::Tensor& t : {x, w1, b1, w2, b2, r}) p.push_back(t.detach().to(dev).clone().requires_grad_());
    const at::Tensor y = fused_cpu ? bmt::nn::fp8_gelu_mlp_fused(p[0], p[1], p[2], p[3], p[4], p[5], bmt::nn::Fp8Format::kE5M2)
                                   : bmt::nn::fp8_gelu_mlp(p[0], p[1], p[2], p[3], p[4], p[5], bmt::nn::Fp8Format::kE5M2);
    y.backward(g.to(dev));
    return Result{y.detach().cpu(), p[0].grad().cpu(), p[1].grad().cpu(), p[2].grad().cpu(), p[3].grad().cpu(),
                  p[4].grad().cpu()};
  };
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
    return (x - y).norm().item<double>() / y.norm().item<double>();
  };
  const Result fused = run(at::kCUDA, false), twin = run(at::kCPU, true);
  bmt::nn::set_gemm_epilogues_enabled(false);
  const Result separate = run(at::kCUDA, false);
  bmt::nn::set_gemm_epilogues_enabled(true);
  const at::Tensor rd = r.to(at::kDouble);
  for (const auto& [other, name] : {std::pair{separate, "separate path"}, std::pair{twin, "CPU twin"}}) {
    EXPECT_LT(rel(fused.y.to(at::kDouble) - rd, other.y.to(at::kDouble) - rd), 0.03) << name;
    EXPECT_LT(rel(fused.dx, other.dx), 0.05) << name;
    EXPECT_LT(rel(fused.dw1, other.dw1), 0.05) << name;
    EXPECT_LT(rel(fused.db1, other.db1), 0.05) << name;
    EXPECT_LT(rel(fused.dw2, other.dw2), 0.05) << name;
    EXPECT_LT(rel(fused.db2, other.db2), 0.05) << name;
  }
}

// nn::fp8_linear_residual on the GPU (the residual in the FP8 GEMM's epilogue) against residual + fp8_linear (a
// second rounding after the GEMM): one bf16 rounding of the output apart; the gradients are the same computation.
TEST(Fp8LinearCuda, ResidualInTheEpilogueMatchesTheSeparateAdd) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(28);
  const auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16).cuda(); };
  const at::Tensor x0 = bf(at::randn({512, 768})), w0 = bf(at::randn({768, 768}) * 0.04), b0 = bf(at::randn({768}));
  const at::Tensor r0 = bf(at::randn({512, 768})), g = bf(at::randn({512, 768}));
  auto run = [&](bool fused) {
    at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    at::Tensor r = r0.clone().requires_grad_();
    const at::Tensor y = fused ? bmt::nn::fp8_linear_residual(x, w, b, r) : r + bmt::nn::fp8_linear(x, w, b);
    y.backward(g);
    return std::vector<at::Tensor>{y.detach().cpu(), x.grad().cpu(), w.grad().cpu(), b.grad().cpu(), r.grad().cpu()};
  };
  const auto fused = run(true), separate = run(false);
  const at::Tensor yf = fused[0].to(at::kDouble), ys = separate[0].to(at::kDouble);
  EXPECT_TRUE(((yf - ys).abs() <= ys.abs() * (1.0 / 128) + 1e-2).all().item<bool>())
      << "max difference " << (yf - ys).abs().max().item<double>();
  for (size_t i = 1; i < fused.size(); ++i) EXPECT_TRUE(at::equal(fused[i], separate[i])) << "gradient " << i;
}

// BMT_GEMM_AUTOTUNE's path (the core's cuBLASLt GEMMs with timed candidate algorithms, taking also the GEMMs that
// go to _scaled_mm otherwise: the backward's and a plain biased forward) against the default one: the same FP8 bytes
// and scales through other GEMM algorithms, so the outputs and gradients are one bf16 rounding and an fp32 summation
// order apart (relative norm ~2^-9; a wrong layout or scale would be off by ~1). Twice tuned: the tuning call and the
// cached algorithms.
TEST(Fp8LinearCuda, AutotunedGemmsMatchTheDefaultPath) {
  if (!fp8_gemm_device()) GTEST_SKIP() << "no CUDA device with FP8 tensor cores (8.9+)";
  at::manual_seed(29);
  const auto bf = [](const at::Tensor& t) { return t.to(at::kBFloat16).cuda(); };
  const int64_t rows = 1024, d = 768;
  const at::Tensor x = bf(at::randn({rows, d})), w = bf(at::randn({3 * d, d}) * 0.04), b = bf(at::randn({3 * d}));
  const at::Tensor w1 = bf(at::randn({4 * d, d}) * 0.04), b1 = bf(at::randn({4 * d}) * 0.1);
  const at::Tensor w2 = bf(at::randn({d, 4 * d}) * 0.02), b2 = bf(at::randn({d}) * 0.1), r = bf(at::randn({rows, d}));
  const at::Tensor g = bf(at::randn({rows, 3 * d})), gm = bf(at::randn({rows, d}));
  // (restores the switch however the run ends, so a throw inside cannot leave it on for later tests)
  struct AutotuneGuard {
    const bool before = bmt::nn::gemm_autotune_enabled();
    explicit AutotuneGuard(bool on) { bmt::nn::set_gemm_autotune_enabled(on); }
    ~AutotuneGuard() { bmt::nn::set_gemm_autotune_enabled(before); }
  };
  auto run = [&](bool tune) {
    const AutotuneGuard guard(tune);
    std::vector<at::Tensor> p;
    for (const at::Tensor& t : {x, w, b, x, w1, b1, w2, b2, r}) p.push_back(t.clone().requires_grad_());
    const at::Tensor y = bmt::nn::fp8_linear(p[0], p[1], p[2]);
    y.backward(g);
    const at::Tensor ym = bmt::nn::fp8_gelu_mlp(p[3], p[4], p[5], p[6], p[7], p[8], bmt::nn::Fp8Format::kE5M2);
    ym.backward(gm);
    std::vector<at::Tensor> out = {y.detach(), ym.detach()};
    for (const at::Tensor& t : p) out.push_back(t.grad());
    return out;
  };
  const auto plain = run(false), tuned = run(true), cached = run(true);
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor x = a.cpu().to(at::kDouble), y = b.cpu().to(at::kDouble);
    return (x - y).norm().item<double>() / y.norm().item<double>();
  };
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_LT(rel(tuned[i], plain[i]), 1e-2) << "output/gradient " << i << " (tuning call)";
    EXPECT_LT(rel(cached[i], plain[i]), 1e-2) << "output/gradient " << i << " (cached algorithms)";
  }
}
