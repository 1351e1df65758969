// Fused cross-entropy on the GPU: the CUDA kernels against their CPU twin (statistics to fp32 rounding, gradients
// to one unit in the last place of their dtype, in place or not, rows beyond the grid, elements past 2^31), and
// the LibTorch layer on CUDA tensors against at::cross_entropy_loss, on a side stream.
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include <cmath>
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/cross_entropy_internal.h"
#include "bmt/core/kernels/thread_pool.h"
#include "bmt/loss/fused_cross_entropy.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace k = bmt::core::kernels;
using bmt::loss::FusedCrossEntropyOptions;
using bmt::loss::Reduction;

namespace {

k::CrossEntropyArgs args(const at::Tensor& x, const at::Tensor& target, int64_t begin, int64_t total,
                         int64_t ignore) {
  k::CrossEntropyArgs a;
  a.logits = x.data_ptr();
  a.dtype = bmt::to_core_dtype(x.scalar_type());
  a.rows = x.size(0);
  a.cols = x.size(1);
  a.target = target.data_ptr<int64_t>();
  a.vocab_begin = begin;
  a.vocab_total = total;
  a.ignore_index = ignore;
  return a;
}

void* stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

double ulp_rtol(at::ScalarType t) { return t == at::kBFloat16 ? 1.0 / 128 : t == at::kHalf ? 1.0 / 1024 : 2e-6; }

// CUDA stats and backward of `x_cpu` (a slice [begin, begin + cols) of a vocabulary of `total`) against the twin.
void compare_kernels(const at::Tensor& x_cpu, const at::Tensor& t_cpu, int64_t begin, int64_t total, float eps,
                     bool in_place) {
  const int64_t n = x_cpu.size(0);
  SCOPED_TRACE(std::string(c10::toString(x_cpu.scalar_type())) + " rows=" + std::to_string(n) + " cols=" +
               std::to_string(x_cpu.size(1)) + " in_place=" + std::to_string(in_place));
  at::Tensor x = x_cpu.cuda(), t = t_cpu.cuda();
  at::Tensor s_cpu = at::empty({4, n}), s_gpu = at::full({4, n}, NAN, x.options().dtype(at::kFloat));
  k::cross_entropy_stats_cpu(args(x_cpu, t_cpu, begin, total, -100), s_cpu.data_ptr<float>(), k::ThreadPool::global());
  k::cross_entropy_stats_cuda(args(x, t, begin, total, -100), s_gpu.data_ptr<float>(), stream());
  at::Tensor sg = s_gpu.cpu();
  // max and target logit are exact; the sums agree to fp32 rounding of their magnitude.
  EXPECT_TRUE(at::equal(sg[0], s_cpu[0]));
  EXPECT_TRUE(at::equal(sg[2], s_cpu[2]));
  // Sums of `cols` fp32 terms in different orders (8 lanes on the CPU, a tree on the GPU) and expf vs std::exp:
  // rounding grows like sqrt(cols) * eps, so allow 8 * sqrt(cols) * 2^-24 relative.
  const double sum_rtol = 8.0 * std::sqrt(static_cast<double>(x_cpu.size(1))) * 5.96e-8;
  EXPECT_TRUE(at::allclose(sg[1], s_cpu[1], sum_rtol, 0))
      << "max relative diff " << ((sg[1] - s_cpu[1]).abs() / s_cpu[1].abs()).max().item<double>() << ", allowed "
      << sum_rtol;
  EXPECT_TRUE(at::allclose(sg[3], s_cpu[3], 1e-5, 1e-5 * x_cpu.size(1)))
      << "max diff " << (sg[3] - s_cpu[3]).abs().max().item<float>();

  at::Tensor g_row = at::rand({n}) + 0.5;
  at::Tensor g_cpu = at::empty_like(x_cpu);
  k::cross_entropy_backward_cpu(args(x_cpu, t_cpu, begin, total, -100), s_cpu[0].data_ptr<float>(),
                                s_cpu[1].data_ptr<float>(), g_row.data_ptr<float>(), eps, g_cpu.data_ptr(),
                                k::ThreadPool::global());
  at::Tensor gr = g_row.cuda(), sc = s_cpu.cuda();  // the same combined statistics on both sides
  at::Tensor g_gpu = in_place ? x : at::empty_like(x);
  k::cross_entropy_backward_cuda(args(x, t, begin, total, -100), sc[0].data_ptr<float>(), sc[1].data_ptr<float>(),
                                 gr.data_ptr<float>(), eps, g_gpu.data_ptr(), stream());
  at::Tensor a = g_gpu.cpu().to(at::kDouble), b = g_cpu.to(at::kDouble);
  at::Tensor excess = (a - b).abs() - (b.abs() * ulp_rtol(x_cpu.scalar_type()) + 1e-6);
  EXPECT_LE(excess.max().item<double>(), 0.0) << "max diff " << (a - b).abs().max().item<double>();
}

}  // namespace

