// The counter-based generator of sharded initialisation (bmt/core/philox.h): Philox4x32-10 against Random123's
// published known-answer vectors, the element-wise definition of the streams (closed form, written out here), that
// any sub-range equals the same elements of the whole stream (what makes shards world-size independent), and the
// moments of the uniform and normal distributions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bmt/core/dtype.h"
#include "bmt/core/philox.h"

namespace {

using namespace bmt::core;

TEST(Philox, Random123KnownAnswers) {
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (PhiloxCounter{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
            (PhiloxCounter{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (PhiloxCounter{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

// The documented layout, element by element.
double expected_variate(const RandomStream& s, int64_t i) {
  const uint64_t block = static_cast<uint64_t>(i) / 4;
  const PhiloxCounter w = philox4x32_10(
      {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(s.stream),
       static_cast<uint32_t>(s.stream >> 32)},
      {static_cast<uint32_t>(s.seed), static_cast<uint32_t>(s.seed >> 32)});
  const int lane = static_cast<int>(i % 4);
  auto u = [&](int k) { return (static_cast<double>(w[static_cast<size_t>(k)]) + 0.5) / 4294967296.0; };
  if (s.dist == RandomDist::kUniform) return u(lane);
  const int first = lane & ~1;
  const double r = std::sqrt(-2.0 * std::log(u(first)));
  const double theta = 2.0 * M_PI * u(first + 1);
  return lane == first ? r * std::cos(theta) : r * std::sin(theta);
}

TEST(Philox, StreamsFollowTheDocumentedLayout) {
  for (RandomDist dist : {RandomDist::kUniform, RandomDist::kNormal}) {
    RandomStream s{dist, 0x1234567890abcdefull, stream_of_name("layers.3.fc1.weight", 19), 0.25, 0.02};
    for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{77}, int64_t{1} << 33}) {
      const double want = 0.25 + 0.02 * expected_variate(s, i);
      EXPECT_EQ(random_value(s, i), want) << "element " << i;
      float f = 0;
      random_fill(s, i, 1, DType::kFloat32, &f);
      EXPECT_EQ(f, static_cast<float>(want)) << "element " << i;
      uint16_t b = 0;
      random_fill(s, i, 1, DType::kBFloat16, &b);
      EXPECT_EQ(b, float_to_bf16_bits(static_cast<float>(want))) << "element " << i;
    }
  }
}

TEST(Philox, AnySubrangeEqualsTheWholeStream) {
  RandomStream s{RandomDist::kNormal, 7, 99, 0.0, 1.0};
  const int64_t n = 1003;
  std::vector<double> whole(n);
  random_fill(s, 0, n, DType::kFloat64, whole.data());
  for (int64_t first : {1, 2, 3, 5, 250, 998})
    for (int64_t count : {0, 1, 2, 3, 4, 5}) {
      std::vector<double> part(static_cast<size_t>(count) + 1, -1.0);
      random_fill(s, first, count, DType::kFloat64, part.data());
      for (int64_t j = 0; j < count; ++j) EXPECT_EQ(part[j], whole[first + j]) << first << "+" << j;
      EXPECT_EQ(part[count], -1.0) << "wrote past the range";
    }
}

TEST(Philox, SeedsStreamsAndNamesSeparate) {
  RandomStream a{RandomDist::kUniform, 1, 5, 0, 1}, b = a, c = a;
  b.seed = 2;
  c.stream = 6;
  EXPECT_NE(random_value(a, 0), random_value(b, 0));
  EXPECT_NE(random_value(a, 0), random_value(c, 0));
  EXPECT_NE(stream_of_name("a.weight", 8), stream_of_name("b.weight", 8));
  EXPECT_EQ(stream_of_name("a.weight", 8), stream_of_name("a.weight", 8));
}

TEST(Philox, Moments) {
  const int64_t n = int64_t{1} << 20;
  std::vector<double> v(n);
  for (RandomDist dist : {RandomDist::kUniform, RandomDist::kNormal}) {
    RandomStream s{dist, 42, stream_of_name("w", 1), 0.0, 1.0};
    random_fill(s, 0, n, DType::kFloat64, v.data());
    double sum = 0, sq = 0, cube = 0, quad = 0, lo = 1e9, hi = -1e9;
    for (double x : v) sum += x;
    const double mean = sum / n;
    for (double x : v) {
      const double d = x - mean;
      sq += d * d, cube += d * d * d, quad += d * d * d * d;
      lo = std::min(lo, x), hi = std::max(hi, x);
    }
    const double var = sq / n, skew = cube / n / std::pow(var, 1.5), kurt = quad / n / (var * var);
    // Tolerances: about 5 standard errors at n = 2^20.
    if (dist == RandomDist::kUniform) {
      EXPECT_NEAR(mean, 0.5, 5 * std::sqrt(1.0 / 12 / n));
      EXPECT_NEAR(var, 1.0 / 12, 5 * std::sqrt(1.0 / 180 / n));
      EXPECT_NEAR(kurt, 1.8, 0.01);
      EXPECT_GT(lo, 0.0);
      EXPECT_LT(hi, 1.0);
    } else {
      EXPECT_NEAR(mean, 0.0, 5 / std::sqrt(static_cast<double>(n)));
      EXPECT_NEAR(var, 1.0, 5 * std::sqrt(2.0 / n));
      EXPECT_NEAR(skew, 0.0, 5 * std::sqrt(6.0 / n));
      EXPECT_NEAR(kurt, 3.0, 5 * std::sqrt(24.0 / n));
      EXPECT_GT(hi, 4.0);  // tails exist (P(|z| > 4) = 6e-5: ~66 such values expected)
      EXPECT_LT(lo, -4.0);
    }
  }
}

}  // namespace
