// nn::linear / nn::layer_norm's reduced-gradient autograd paths and the column-reduction CPU twins, on the CPU:
// gradients against at::linear / at::layer_norm's own autograd (an independent implementation), the twins against
// at::sum in double. The CUDA kernels against the twins: tests/cuda/test_column_reduce_cuda.cpp.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "bmt/core/kernels/column_reduce_internal.h"
#include "bmt/nn/fused_reductions.h"
#include "bmt/runtime/tensor_adapter_internal.h"

namespace k = bmt::core::kernels;

namespace {

at::Tensor leaf(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

// A linear's operands x [sizes], w [12, 16], b [12], the output gradient, and two leaf copies of each operand.
struct LinearOperands {
  at::Tensor x0, w0, b0, dy, x1, w1, b1, x2, w2, b2;
  explicit LinearOperands(const std::vector<int64_t>& sizes)
      : x0(at::randn(sizes)), w0(at::randn({12, 16})), b0(at::randn({12})) {
    std::vector<int64_t> out_sizes = sizes;
    out_sizes.back() = 12;
    dy = at::randn(out_sizes);
    x1 = leaf(x0), w1 = leaf(w0), b1 = leaf(b0), x2 = leaf(x0), w2 = leaf(w0), b2 = leaf(b0);
  }
};

}  // namespace

TEST(ColumnReduceCpu, ColumnSumMatchesADoubleSum) {
  at::manual_seed(1);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {300, 768}, {64, 3}}) {
      at::Tensor m = (at::randn({rows, cols}) * 2).to(st);
      at::Tensor out = at::empty({cols}, at::kFloat);
      k::column_sum_cpu(m.data_ptr(), bmt::to_core_dtype(st), rows, cols, out.data_ptr(), bmt::core::DType::kFloat32);
      const at::Tensor want = m.to(at::kDouble).sum(0).to(at::kFloat);
      EXPECT_TRUE(at::allclose(out, want, 1e-6, 1e-6)) << c10::toString(st) << " " << rows << "x" << cols;
    }
  }
}

TEST(ColumnReduceCpu, LayerNormParamGradsMatchTheDefinition) {
  at::manual_seed(2);
  const int64_t rows = 50, cols = 24;
  at::Tensor x = at::randn({rows, cols}) * 3 + 1, dy = at::randn({rows, cols});
  at::Tensor mean = x.mean(1), rstd = at::rsqrt(x.var(1, /*unbiased=*/false) + 1e-5);
  at::Tensor dg = at::empty({cols}), db = at::empty({cols});
  k::layer_norm_param_grads_cpu(dy.data_ptr(), x.data_ptr(), bmt::core::DType::kFloat32, mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), rows, cols, dg.data_ptr(), db.data_ptr(), bmt::core::DType::kFloat32);
  const at::Tensor xhat = (x.to(at::kDouble) - mean.to(at::kDouble).unsqueeze(1)) * rstd.to(at::kDouble).unsqueeze(1);
  EXPECT_TRUE(at::allclose(dg, (dy.to(at::kDouble) * xhat).sum(0).to(at::kFloat), 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(db, dy.to(at::kDouble).sum(0).to(at::kFloat), 1e-5, 1e-5));
  // Either output may be skipped.
  at::Tensor only_b = at::zeros({cols});
  k::layer_norm_param_grads_cpu(dy.data_ptr(), x.data_ptr(), bmt::core::DType::kFloat32, mean.data_ptr<float>(),
                                rstd.data_ptr<float>(), rows, cols, nullptr, only_b.data_ptr(), bmt::core::DType::kFloat32);
  EXPECT_TRUE(at::equal(only_b, db));
}

