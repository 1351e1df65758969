// CPU twin of the fused cross-entropy kernels against a naive double-precision reference (torch-free): losses and
// gradients for fp32/bf16/fp16, odd column counts, large magnitudes, ignored rows, label smoothing, vocabulary
// slices of unequal width combined as the parallel layer does, in-place backward, thread-count independence, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "bmt/core/dtype.h"
#include "bmt/core/error.h"
#include "bmt/core/kernels/cross_entropy_internal.h"
#include "bmt/core/kernels/thread_pool.h"

namespace k = bmt::core::kernels;
using bmt::core::DType;

namespace {

const DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// A (rows, cols) matrix in any float dtype; values are read back exactly as the kernel sees them.
struct Matrix {
  DType dt;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;
  Matrix(DType d, int64_t r, int64_t c) : dt(d), rows(r), cols(c), bytes(r * c * bmt::core::dtype_nbytes(d)) {}
  void set(int64_t i, int64_t j, float x) {
    int64_t e = i * cols + j;
    if (dt == DType::kFloat32) return (void)std::memcpy(bytes.data() + 4 * e, &x, 4);
    uint16_t h = dt == DType::kBFloat16 ? bmt::core::float_to_bf16_bits(x) : bmt::core::float_to_fp16_bits(x);
    std::memcpy(bytes.data() + 2 * e, &h, 2);
  }
  float get(int64_t i, int64_t j) const {
    int64_t e = i * cols + j;
    if (dt == DType::kFloat32) {
      float x;
      std::memcpy(&x, bytes.data() + 4 * e, 4);
      return x;
    }
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * e, 2);
    return dt == DType::kBFloat16 ? bmt::core::bf16_bits_to_float(h) : bmt::core::fp16_bits_to_float(h);
  }
};

Matrix random_logits(DType dt, int64_t rows, int64_t cols, float offset, float scale, uint32_t seed) {
  Matrix m(dt, rows, cols);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) m.set(i, j, offset + scale * dist(rng));
  return m;
}

// Every third row ignored, the others uniform in [0, vocab).
std::vector<int64_t> random_targets(int64_t rows, int64_t vocab, int64_t ignore_index, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, vocab - 1);
  std::vector<int64_t> t(rows);
  for (int64_t i = 0; i < rows; ++i) t[i] = i % 3 == 1 ? ignore_index : dist(rng);
  return t;
}

struct Reference {
  std::vector<double> loss;  // per row (0 for ignored rows)
  std::vector<double> grad;  // (rows, cols)
};

// torch's definition, in double: (1-eps)(lse - x_t) + eps(lse - mean_x); grad (softmax - target dist) * g_row.
Reference reference(const Matrix& x, const std::vector<int64_t>& target, int64_t ignore_index, double eps,
                    const std::vector<float>& grad_row) {
  Reference r{std::vector<double>(x.rows, 0.0), std::vector<double>(x.rows * x.cols, 0.0)};
  for (int64_t i = 0; i < x.rows; ++i) {
    if (target[i] == ignore_index) continue;
    double m = -INFINITY, s = 0, sum = 0;
    for (int64_t j = 0; j < x.cols; ++j) m = std::max(m, static_cast<double>(x.get(i, j)));
    for (int64_t j = 0; j < x.cols; ++j) s += std::exp(x.get(i, j) - m);
    if (eps != 0)
      for (int64_t j = 0; j < x.cols; ++j) sum += x.get(i, j);
    const double lse = m + std::log(s);
    r.loss[i] = (1 - eps) * (lse - x.get(i, target[i])) + (eps != 0 ? eps * (lse - sum / x.cols) : 0.0);
    for (int64_t j = 0; j < x.cols; ++j) {
      double p = std::exp(x.get(i, j) - lse);
      r.grad[i * x.cols + j] = (p - eps / x.cols - (j == target[i] ? 1 - eps : 0.0)) * grad_row[i];
    }
  }
  return r;
}

