// CPU twin of the fused cross-entropy kernels (see cross_entropy.h): the CPU path of the LibTorch layer and the
// reference of the CUDA kernels' tests. Rows are independent: they are split over the thread pool. Each row is read
// twice (max, then sum of exponentials), which is exact about the max and cheap while the row is in cache; sums
// use eight partial accumulators so that long rows lose less precision to fp32 rounding.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "bmt/core/error.h"
#include "bmt/core/kernels/cross_entropy_internal.h"
#include "bmt/core/kernels/thread_pool.h"

namespace bmt::core::kernels {
namespace {

constexpr int kLanes = 8;
constexpr int64_t kElemsPerTask = 1 << 15;

template <DType D>
inline float load(const void* base, int64_t i) {
  if constexpr (D == DType::kFloat32) return static_cast<const float*>(base)[i];
  if constexpr (D == DType::kBFloat16) return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
  if constexpr (D == DType::kFloat16) return fp16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
  return 0.0f;
}

template <DType D>
inline void store(void* base, int64_t i, float x) {
  if constexpr (D == DType::kFloat32) static_cast<float*>(base)[i] = x;
  if constexpr (D == DType::kBFloat16) static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(x);
  if constexpr (D == DType::kFloat16) static_cast<uint16_t*>(base)[i] = float_to_fp16_bits(x);
}

void check_target(const CrossEntropyArgs& a, int64_t row, int64_t t) {
  BMT_CHECK(t >= 0 && t < a.vocab_total, "cross_entropy: target[", row, "] = ", t, " is outside the vocabulary [0, ",
            a.vocab_total, ") and is not ignore_index (", a.ignore_index,
            "); fix the labels or set ignore_index to the padding id");
}

template <DType D>
void stats_rows(const CrossEntropyArgs& a, float* stats, int64_t lo, int64_t hi) {
  const int64_t n = a.rows, cols = a.cols;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t t = a.target[i];
    float* out[kCrossEntropyNumStats] = {stats + i, stats + n + i, stats + 2 * n + i, stats + 3 * n + i};
    if (t == a.ignore_index) {
      for (float* o : out) *o = 0.0f;
      continue;
    }
    check_target(a, i, t);
    const void* row = static_cast<const char*>(a.logits) + i * cols * static_cast<int64_t>(dtype_nbytes(D));
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < cols; ++j) m = std::max(m, load<D>(row, j));
    float se[kLanes] = {}, sx[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= cols; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        float x = load<D>(row, j + l);
        se[l] += std::exp(x - m);
        sx[l] += x - m;
      }
    }
    for (int l = 0; j < cols; ++j, ++l) {
      float x = load<D>(row, j);
      se[l] += std::exp(x - m);
      sx[l] += x - m;
    }
    float sum_exp = 0.0f, sum_x = 0.0f;
    for (int l = 0; l < kLanes; ++l) {
      sum_exp += se[l];
      sum_x += sx[l];
    }
    const int64_t local_t = t - a.vocab_begin;
    *out[kStatMax] = m;
    *out[kStatSumExp] = sum_exp;
    *out[kStatTargetLogit] = local_t >= 0 && local_t < cols ? load<D>(row, local_t) : 0.0f;
    *out[kStatShiftedSum] = sum_x;
  }
}

template <DType D>
void backward_rows(const CrossEntropyArgs& a, const float* row_max, const float* row_sumexp, const float* grad_row,
                   float eps, void* grad_logits, int64_t lo, int64_t hi) {
  const int64_t cols = a.cols;
  const int64_t row_nbytes = cols * static_cast<int64_t>(dtype_nbytes(D));
  const float smooth = eps / static_cast<float>(a.vocab_total);
  const float hit = 1.0f - eps;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t t = a.target[i];
    void* g_row = static_cast<char*>(grad_logits) + i * row_nbytes;
    if (t == a.ignore_index) {
      std::memset(g_row, 0, static_cast<size_t>(row_nbytes));  // +0 in every float format
      continue;
    }
    check_target(a, i, t);
    const void* x_row = static_cast<const char*>(a.logits) + i * row_nbytes;
    const float m = row_max[i], inv_s = 1.0f / row_sumexp[i], g = grad_row[i];
    const int64_t local_t = t - a.vocab_begin;
    for (int64_t j = 0; j < cols; ++j) {
      float p = std::exp(load<D>(x_row, j) - m) * inv_s;
      float d = p - smooth - (j == local_t ? hit : 0.0f);
      store<D>(g_row, j, d * g);  // in place is safe: element j is read before it is written
    }
  }
}

int64_t rows_per_task(int64_t cols) { return std::max<int64_t>(1, kElemsPerTask / std::max<int64_t>(cols, 1)); }

}  // namespace

void cross_entropy_check_args(const CrossEntropyArgs& a, const char* what) {
  BMT_CHECK(a.rows >= 0, what, ": negative row count ", a.rows);
  BMT_CHECK(a.cols >= 1, what, ": the logits need at least one column (got ", a.cols, ")");
  BMT_CHECK(a.dtype == DType::kFloat32 || dtype_is_half(a.dtype), what, ": logits of dtype ", dtype_name(a.dtype),
            " are not supported; use float32, float16 or bfloat16");
  BMT_CHECK(a.vocab_begin >= 0 && a.vocab_begin + a.cols <= a.vocab_total, what, ": the logits' columns [",
            a.vocab_begin, ", ", a.vocab_begin + a.cols, ") are not inside the vocabulary [0, ", a.vocab_total, ")");
  BMT_CHECK(a.rows == 0 || (a.logits != nullptr && a.target != nullptr), what, ": null logits or target pointer");
}

void cross_entropy_stats_cpu(const CrossEntropyArgs& a, float* stats, ThreadPool& pool) {
  cross_entropy_check_args(a, "cross_entropy_stats_cpu");
  if (a.rows == 0) return;
  BMT_CHECK(stats != nullptr, "cross_entropy_stats_cpu: null statistics buffer");
  pool.parallel_for(a.rows, rows_per_task(a.cols), [&](int64_t lo, int64_t hi) {
    switch (a.dtype) {
      case DType::kFloat32: return stats_rows<DType::kFloat32>(a, stats, lo, hi);
      case DType::kBFloat16: return stats_rows<DType::kBFloat16>(a, stats, lo, hi);
      case DType::kFloat16: return stats_rows<DType::kFloat16>(a, stats, lo, hi);
      default: BMT_ASSERT(false, "dtype checked above");
    }
  });
}

void cross_entropy_backward_cpu(const CrossEntropyArgs& a, const float* row_max, const float* row_sumexp,
                                const float* grad_row, float label_smoothing, void* grad_logits, ThreadPool& pool) {
  cross_entropy_check_args(a, "cross_entropy_backward_cpu");
  if (a.rows == 0) return;
  BMT_CHECK(row_max && row_sumexp && grad_row && grad_logits, "cross_entropy_backward_cpu: null buffer pointer");
  pool.parallel_for(a.rows, rows_per_task(a.cols), [&](int64_t lo, int64_t hi) {
    switch (a.dtype) {
      case DType::kFloat32:
        return backward_rows<DType::kFloat32>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits, lo, hi);
      case DType::kBFloat16:
        return backward_rows<DType::kBFloat16>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits, lo, hi);
      case DType::kFloat16:
        return backward_rows<DType::kFloat16>(a, row_max, row_sumexp, grad_row, label_smoothing, grad_logits, lo, hi);
      default: BMT_ASSERT(false, "dtype checked above");
    }
  });
}

}  // namespace bmt::core::kernels