// The twin of the fused GELU-gradient column sum against torch's gelu_backward computed in fp64: each stored value
// the fp64 one rounded once (one ulp of the dtype apart at most: gelu' itself is rounded to fp32 first), the sums
// those of the stored values.
TEST(ColumnReduceCpu, DGeluColumnSumMatchesTorchsGeluBackward) {
  at::manual_seed(3);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {300, 96}}) {
      const std::string what = std::string(c10::toString(st)) + " " + std::to_string(rows) + "x" + std::to_string(cols);
      const at::Tensor dy = at::randn({rows, cols}).to(st), pre = (at::randn({rows, cols}) * 3).to(st);
      at::Tensor dgrad = at::empty({rows, cols}, st), sums = at::empty({cols}, at::kFloat);
      k::dgelu_column_sum_cpu(dy.data_ptr(), pre.data_ptr(), bmt::to_core_dtype(st), rows, cols, dgrad.data_ptr(),
                              sums.data_ptr(), bmt::core::DType::kFloat32);
      const at::Tensor want = at::gelu_backward(dy.to(at::kDouble), pre.to(at::kDouble), "tanh");
      const double ulp = st == at::kFloat ? 1e-6 : st == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;  // relative
      const at::Tensor err = (dgrad.to(at::kDouble) - want).abs();
      // (fp16's subnormal spacing is 2^-24; |dy| 1e-12: where tanh rounds to -1 in fp64, torch's gelu' is 0 and
      // the twin's, summed in another order, a few 1e-15)
      const double tiny = st == at::kHalf ? 6e-8 : 1e-30;
      const at::Tensor tol = want.abs() * ulp + dy.to(at::kDouble).abs() * 1e-12 + tiny;
      EXPECT_TRUE((err <= tol).all().item<bool>())
          << what << ": max error " << err.max().item<double>();
      EXPECT_TRUE(at::allclose(sums, dgrad.to(at::kDouble).sum(0).to(at::kFloat), 1e-6, 1e-6)) << what;
    }
  }
}

TEST(ColumnReduceCpu, PlanCoversEveryRowWithinTheGridLimit) {
  for (auto dt : {bmt::core::DType::kFloat32, bmt::core::DType::kBFloat16}) {
    for (int64_t rows : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{16384}, int64_t{1} << 31}) {
      for (int64_t cols : {int64_t{1}, int64_t{768}, int64_t{50304}}) {
        const k::ColumnReducePlan p = k::column_reduce_plan(rows, cols, dt);
        EXPECT_GE(p.slabs * p.rows_per_slab, rows);
        EXPECT_LT((p.slabs - 1) * p.rows_per_slab, rows);  // no empty slab
        EXPECT_LE(p.slabs, 65535);
        EXPECT_EQ(k::column_reduce_workspace_numel(rows, cols, dt), p.slabs * cols);
      }
    }
  }
}