k::CrossEntropyArgs args(const Matrix& x, const std::vector<int64_t>& target, int64_t ignore_index,
                         int64_t vocab_begin = 0, int64_t vocab_total = -1) {
  k::CrossEntropyArgs a;
  a.logits = x.bytes.data();
  a.dtype = x.dt;
  a.rows = x.rows;
  a.cols = x.cols;
  a.target = target.data();
  a.vocab_begin = vocab_begin;
  a.vocab_total = vocab_total < 0 ? x.cols : vocab_total;
  a.ignore_index = ignore_index;
  return a;
}

std::vector<float> grad_rows(int64_t rows) {
  std::vector<float> g(rows);
  for (int64_t i = 0; i < rows; ++i) g[i] = 0.25f + 0.125f * static_cast<float>(i % 5);
  return g;
}

// Tolerance of a gradient element stored in dt: about one unit of its last place, plus a floor.
double grad_tol(DType dt, double ref) {
  double rel = dt == DType::kFloat32 ? 1e-5 : dt == DType::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
  return rel * std::abs(ref) + 2e-6;
}

// Runs stats + row loss + backward on the whole vocabulary and checks against the reference.
void check_against_reference(DType dt, int64_t rows, int64_t cols, float offset, float scale, float eps,
                             uint32_t seed) {
  SCOPED_TRACE(std::string(bmt::core::dtype_name(dt)) + " rows=" + std::to_string(rows) + " cols=" +
               std::to_string(cols) + " offset=" + std::to_string(offset) + " scale=" + std::to_string(scale) +
               " eps=" + std::to_string(eps));
  const int64_t ignore = -100;
  Matrix x = random_logits(dt, rows, cols, offset, scale, seed);
  std::vector<int64_t> target = random_targets(rows, cols, ignore, seed + 1);
  std::vector<float> g = grad_rows(rows);
  Reference ref = reference(x, target, ignore, eps, g);

  auto& pool = k::ThreadPool::global();
  std::vector<float> stats(k::kCrossEntropyNumStats * rows, std::nanf(""));
  k::cross_entropy_stats_cpu(args(x, target, ignore), stats.data(), pool);
  for (int64_t i = 0; i < rows; ++i) {
    if (target[i] == ignore) {
      for (int s = 0; s < k::kCrossEntropyNumStats; ++s) EXPECT_EQ(stats[s * rows + i], 0.0f) << "row " << i;
      continue;
    }
    float loss = k::cross_entropy_row_loss(stats[i], stats[rows + i], stats[2 * rows + i], stats[3 * rows + i], eps,
                                           cols);
    EXPECT_NEAR(loss, ref.loss[i], 2e-5 * (1 + std::abs(ref.loss[i]))) << "row " << i;
  }

  Matrix grad(dt, rows, cols);
  k::cross_entropy_backward_cpu(args(x, target, ignore), stats.data(), stats.data() + rows, g.data(), eps,
                                grad.bytes.data(), pool);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      double r = ref.grad[i * cols + j];
      ASSERT_NEAR(grad.get(i, j), r, grad_tol(dt, r)) << "row " << i << " col " << j;
    }
}

}  // namespace

TEST(CrossEntropyKernel, MatchesDoubleReference) {
  uint32_t seed = 1;
  for (DType dt : kFloatTypes)
    for (int64_t cols : {1, 2, 7, 33, 1001})
      for (float eps : {0.0f, 0.1f}) check_against_reference(dt, 11, cols, 0.0f, 2.0f, eps, seed++);
}

TEST(CrossEntropyKernel, LargeMagnitudesStayAccurate) {
  // A large common offset (exp would overflow without the max shift) and a wide spread (a near one-hot softmax).
  uint32_t seed = 100;
  for (DType dt : kFloatTypes) {
    const float offset = dt == DType::kFloat16 ? 3.0e4f : 1.0e4f;
    for (float eps : {0.0f, 0.1f}) {
      check_against_reference(dt, 7, 257, offset, 8.0f, eps, seed++);
      check_against_reference(dt, 7, 513, -offset, 40.0f, eps, seed++);
    }
  }
}