TEST(CudaCrossEntropy, KernelsMatchCpuTwin) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(1);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    // 1, 7, 1001, 50257: one element at a time; 1000, 4096, 50304: 16-byte accesses (cols % 8 == 0).
    for (int64_t cols : {1, 7, 1001, 50257, 1000, 4096, 50304}) {
      const int64_t n = 37;
      at::Tensor x = (at::randn({n, cols}) * 4).to(dtype);
      at::Tensor t = at::randint(0, cols, {n}, at::kLong);
      t.index_put_({at::arange(0, n, 5)}, -100);
      compare_kernels(x, t, 0, cols, 0.1f, cols == 1001 || cols == 4096);
    }
    // Ascending logits: the one-pass statistics rescale their running sums at almost every step.
    at::Tensor ascending = (at::arange(4096, at::kFloat) * 0.01).repeat({3, 1}).to(dtype);
    compare_kernels(ascending, at::tensor(std::vector<int64_t>{0, 4095, 2000}), 0, 4096, 0.0f, false);
    // A vocabulary slice (targets in and out of it) with a large common offset.
    at::Tensor x = (at::randn({50, 333}) * 10 + (dtype == at::kHalf ? 2e4 : 1e4)).to(dtype);
    at::Tensor t = at::randint(0, 1000, {50}, at::kLong);
    compare_kernels(x, t, 333, 1000, 0.0f, false);
  }
  // More rows than the kernels' grid (grid-stride over rows).
  at::Tensor x = at::randn({(1 << 16) + 37, 5});
  compare_kernels(x, at::randint(0, 5, {x.size(0)}, at::kLong), 0, 5, 0.2f, true);
}

TEST(CudaCrossEntropy, IndexesPast2To31Elements) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t cols = 32771, rows = (int64_t{1} << 31) / cols + 3;  // > 2^31 bf16 elements (~4.3 GB)
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  if (free_b < size_t{10} << 30) GTEST_SKIP() << "needs ~10 GB of free GPU memory";
  at::manual_seed(2);
  at::Tensor x = at::randn({rows, cols}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
  at::Tensor t = at::randint(0, cols, {rows}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  at::Tensor pick = at::tensor({int64_t{0}, rows / 2, rows - 2, rows - 1}, at::kLong);
  at::Tensor x_rows = x.index_select(0, pick.cuda()).cpu(), t_rows = t.index_select(0, pick.cuda()).cpu();
  at::Tensor stats = at::empty({4, rows}, x.options().dtype(at::kFloat));
  k::cross_entropy_stats_cuda(args(x, t, 0, cols, -100), stats.data_ptr<float>(), stream());
  at::Tensor want = at::empty({4, 4});
  k::cross_entropy_stats_cpu(args(x_rows, t_rows, 0, cols, -100), want.data_ptr<float>(), k::ThreadPool::global());
  at::Tensor got = stats.index_select(1, pick.cuda()).cpu();
  EXPECT_TRUE(at::equal(got[0], want[0]));
  EXPECT_TRUE(at::equal(got[2], want[2]));
  EXPECT_TRUE(at::allclose(got[1], want[1], 1e-5, 0));
  at::Tensor ones = at::ones({rows}, x.options().dtype(at::kFloat));
  k::cross_entropy_backward_cuda(args(x, t, 0, cols, -100), stats[0].data_ptr<float>(), stats[1].data_ptr<float>(),
                                 ones.data_ptr<float>(), 0.0f, x.data_ptr(), stream());  // in place
  // Each gradient row sums to 0 (softmax minus one-hot), including the rows past 2^31 elements.
  at::Tensor row_sums = x.index_select(0, pick.cuda()).to(at::kFloat).sum(1).cpu();
  EXPECT_LT(row_sums.abs().max().item<float>(), 2e-2) << row_sums;
  EXPECT_NE(x[rows - 1].abs().sum().item<float>(), 0.0f);
}

TEST(CudaCrossEntropy, LayerMatchesTorchOnGpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard guard(side);  // the layer must use the current stream, not the default one
  at::manual_seed(3);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      for (double eps : {0.0, 0.1}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " reduction=" + std::to_string(static_cast<int>(r)) +
                     " eps=" + std::to_string(eps));
        const int64_t n = 64, c = 5003;
        at::Tensor base = (at::randn({n, c}, at::kCUDA) * 3).to(dtype);
        at::Tensor target = at::randint(0, c, {n}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
        target.index_put_({at::arange(0, n, 4, at::kCUDA)}, -100);
        at::Tensor up = r == Reduction::kNone ? at::rand({n}, at::kCUDA) + 0.5 : at::full({}, 2.0, at::kCUDA);
        at::Tensor x = base.clone().requires_grad_(true);
        FusedCrossEntropyOptions o;
        o.reduction = r;
        o.label_smoothing = eps;
        at::Tensor loss = bmt::loss::fused_cross_entropy(x, target, o);
        loss.backward(up);
        at::Tensor xr = base.to(at::kDouble).requires_grad_(true);
        int64_t red = r == Reduction::kMean ? at::Reduction::Mean : r == Reduction::kSum ? at::Reduction::Sum
                                                                                        : at::Reduction::None;
        at::Tensor ref = at::cross_entropy_loss(xr, target, {}, red, -100, eps);
        ref.backward(up.to(at::kDouble));
        EXPECT_TRUE(at::allclose(loss.to(at::kDouble), ref, 2e-5, 2e-5))
            << "max diff " << (loss.to(at::kDouble) - ref).abs().max().item<double>();
        at::Tensor g = x.grad().to(at::kDouble), gr = xr.grad();
        at::Tensor excess = (g - gr).abs() - (gr.abs() * (dtype == at::kFloat ? 1e-5 : ulp_rtol(dtype)) + 2e-7);
        EXPECT_LE(excess.max().item<double>(), 0.0) << "max grad diff " << (g - gr).abs().max().item<double>();
      }
    }
  }
}