TEST(FusedReductions, LinearGradientsMatchAtLinear) {
  at::manual_seed(3);
  for (auto sizes : {std::vector<int64_t>{4, 5, 16}, std::vector<int64_t>{9, 16}}) {
    const LinearOperands o(sizes);
    const at::Tensor& dy = o.dy;
    const at::Tensor &x1 = o.x1, &w1 = o.w1, &b1 = o.b1, &x2 = o.x2, &w2 = o.w2, &b2 = o.b2;
    at::Tensor y1 = bmt::nn::linear_reduced_bias_grad(x1, w1, b1);
    at::Tensor y2 = at::linear(x2, w2, b2);
    EXPECT_TRUE(at::equal(y1, y2));  // the forward is at::linear's
    y1.backward(dy);
    y2.backward(dy);
    EXPECT_TRUE(at::allclose(x1.grad(), x2.grad(), 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(w1.grad(), w2.grad(), 1e-5, 1e-5));
    EXPECT_TRUE(at::allclose(b1.grad(), b2.grad(), 1e-5, 1e-5));
  }
}

// The deferred linear (a checkpointed Block's recompute): the same node without the GEMM. Its output is NaN until
// linear_fill writes the computing path's values; its gradients are the computing path's.
TEST(FusedReductions, DeferredLinearIsTheNodeWithoutTheGemm) {
  at::manual_seed(4);
  for (auto sizes : {std::vector<int64_t>{4, 5, 16}, std::vector<int64_t>{9, 16}}) {
    const LinearOperands o(sizes);
    const at::Tensor &x0 = o.x0, &w0 = o.w0, &b0 = o.b0, &dy = o.dy;
    const at::Tensor &x1 = o.x1, &w1 = o.w1, &b1 = o.b1, &x2 = o.x2, &w2 = o.w2, &b2 = o.b2;
    at::Tensor y1 = bmt::nn::linear_deferred(x1, w1, b1);
    at::Tensor y2 = bmt::nn::linear_reduced_bias_grad(x2, w2, b2);
    EXPECT_EQ(y1.sizes(), y2.sizes());
    EXPECT_TRUE(at::isnan(y1).all().item<bool>()) << "a deferred output reads as NaN until it is filled";
    y1.backward(dy);
    y2.backward(dy);
    EXPECT_TRUE(at::equal(x1.grad(), x2.grad()));
    EXPECT_TRUE(at::equal(w1.grad(), w2.grad()));
    EXPECT_TRUE(at::equal(b1.grad(), b2.grad()));
    at::Tensor y3 = bmt::nn::linear_deferred(x0, w0, b0);
    bmt::nn::linear_fill(x0, w0, b0, y3);
    EXPECT_TRUE(at::equal(y3, y2.detach())) << "linear_fill writes the computing path's values";
  }
  EXPECT_THROW(bmt::nn::linear_fill(at::randn({3, 16}), at::randn({12, 16}), at::randn({12}), at::empty({4, 12})),
               bmt::core::Error);
}

TEST(FusedReductions, LinearSkipsGradientsNobodyWants) {
  at::Tensor x = at::randn({3, 4}), w = leaf(at::randn({2, 4})), b = at::randn({2});  // only w needs a gradient
  bmt::nn::linear_reduced_bias_grad(x, w, b).sum().backward();
  EXPECT_TRUE(at::allclose(w.grad(), at::ones({3, 2}).t().mm(x)));
  EXPECT_FALSE(b.grad().defined());
}

TEST(FusedReductions, LayerNormGradientsMatchAtLayerNorm) {
  at::manual_seed(4);
  for (at::ScalarType st : {at::kFloat, at::kBFloat16}) {
    at::Tensor x0 = (at::randn({3, 5, 32}) * 2 + 0.5).to(st), w0 = at::randn({32}).to(st), b0 = at::randn({32}).to(st);
    at::Tensor dy = at::randn({3, 5, 32}).to(st);
    at::Tensor x1 = leaf(x0), w1 = leaf(w0), b1 = leaf(b0), x2 = leaf(x0), w2 = leaf(w0), b2 = leaf(b0);
    at::Tensor y1 = bmt::nn::layer_norm_reduced_param_grads(x1, 32, w1, b1, 1e-5);
    at::Tensor y2 = at::layer_norm(x2, {32}, w2, b2, 1e-5);
    EXPECT_TRUE(at::equal(y1, y2));
    y1.backward(dy);
    y2.backward(dy);
    EXPECT_TRUE(at::equal(x1.grad(), x2.grad()));  // the input gradient is torch's own kernel in both
    if (st == at::kFloat) {
      EXPECT_TRUE(at::allclose(w1.grad(), w2.grad(), 1e-5, 1e-5));
      EXPECT_TRUE(at::allclose(b1.grad(), b2.grad(), 1e-5, 1e-5));
      continue;
    }
    // bf16: against fp64 sums over the bf16 inputs. Ours computes the statistics and the sums in fp32 and rounds
    // once (half an ulp, 2^-9 relative). Torch's CPU kernel keeps a bf16 input's mean and rstd in bf16 (measured:
    // 0.068 off at a gradient of ~11.7, where one bf16 rounding is 0.013), so it is held to a looser bound only.
    const at::Tensor xd = x0.to(at::kDouble), d = dy.to(at::kDouble);
    const at::Tensor mean = xd.mean(-1, true), rstd = at::rsqrt(xd.var(-1, false, true) + 1e-5);
    const std::vector<int64_t> rows_dims = {0, 1};
    const at::Tensor ref_w = (d * (xd - mean) * rstd).sum(rows_dims), ref_b = d.sum(rows_dims);
    auto max_excess = [](const at::Tensor& got, const at::Tensor& ref, double rel, double abs) {
      return ((got.to(at::kDouble) - ref).abs() - (ref.abs() * rel + abs)).max().item<double>();
    };
    EXPECT_LE(max_excess(w1.grad(), ref_w, 1.0 / 256, 1e-4), 0.0) << "ours, bf16 weight gradient";
    EXPECT_LE(max_excess(b1.grad(), ref_b, 1.0 / 256, 1e-4), 0.0) << "ours, bf16 bias gradient";
    EXPECT_LE(max_excess(w2.grad(), ref_w, 2e-2, 2e-1), 0.0) << "torch's, bf16 weight gradient";
  }
  EXPECT_THROW(bmt::nn::layer_norm_reduced_param_grads(at::randn({2, 4}), 4, at::ones({4}), at::Tensor(), 1e-5),
               std::exception);
}

TEST(FusedReductions, DispatchersAreTorchsOpsOnTheCpuAndWhenSwitchedOff) {
  at::manual_seed(5);
  at::Tensor x = leaf(at::randn({4, 8})), w = leaf(at::randn({6, 8})), b = leaf(at::randn({6}));
  at::Tensor y = bmt::nn::linear(x, w, b);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->name().find("LinearReducedBiasGradFn"), std::string::npos) << y.grad_fn()->name();
  at::Tensor g = leaf(at::randn({8}));
  at::Tensor z = bmt::nn::layer_norm(x, 8, g, at::Tensor(), 1e-5);
  EXPECT_EQ(z.grad_fn()->name().find("LayerNormReducedParamGradsFn"), std::string::npos) << z.grad_fn()->name();
  EXPECT_TRUE(at::equal(z, at::layer_norm(x, {8}, g, {}, 1e-5)));
  const bool was = bmt::nn::fused_reductions_enabled();
  bmt::nn::set_fused_reductions_enabled(false);
  EXPECT_FALSE(bmt::nn::fused_reductions_enabled());
  bmt::nn::set_fused_reductions_enabled(was);
}