TEST(CrossEntropyKernel, NegativeInfinityLogitsAreMaskedOut) {
  // Masked vocabulary entries (-inf) get probability 0 and gradient 0; the loss stays finite.
  const int64_t rows = 3, cols = 9;
  Matrix x = random_logits(DType::kFloat32, rows, cols, 0.0f, 1.0f, 7);
  for (int64_t i = 0; i < rows; ++i) x.set(i, 2 * i + 1, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> target = {0, 4, 8};
  std::vector<float> g = grad_rows(rows), stats(4 * rows);
  Reference ref = reference(x, target, -100, 0.0, g);
  k::cross_entropy_stats_cpu(args(x, target, -100), stats.data(), k::ThreadPool::global());
  Matrix grad(DType::kFloat32, rows, cols);
  k::cross_entropy_backward_cpu(args(x, target, -100), stats.data(), stats.data() + rows, g.data(), 0.0f,
                                grad.bytes.data(), k::ThreadPool::global());
  for (int64_t i = 0; i < rows; ++i) {
    float loss = k::cross_entropy_row_loss(stats[i], stats[rows + i], stats[2 * rows + i], stats[3 * rows + i], 0.0f,
                                           cols);
    EXPECT_TRUE(std::isfinite(loss));
    EXPECT_NEAR(loss, ref.loss[i], 1e-5);
    EXPECT_EQ(grad.get(i, 2 * i + 1), 0.0f);
    for (int64_t j = 0; j < cols; ++j) EXPECT_NEAR(grad.get(i, j), ref.grad[i * cols + j], 1e-6);
  }
}

TEST(CrossEntropyKernel, UnequalVocabularySlicesCombineToTheFullLoss) {
  // Slices [0,400) [400,701) [701,1001) of one vocabulary, combined with the layer's formula (cross_entropy.h):
  // M = max m_r, S = sum s_r exp(m_r - M), x_t = sum of the slices' target logits, Z = sum (z_r + cols_r (m_r - M)).
  const int64_t rows = 12, vocab = 1001, ignore = 5;  // a non-default ignore_index that is also a vocabulary id
  const int64_t bounds[] = {0, 400, 701, 1001};
  const float eps = 0.2f;
  for (DType dt : kFloatTypes) {
    SCOPED_TRACE(bmt::core::dtype_name(dt));
    Matrix full = random_logits(dt, rows, vocab, 3.0f, 3.0f, 11);
    std::vector<int64_t> target = random_targets(rows, vocab, ignore, 12);
    target[0] = 0, target[2] = 400, target[3] = 1000, target[5] = 700;  // slice edges
    std::vector<float> g = grad_rows(rows);
    Reference ref = reference(full, target, ignore, eps, g);
    std::vector<Matrix> parts;
    std::vector<std::vector<float>> stats;
    for (int r = 0; r < 3; ++r) {
      parts.emplace_back(dt, rows, bounds[r + 1] - bounds[r]);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = bounds[r]; j < bounds[r + 1]; ++j) parts[r].set(i, j - bounds[r], full.get(i, j));
      stats.emplace_back(4 * rows);
      k::cross_entropy_stats_cpu(args(parts[r], target, ignore, bounds[r], vocab), stats[r].data(),
                                 k::ThreadPool::global());
    }
    std::vector<float> big_m(rows), big_s(rows);
    for (int64_t i = 0; i < rows; ++i) {
      if (target[i] == ignore) continue;
      float m = -INFINITY, s = 0, xt = 0, z = 0;
      for (int r = 0; r < 3; ++r) m = std::max(m, stats[r][i]);
      for (int r = 0; r < 3; ++r) {
        s += stats[r][rows + i] * std::exp(stats[r][i] - m);
        xt += stats[r][2 * rows + i];
        z += stats[r][3 * rows + i] + static_cast<float>(parts[r].cols) * (stats[r][i] - m);
      }
      big_m[i] = m, big_s[i] = s;
      EXPECT_NEAR(k::cross_entropy_row_loss(m, s, xt, z, eps, vocab), ref.loss[i], 2e-5 * (1 + ref.loss[i]))
          << "row " << i;
    }
    for (int r = 0; r < 3; ++r) {
      Matrix grad(dt, rows, parts[r].cols);
      k::cross_entropy_backward_cpu(args(parts[r], target, ignore, bounds[r], vocab), big_m.data(), big_s.data(),
                                    g.data(), eps, grad.bytes.data(), k::ThreadPool::global());
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < parts[r].cols; ++j) {
          double want = ref.grad[i * vocab + bounds[r] + j];
          ASSERT_NEAR(grad.get(i, j), want, grad_tol(dt, want)) << "slice " << r << " row " << i << " col " << j;
        }
    }
  }
}

