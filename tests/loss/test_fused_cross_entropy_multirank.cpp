// Vocabulary-parallel fused cross-entropy on real Gloo ranks (tp = 2 and 4): every rank slices the same full logits,
// the loss equals the dense cross-entropy (and is bit-identical on every tp rank), the local gradient equals the
// matching columns of the dense gradient; ranks that disagree on shapes or targets all raise the same error.
#include <gtest/gtest.h>

#include <string>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/loss/fused_cross_entropy.h"
#include "run_ranks.h"

using bmt::loss::FusedCrossEntropyOptions;
using bmt::loss::Reduction;

namespace {

int64_t at_reduction(Reduction r) {
  return r == Reduction::kMean ? at::Reduction::Mean : r == Reduction::kSum ? at::Reduction::Sum : at::Reduction::None;
}

void check_vocab_parallel(at::ScalarType dtype, Reduction reduction, double eps, int64_t ignore_index) {
  const bmt::Config& cfg = bmt::config();
  const int tp = cfg.tp_size, rank = cfg.tp_rank;
  SCOPED_TRACE(std::string(c10::toString(dtype)) + " tp=" + std::to_string(tp) + " rank=" + std::to_string(rank) +
               " reduction=" + std::to_string(static_cast<int>(reduction)) + " eps=" + std::to_string(eps));
  const int64_t n = 19, c = 13, vocab = c * tp;
  at::manual_seed(77);  // the same full logits and targets on every rank
  at::Tensor full = (at::randn({n, vocab}, at::kDouble) * 3 + 1).to(dtype);
  at::Tensor target = at::randint(0, vocab, {n}, at::kLong);
  target[1] = vocab - 1;
  target[2] = 0;
  target[4] = c;  // first id of the second slice
  target.index_put_({at::arange(0, n, 3)}, ignore_index);
  at::Tensor upstream = reduction == Reduction::kNone ? at::rand({n}, at::kDouble) + 0.5 : at::full({}, 0.75, at::kDouble);

  at::Tensor local = full.narrow(1, rank * c, c).clone().requires_grad_(true);
  FusedCrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.reduction = reduction;
  o.label_smoothing = eps;
  o.parallel = true;
  at::Tensor loss = bmt::loss::fused_cross_entropy(local, target, o);
  loss.backward(upstream.to(at::kFloat));

  at::Tensor dense = full.to(at::kDouble).requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(dense, target, {}, at_reduction(reduction), ignore_index, eps);
  ref.backward(upstream);

  at::Tensor got = loss.to(at::kDouble);
  EXPECT_TRUE(at::allclose(got, ref, 2e-5, 2e-5)) << "max diff " << (got - ref).abs().max().item<double>();
  at::Tensor g = local.grad().to(at::kDouble), want = dense.grad().narrow(1, rank * c, c);
  double rtol = dtype == at::kBFloat16 ? 1.0 / 128 : dtype == at::kHalf ? 1.0 / 1024 : 1e-5;
  at::Tensor excess = (g - want).abs() - (want.abs() * rtol + 2e-7);
  EXPECT_LE(excess.max().item<double>(), 0.0) << "max grad diff " << (g - want).abs().max().item<double>();

  at::Tensor all = bmt::distributed::all_gather(loss.detach().reshape({-1}).contiguous(), *cfg.tp_comm);
  for (int r = 1; r < tp; ++r) EXPECT_TRUE(at::equal(all[r], all[0])) << "loss differs on tp rank " << r;
}

std::string error_of(const at::Tensor& x, const at::Tensor& t, FusedCrossEntropyOptions o) {
  o.parallel = true;
  try {
    bmt::loss::fused_cross_entropy(x, t, o);
  } catch (const bmt::core::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(FusedCrossEntropyMultiRank, VocabParallelMatchesDense) {
  for (int tp : {2, 4}) {
    bmt::InitOptions init = bmt::testing::test_init();
    init.tp_size = tp;
    bmt::testing::run_ranks(
        tp,
        [] {
          ASSERT_GT(bmt::config().tp_size, 1);
          for (Reduction r : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
            check_vocab_parallel(at::kFloat, r, 0.0, -100);
            check_vocab_parallel(at::kFloat, r, 0.1, 5);  // ignore_index that is a vocabulary id
          }
          check_vocab_parallel(at::kBFloat16, Reduction::kMean, 0.1, -100);
          check_vocab_parallel(at::kHalf, Reduction::kNone, 0.0, -100);
        },
        init);
  }
}

TEST(FusedCrossEntropyMultiRank, DisagreeingRanksAllRaise) {
  bmt::InitOptions init = bmt::testing::test_init();
  init.tp_size = 2;
  bmt::testing::run_ranks(
      2,
      [] {
        const int rank = bmt::config().tp_rank;
        at::Tensor t = at::tensor({0, 9, -100}, at::kLong);  // vocabulary 2 * 5
        // Different column counts: both ranks learn it from the agreement all-reduce.
        EXPECT_NE(error_of(at::randn({3, rank == 0 ? 5 : 6}), t, {}).find("disagree on the column count"),
                  std::string::npos);
        // Different targets.
        at::Tensor t2 = t.clone();
        if (rank == 1) t2[0] = 1;
        EXPECT_NE(error_of(at::randn({3, 5}), t2, {}).find("disagree on the targets"), std::string::npos);
        // Different dtypes.
        EXPECT_NE(error_of(at::randn({3, 5}).to(rank == 0 ? at::kFloat : at::kHalf), t, {}).find("logits dtype"),
                  std::string::npos);
        // A target outside the whole vocabulary (9 is inside: it lives in rank 1's slice).
        at::Tensor t3 = at::tensor({0, 10, -100}, at::kLong);
        EXPECT_NE(error_of(at::randn({3, 5}), t3, {}).find("target[1] = 10 is outside the vocabulary [0, 10)"),
                  std::string::npos);
        // The group is still usable afterwards.
        EXPECT_EQ(error_of(at::randn({3, 5}), t, {}), "");
      },
      init);
}
