// Closed-form gradients of the tensor-parallel ops (src/bmt/nn/tp_ops.h), at tp 2, tp 4 and dp 2 x tp 2.
// Every input and every loss weight is an integer-valued closed form of (tp rank, element index), so forward
// values and gradients are exact and the expected results are computed here by hand, not by another tp op:
//   x_r[k] = 1 + r + k % 5 (a rank's own input), W_r[k] = 1 + (k + r) % 3 (rank r's loss weights).
// Objectives, following tp_ops.h's convention:
//   * ops whose output is replicated over tp (reduce_from_tp, gather_last_dim, gather_rows_replicated): one loss sum(W * y) with the same
//     W on every rank, so each rank's input gradient is its part of W (reduce_from_tp: all of it);
//   * ops whose output differs per rank (copy_to_tp's partial uses, split_*, gather_rows, reduce_scatter_rows):
//     the loss is the sum over ranks of sum(W_r * y_r); each rank back-propagates its own term and the op's
//     backward communication must supply the rest.
#include <gtest/gtest.h>

#include "bmt/nn/tp_ops.h"
#include "run_ranks.h"
#include "tp_test_util.h"

namespace {

using bmt::testing::run_ranks;

using bmt::testing::tp_init;

// 1 + r + k % 5 over a tensor of `shape` (k = flat index).
at::Tensor input_of(int r, std::vector<int64_t> shape) {
  at::Tensor k = at::arange(c10::multiply_integers(shape), at::kFloat);
  return (1 + r + at::remainder(k, 5)).view(shape);
}
// 1 + (k + r) % 3.
at::Tensor weights_of(int r, std::vector<int64_t> shape) {
  at::Tensor k = at::arange(c10::multiply_integers(shape), at::kFloat);
  return (1 + at::remainder(k + r, 3)).view(shape);
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined (no gradient reached the input)";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what << " (tp rank " << bmt::config().tp_rank << ")\ngot\n"
                                    << got << "\nwant\n"
                                    << want;
}

void all_cases() {
  const int T = bmt::config().tp_size, r = bmt::config().tp_rank;
  const int64_t n = 2, m = 3;  // per-rank rows, columns

  {  // copy_to_tp: y = x (x replicated); backward sums every rank's partial gradient.
    at::Tensor x = input_of(0, {n, m}).requires_grad_();
    at::Tensor y = bmt::tp::copy_to_tp(x);
    expect_equal(y, input_of(0, {n, m}), "copy_to_tp forward");
    (y * weights_of(r, {n, m})).sum().backward();
    at::Tensor want = at::zeros({n, m});
    for (int s = 0; s < T; ++s) want += weights_of(s, {n, m});
    expect_equal(x.grad(), want, "copy_to_tp backward = sum over ranks of W_s");
  }
  {  // reduce_from_tp: y = sum_s x_s (replicated); backward identity.
    at::Tensor x = input_of(r, {n, m}).requires_grad_();
    at::Tensor y = bmt::tp::reduce_from_tp(x);
    at::Tensor want = at::zeros({n, m});
    for (int s = 0; s < T; ++s) want += input_of(s, {n, m});
    expect_equal(y, want, "reduce_from_tp forward = sum over ranks of x_s");
    (y * weights_of(0, {n, m})).sum().backward();
    expect_equal(x.grad(), weights_of(0, {n, m}), "reduce_from_tp backward = W");
  }
  {  // reduce_scatter_rows: y_r = rows chunk r of sum_s x_s; backward all_gather of every rank's W_s.
    at::Tensor x = input_of(r, {T * n, m}).requires_grad_();
    at::Tensor y = bmt::tp::reduce_scatter_rows(x);
    at::Tensor sum = at::zeros({T * n, m});
    for (int s = 0; s < T; ++s) sum += input_of(s, {T * n, m});
    expect_equal(y, sum.narrow(0, r * n, n), "reduce_scatter_rows forward");
    (y * weights_of(r, {n, m})).sum().backward();
    std::vector<at::Tensor> parts;
    for (int s = 0; s < T; ++s) parts.push_back(weights_of(s, {n, m}));
    expect_equal(x.grad(), at::cat(parts, 0), "reduce_scatter_rows backward = cat over ranks of W_s");
  }
  {  // gather_rows: y = cat_s x_s (each rank uses it in its own term); backward rows chunk r of sum_s W_s.
    at::Tensor x = input_of(r, {n, m}).requires_grad_();
    at::Tensor y = bmt::tp::gather_rows(x);
    std::vector<at::Tensor> parts;
    for (int s = 0; s < T; ++s) parts.push_back(input_of(s, {n, m}));
    expect_equal(y, at::cat(parts, 0), "gather_rows forward");
    (y * weights_of(r, {T * n, m})).sum().backward();
    at::Tensor sum = at::zeros({T * n, m});
    for (int s = 0; s < T; ++s) sum += weights_of(s, {T * n, m});
    expect_equal(x.grad(), sum.narrow(0, r * n, n), "gather_rows backward = own rows of sum over ranks of W_s");
  }
  {  // split_rows: y_r = rows chunk r of a replicated x; backward cat of every rank's W_s.
    at::Tensor x = input_of(0, {T * n, m}).requires_grad_();
    at::Tensor y = bmt::tp::split_rows(x);
    expect_equal(y, input_of(0, {T * n, m}).narrow(0, r * n, n), "split_rows forward");
    (y * weights_of(r, {n, m})).sum().backward();
    std::vector<at::Tensor> parts;
    for (int s = 0; s < T; ++s) parts.push_back(weights_of(s, {n, m}));
    expect_equal(x.grad(), at::cat(parts, 0), "split_rows backward = cat over ranks of W_s");
  }
  {  // gather_last_dim: y = cat_s x_s along -1 (replicated, one loss); backward own columns of W.
    at::Tensor x = input_of(r, {n, m}).requires_grad_();
    at::Tensor y = bmt::tp::gather_last_dim(x);
    std::vector<at::Tensor> parts;
    for (int s = 0; s < T; ++s) parts.push_back(input_of(s, {n, m}));
    expect_equal(y, at::cat(parts, -1), "gather_last_dim forward");
    at::Tensor W = weights_of(0, {n, T * m});
    (y * W).sum().backward();
    expect_equal(x.grad(), W.narrow(-1, r * m, m), "gather_last_dim backward = own columns of W");
  }
  {  // gather_rows_replicated: y = cat_s x_s used identically on every rank (one loss); backward own rows of W.
    at::Tensor x = input_of(r, {n, m}).requires_grad_();
    at::Tensor y = bmt::tp::gather_rows_replicated(x);
    std::vector<at::Tensor> parts;
    for (int s = 0; s < T; ++s) parts.push_back(input_of(s, {n, m}));
    expect_equal(y, at::cat(parts, 0), "gather_rows_replicated forward");
    at::Tensor W = weights_of(0, {T * n, m});
    (y * W).sum().backward();
    expect_equal(x.grad(), W.narrow(0, r * n, n), "gather_rows_replicated backward = own rows of W");
  }
  {  // split_last_dim: y_r = columns chunk r of a replicated x; backward cat of every rank's W_s along -1.
    at::Tensor x = input_of(0, {n, T * m}).requires_grad_();
    at::Tensor y = bmt::tp::split_last_dim(x);
    expect_equal(y, input_of(0, {n, T * m}).narrow(-1, r * m, m), "split_last_dim forward");
    (y * weights_of(r, {n, m})).sum().backward();
    std::vector<at::Tensor> parts;
    for (int s = 0; s < T; ++s) parts.push_back(weights_of(s, {n, m}));
    expect_equal(x.grad(), at::cat(parts, -1), "split_last_dim backward = cat over ranks of W_s");
  }
}

}  // namespace

TEST(TpOpsClosedForm, Tp2) { run_ranks(2, all_cases, tp_init(2)); }
TEST(TpOpsClosedForm, Tp4) { run_ranks(4, all_cases, tp_init(4)); }
TEST(TpOpsClosedForm, Dp2Tp2) { run_ranks(4, all_cases, tp_init(2)); }
TEST(TpOpsClosedForm, Tp1IsIdentity) { run_ranks(1, all_cases, tp_init(1)); }
