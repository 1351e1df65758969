// bmt::loss::fused_cross_entropy on CPU against at::cross_entropy_loss in double: values and gradients (through
// autograd) for every reduction, with ignore_index and label smoothing, in fp32/bf16/fp16/fp64; degenerate batches
// (every row ignored, no row), the module wrapper and the argument checks.
#include <gtest/gtest.h>

#include <string>

#include "bmt/core/error.h"
#include "bmt/runtime/init.h"
#include "bmt/loss/fused_cross_entropy.h"

using bmt::loss::FusedCrossEntropyOptions;
using bmt::loss::Reduction;

namespace {

int64_t at_reduction(Reduction r) {
  return r == Reduction::kMean ? at::Reduction::Mean : r == Reduction::kSum ? at::Reduction::Sum : at::Reduction::None;
}

const char* name(Reduction r) { return r == Reduction::kMean ? "mean" : r == Reduction::kSum ? "sum" : "none"; }

double grad_rtol(at::ScalarType t) {
  return t == at::kBFloat16 ? 1.0 / 128 : t == at::kHalf ? 1.0 / 1024 : 1e-5;  // fp32 and fp64 (computed in fp32)
}

// Loss and d loss / d logits of ours and of torch (in double, on the same rounded logits), with a random upstream
// gradient for reduction none.
void compare_with_torch(at::ScalarType dtype, Reduction reduction, int64_t ignore_index, double eps, double offset,
                        double scale) {
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " reduction=" + name(reduction) + " ignore_index=" +
               std::to_string(ignore_index) + " eps=" + std::to_string(eps) + " offset=" + std::to_string(offset));
  const int64_t n = 37, c = 101;
  at::manual_seed(42);
  at::Tensor base = (at::randn({n, c}, at::kDouble) * scale + offset).to(dtype);
  at::Tensor target = at::randint(0, c, {n}, at::kLong);
  target.index_put_({at::arange(0, n, 4)}, ignore_index);  // every fourth row ignored
  at::Tensor upstream = reduction == Reduction::kNone ? at::rand({n}, at::kDouble) + 0.5 : at::full({}, 1.5, at::kDouble);

  at::Tensor x = base.clone().requires_grad_(true);
  FusedCrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.reduction = reduction;
  o.label_smoothing = eps;
  at::Tensor loss = bmt::loss::fused_cross_entropy(x, target, o);
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  EXPECT_EQ(loss.dim(), reduction == Reduction::kNone ? 1 : 0);
  loss.backward(upstream.to(at::kFloat));

  at::Tensor xr = base.to(at::kDouble).requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(xr, target, {}, at_reduction(reduction), ignore_index, eps);
  ref.backward(upstream);

  at::Tensor got = loss.to(at::kDouble);
  EXPECT_TRUE(at::allclose(got, ref, 2e-5, 2e-5)) << "max diff " << (got - ref).abs().max().item<double>();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().scalar_type(), dtype);
  at::Tensor g = x.grad().to(at::kDouble), gr = xr.grad();
  at::Tensor excess = (g - gr).abs() - (gr.abs() * grad_rtol(dtype) + 2e-7);
  EXPECT_LE(excess.max().item<double>(), 0.0) << "max grad diff " << (g - gr).abs().max().item<double>();
  at::Tensor ignored_rows = g.index({target == ignore_index});
  EXPECT_TRUE(at::equal(ignored_rows, at::zeros_like(ignored_rows)));
}

}  // namespace

TEST(FusedCrossEntropy, MatchesTorchCrossEntropy) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble})
    for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone})
      for (double eps : {0.0, 0.1}) compare_with_torch(dtype, r, -100, eps, 0.0, 2.0);
}

TEST(FusedCrossEntropy, IgnoreIndexInsideTheVocabulary) {
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone})
    compare_with_torch(at::kFloat, r, 3, 0.25, 0.0, 1.0);
}

TEST(FusedCrossEntropy, LargeLogitsMatchTorch) {
  compare_with_torch(at::kFloat, Reduction::kMean, -100, 0.1, 5000.0, 30.0);
  compare_with_torch(at::kFloat, Reduction::kNone, -100, 0.0, -3000.0, 100.0);
  compare_with_torch(at::kHalf, Reduction::kSum, -100, 0.1, 2.0e4, 8.0);
  compare_with_torch(at::kBFloat16, Reduction::kMean, -100, 0.0, 1.0e4, 50.0);
}