// On the CPU nn::dgelu_column_sum is torch's gelu_backward and the column sum, bit for bit.
TEST(FusedReductions, DGeluColumnSumIsGeluBackwardThenColumnSumOnTheCpu) {
  at::manual_seed(4);
  const at::Tensor dy = at::randn({40, 24}).to(at::kBFloat16), pre = (at::randn({40, 24}) * 2).to(at::kBFloat16);
  at::Tensor partials = at::ones({1});
  const auto [dpre, db] = bmt::nn::dgelu_column_sum(dy, pre, at::kFloat, &partials);
  const at::Tensor want = at::gelu_backward(dy, pre, "tanh");
  EXPECT_TRUE(at::equal(dpre, want));
  EXPECT_TRUE(at::equal(db, bmt::nn::column_sum(want, at::kFloat)));
  EXPECT_FALSE(partials.defined());  // (the partial maxima are the CUDA kernel's)
  EXPECT_THROW(bmt::nn::dgelu_column_sum(dy, pre.narrow(0, 0, 20), at::kFloat), std::exception);
  EXPECT_THROW(bmt::nn::dgelu_column_sum(dy, pre.to(at::kFloat), at::kFloat), std::exception);
  EXPECT_THROW(bmt::nn::dgelu_column_sum(dy.view({-1}), pre.view({-1}), at::kFloat), std::exception);
}

TEST(FusedReductions, ColumnSumRejectsBadInput) {
  EXPECT_THROW(bmt::nn::column_sum(at::zeros({2, 3, 4}), at::kFloat), std::exception);
  EXPECT_THROW(bmt::nn::column_sum(at::zeros({2, 3}, at::kLong), at::kFloat), std::exception);
  EXPECT_TRUE(at::allclose(bmt::nn::column_sum(at::ones({5, 3}), at::kFloat), at::full({3}, 5.0)));
}