// The target check on CUDA never synchronises: a bad target gives a NaN loss, and the error (naming the first bad
// target) comes from the next call or from check_pending_targets(); good calls in between are not affected.
TEST(FusedCrossEntropyCuda, BadTargetGivesNaNAndADeferredError) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  bmt::loss::check_pending_targets();  // nothing pending from other tests
  at::Tensor x = at::randn({4, 7}, at::kCUDA);
  at::Tensor bad = at::tensor({1, -100, 99, 3}, at::kLong).cuda(), good = at::tensor({1, 2, 3, 4}, at::kLong).cuda();
  at::Tensor loss;
  ASSERT_NO_THROW(loss = bmt::loss::fused_cross_entropy(x, bad));
  EXPECT_TRUE(std::isnan(loss.item<float>()));
  std::string message;
  try {
    bmt::loss::check_pending_targets();
  } catch (const bmt::core::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("first target[2] = 99"), std::string::npos) << message;
  EXPECT_NO_THROW(bmt::loss::check_pending_targets());  // reported once
  // The next call raises for an earlier bad call.
  ASSERT_NO_THROW(bmt::loss::fused_cross_entropy(x, bad));
  EXPECT_THROW(bmt::loss::fused_cross_entropy(x, good), bmt::core::Error);
  // Good calls are unaffected, also per row.
  FusedCrossEntropyOptions none;
  none.reduction = Reduction::kNone;
  at::Tensor rows = bmt::loss::fused_cross_entropy(x, good, none);
  EXPECT_FALSE(at::isnan(rows).any().item<bool>());
  EXPECT_NO_THROW(bmt::loss::check_pending_targets());
}

// The check's bookkeeping (first bad row, its target) stays on the device: with torch's sync debug mode set to
// raise, the forward and backward of good and bad calls run through (a host read of a device value would throw).
TEST(FusedCrossEntropyCuda, TargetCheckNeverSynchronises) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  bmt::loss::check_pending_targets();
  at::Tensor x = at::randn({64, 11}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16)).requires_grad_();
  at::Tensor good = at::randint(0, 11, {64}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  at::Tensor bad = good.clone();
  bad.index_put_({5}, 40);
  auto& state = c10::cuda::warning_state();
  const auto before = state.get_sync_debug_mode();
  state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  std::string error;
  try {
    for (int i = 0; i < 3; ++i) bmt::loss::fused_cross_entropy(x, good).backward();
    bmt::loss::fused_cross_entropy(x, bad).backward();
  } catch (const std::exception& e) {
    error = e.what();
  }
  state.set_sync_debug_mode(before);
  EXPECT_EQ(error, "") << "a host synchronisation in the cross-entropy's hot path";
  std::string message;
  try {
    bmt::loss::check_pending_targets();
  } catch (const bmt::core::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("first target[5] = 40"), std::string::npos) << message;
}
