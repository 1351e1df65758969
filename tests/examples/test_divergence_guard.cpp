// DivergenceGuard (examples/train/divergence_guard.h) on loss sequences: it fires after exactly N suspect steps
// in a row above K x the lowest loss, a recovery resets the count, healthy curves with spikes (and the first
// steps, where the loss may rise above the first value) never fire, non-finite losses are left to the skip
// counter, and factor 0 turns it off.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "train/divergence_guard.h"

namespace {

using examples::DivergenceGuard;
using V = DivergenceGuard::Verdict;

// The step index (0-based) at which the guard says diverged, -1 if never.
int fires_at(DivergenceGuard g, const std::vector<double>& losses) {
  for (size_t i = 0; i < losses.size(); ++i)
    if (g.observe(losses[i]) == V::kDiverged) return static_cast<int>(i);
  return -1;
}

}  // namespace

TEST(DivergenceGuard, FiresAfterExactlyNSuspectStepsInARow) {
  // Loss 2.6 falling to 1.0, then the blow-up of --lr 1e6 (finite, billions).
  std::vector<double> losses = {2.6, 2.0, 1.5, 1.2, 1.0};
  for (int i = 0; i < 20; ++i) losses.push_back(6.8e9);
  EXPECT_EQ(fires_at(DivergenceGuard(3, 10), losses), 5 + 9);
  EXPECT_EQ(fires_at(DivergenceGuard(3, 1), losses), 5);
  // 3.0 is not above 3 x 1.0; 3.01 is.
  EXPECT_EQ(fires_at(DivergenceGuard(3, 2), {1.0, 3.0, 3.0, 3.0}), -1);
  EXPECT_EQ(fires_at(DivergenceGuard(3, 2), {1.0, 3.01, 3.01}), 2);
}

TEST(DivergenceGuard, ARecoveryResetsTheCountAndSuspectLossesDoNotMoveTheReference) {
  DivergenceGuard g(3, 3);
  EXPECT_EQ(g.observe(1.0), V::kOk);
  EXPECT_EQ(g.observe(5.0), V::kSuspect);
  EXPECT_EQ(g.observe(5.0), V::kSuspect);
  EXPECT_EQ(g.suspect_in_a_row(), 2);
  EXPECT_EQ(g.observe(1.5), V::kOk);  // recovered
  EXPECT_EQ(g.suspect_in_a_row(), 0);
  EXPECT_EQ(g.best_loss(), 1.0);
  EXPECT_EQ(g.observe(5.0), V::kSuspect);
  EXPECT_EQ(g.observe(5.0), V::kSuspect);
  EXPECT_EQ(g.observe(5.0), V::kDiverged);
}

TEST(DivergenceGuard, HealthyCurvesNeverFire) {
  // ln(vocab) falling to a plateau with multiplicative noise of +-30% and a few 2x spikes lasting 5 steps, and an
  // early rise above the first loss: the shapes of the tiny, 124M and 1.3B runs, far rougher than they are.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> noise(0.7, 1.3);
  for (double start : {2.6, 10.9, 11.0}) {
    const double end = start / 3.5;
    std::vector<double> losses = {start, start * 1.2, start * 1.1};
    for (int i = 0; i < 5000; ++i) {
      double l = end + (start - end) * std::exp(-i / 300.0);
      if (i % 997 < 5) l *= 2;  // spikes
      losses.push_back(l * noise(rng));
    }
    EXPECT_EQ(fires_at(DivergenceGuard(3, 10), losses), -1) << "start " << start;
  }
}

TEST(DivergenceGuard, NonFiniteLossesAreIgnoredAndFactorZeroIsOff) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  DivergenceGuard g(3, 2);
  EXPECT_EQ(g.observe(1.0), V::kOk);
  EXPECT_EQ(g.observe(inf), V::kOk);
  EXPECT_EQ(g.observe(nan), V::kOk);
  EXPECT_EQ(g.best_loss(), 1.0);
  EXPECT_EQ(fires_at(DivergenceGuard(0, 1), {1.0, 1e9, 1e9, 1e9}), -1);
}