TEST(CrossEntropyKernel, InPlaceBackwardAndThreadCountGiveIdenticalBits) {
  const int64_t rows = 37, cols = 301;
  for (DType dt : kFloatTypes) {
    Matrix x = random_logits(dt, rows, cols, 0.0f, 4.0f, 21);
    std::vector<int64_t> target = random_targets(rows, cols, -100, 22);
    std::vector<float> g = grad_rows(rows);
    k::ThreadPool serial(0), wide(3);
    std::vector<float> s1(4 * rows, std::nanf("")), s2(4 * rows, -1.0f);
    k::cross_entropy_stats_cpu(args(x, target, -100), s1.data(), serial);
    k::cross_entropy_stats_cpu(args(x, target, -100), s2.data(), wide);
    ASSERT_EQ(std::memcmp(s1.data(), s2.data(), s1.size() * 4), 0) << bmt::core::dtype_name(dt);
    Matrix out(dt, rows, cols), inplace = x;
    std::memset(out.bytes.data(), 0xff, out.bytes.size());
    k::cross_entropy_backward_cpu(args(x, target, -100), s1.data(), s1.data() + rows, g.data(), 0.1f,
                                  out.bytes.data(), serial);
    k::cross_entropy_backward_cpu(args(inplace, target, -100), s1.data(), s1.data() + rows, g.data(), 0.1f,
                                  inplace.bytes.data(), wide);
    EXPECT_EQ(out.bytes, inplace.bytes) << bmt::core::dtype_name(dt);
    EXPECT_NE(out.bytes, x.bytes);
  }
}

TEST(CrossEntropyKernel, RejectsBadArguments) {
  Matrix x = random_logits(DType::kFloat32, 2, 4, 0.0f, 1.0f, 3);
  std::vector<float> stats(8), g(2, 1.0f);
  auto& pool = k::ThreadPool::global();
  auto message = [&](const std::vector<int64_t>& target, int64_t begin, int64_t total) -> std::string {
    try {
      k::cross_entropy_stats_cpu(args(x, target, -100, begin, total), stats.data(), pool);
    } catch (const bmt::core::Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message({1, 4}, 0, 4).find("target[1] = 4 is outside the vocabulary [0, 4)"), std::string::npos);
  EXPECT_NE(message({-1, 0}, 0, 4).find("target[0] = -1"), std::string::npos);
  EXPECT_NE(message({0, 1}, 2, 5).find("are not inside the vocabulary"), std::string::npos);
  EXPECT_EQ(message({0, 7}, 4, 8), "");  // a slice [4, 8) of a vocabulary of 8: target 0 is elsewhere, fine
  std::vector<int64_t> t = {0, 1};
  auto a = args(x, t, -100);
  a.dtype = DType::kInt64;
  EXPECT_THROW(k::cross_entropy_stats_cpu(a, stats.data(), pool), bmt::core::Error);
  a = args(x, t, -100);
  a.cols = 0;
  EXPECT_THROW(k::cross_entropy_stats_cpu(a, stats.data(), pool), bmt::core::Error);
  a = args(x, t, -100);
  a.rows = 0;  // nothing to do, nothing touched
  a.logits = nullptr;
  EXPECT_NO_THROW(k::cross_entropy_stats_cpu(a, nullptr, pool));
  EXPECT_NO_THROW(k::cross_entropy_backward_cpu(a, nullptr, nullptr, nullptr, 0.0f, nullptr, pool));
  std::vector<int64_t> bad = {3, 9};
  a = args(x, bad, -100);
  EXPECT_THROW(k::cross_entropy_backward_cpu(a, stats.data(), stats.data(), g.data(), 0.0f, stats.data(), pool),
               bmt::core::Error);
}