TEST(FusedCrossEntropy, AllRowsIgnoredGivesZeroNotNaN) {
  at::Tensor x = at::randn({5, 7}).requires_grad_(true);
  at::Tensor target = at::full({5}, -100, at::kLong);
  for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
    FusedCrossEntropyOptions o;
    o.reduction = r;
    o.label_smoothing = 0.1;
    x.mutable_grad() = at::Tensor();
    at::Tensor loss = bmt::loss::fused_cross_entropy(x, target, o);
    EXPECT_TRUE(at::equal(loss, at::zeros_like(loss))) << name(r) << ": " << loss;
    loss.sum().backward();
    EXPECT_TRUE(at::equal(x.grad(), at::zeros_like(x))) << name(r);
  }
  // No row at all.
  at::Tensor empty = at::randn({0, 7}).requires_grad_(true);
  at::Tensor loss = bmt::loss::fused_cross_entropy(empty, at::zeros({0}, at::kLong));
  EXPECT_EQ(loss.item<float>(), 0.0f);
  loss.backward();
  EXPECT_EQ(empty.grad().sizes(), empty.sizes());
}

TEST(FusedCrossEntropy, ModuleWrapperAndNonContiguousInput) {
  FusedCrossEntropyOptions o;
  o.reduction = Reduction::kSum;
  bmt::loss::FusedCrossEntropy module(o);
  at::manual_seed(3);
  at::Tensor xt = at::randn({9, 6}).requires_grad_(true);
  at::Tensor x = xt.t();  // (6, 9), not contiguous
  at::Tensor target = at::randint(0, 9, {6}, at::kLong);
  at::Tensor loss = module->forward(x, target);
  loss.backward();
  at::Tensor xr = xt.detach().clone().requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(xr.t(), target, {}, at::Reduction::Sum);
  ref.backward();
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
  EXPECT_TRUE(at::allclose(xt.grad(), xr.grad(), 1e-5, 1e-6));
}

// inplace: the gradient is written over the logits (no second (N, C) buffer) and equals the out-of-place one.
TEST(FusedCrossEntropy, InplaceBackwardWritesTheGradientOverTheLogits) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(5);
    at::Tensor base = at::randn({23, 40}).to(dtype);
    at::Tensor target = at::randint(0, 40, {23}, at::kLong);
    target[3] = -100;
    FusedCrossEntropyOptions o;
    at::Tensor x1 = base.clone().requires_grad_(true), x2 = base.clone().requires_grad_(true);
    at::Tensor logits1 = x1 * 2, logits2 = x2 * 2;  // non-leaf logits, as a model's output
    bmt::loss::fused_cross_entropy(logits1, target, o).backward();
    o.inplace = true;
    at::Tensor loss2 = bmt::loss::fused_cross_entropy(logits2, target, o);
    const void* before = logits2.data_ptr();
    loss2.backward();
    EXPECT_EQ(logits2.data_ptr(), before);
    EXPECT_TRUE(at::equal(x1.grad(), x2.grad())) << "in place changed the gradient";
    // The logits' memory now holds d loss / d logits = x.grad / 2.
    EXPECT_TRUE(at::equal(logits2.detach() * 2, x2.grad()));
    EXPECT_FALSE(at::equal(logits1.detach(), logits2.detach()));
  }
}

TEST(FusedCrossEntropy, RejectsBadArguments) {
  auto message = [](const at::Tensor& x, const at::Tensor& t, FusedCrossEntropyOptions o = {}) -> std::string {
    try {
      bmt::loss::fused_cross_entropy(x, t, o);
    } catch (const bmt::core::Error& e) {
      return e.what();
    }
    return "";
  };
  at::Tensor x = at::randn({4, 5});
  at::Tensor t = at::tensor({0, 1, 2, 3}, at::kLong);
  EXPECT_EQ(message(x, t), "");
  EXPECT_NE(message(at::randn({2, 2, 5}), t).find("must be 2-D"), std::string::npos);
  EXPECT_NE(message(x, t.to(at::kInt)).find("target must be int64"), std::string::npos);
  EXPECT_NE(message(x, t.narrow(0, 0, 3)).find("target must be 1-D with 4 entries"), std::string::npos);
  EXPECT_NE(message(x.to(at::kInt), t).find("not supported"), std::string::npos);
  EXPECT_NE(message(at::randn({4, 0}), t).find("no column"), std::string::npos);
  EXPECT_NE(message(x, at::tensor({0, 5, 2, -100}, at::kLong)).find("target[1] = 5 is outside the vocabulary [0, 5)"),
            std::string::npos);
  EXPECT_NE(message(x, at::tensor({0, -3, 2, 1}, at::kLong)).find("target[1] = -3"), std::string::npos);
  FusedCrossEntropyOptions smooth;
  smooth.label_smoothing = 1.5;
  EXPECT_NE(message(x, t, smooth).find("label_smoothing must be in [0, 1]"), std::string::npos);
  FusedCrossEntropyOptions par;
  par.parallel = true;
  ASSERT_FALSE(bmt::is_initialized());
  EXPECT_NE(message(x, t, par).find("call bmt::init_distributed"), std::string::npos);
}
