// CPU twin of the FP8 scale and cast (fp8_cast_internal.h): plain loops, the reference of the CUDA test and the
// CPU path of nn::fp8_linear. The encoder rounds through double, where x / quantum is exact, so the rounding is
// exactly IEEE round-to-nearest-even at FP8's precision, what the CUDA conversion instruction does.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/core/kernels/float_elements_cpu_internal.h"
#include "bmt/core/kernels/fp8_cast_internal.h"

namespace bmt::core::kernels {
namespace {

struct Fp8Layout {
  int man_bits, bias;
  uint8_t max_bits;  // the largest finite value's encoding (sign clear)
};

Fp8Layout layout_of(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? Fp8Layout{3, 7, 0x7e} : Fp8Layout{2, 15, 0x7b};
}

constexpr uint8_t kNanBits = 0x7f;  // canonical NaN in both formats (what the CUDA conversion writes)

void check_dtype(DType dtype, const char* op) {
  BMT_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16, op, ": dtype ",
            dtype_name(dtype), " is not fp32, bf16 or fp16");
}

}  // namespace

float fp8_max(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

const char* fp8_format_name(Fp8Format format) { return format == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

uint8_t float_to_fp8(float x, Fp8Format format) {
  const Fp8Layout l = layout_of(format);
  if (std::isnan(x)) return kNanBits;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= fp8_max(format)) return sign | l.max_bits;  // saturate (inf included: the finite-saturating cast)
  if (a == 0.0) return sign;
  int e2 = 0;
  std::frexp(a, &e2);                          // a = m 2^e2, m in [0.5, 1): a's binade is 2^(e2 - 1)
  const int e = std::max(e2 - 1, 1 - l.bias);  // subnormals share the smallest normal binade's quantum
  const double quantum = std::ldexp(1.0, e - l.man_bits);
  double n = std::nearbyint(a / quantum);      // round half to even (the default rounding mode)
  const double one = std::ldexp(1.0, l.man_bits);
  if (n < one) return sign | static_cast<uint8_t>(n);  // subnormal (or rounded to 0)
  int field = e + l.bias;
  if (n >= 2 * one) ++field, n = one;  // rounded up into the next binade
  return sign | static_cast<uint8_t>((field << l.man_bits) | static_cast<int>(n - one));
}

float fp8_to_float(uint8_t bits, Fp8Format format) {
  const Fp8Layout l = layout_of(format);
  const int exp_bits = 7 - l.man_bits;
  const int field = (bits >> l.man_bits) & ((1 << exp_bits) - 1), man = bits & ((1 << l.man_bits) - 1);
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (format == Fp8Format::kE4M3 && field == 15 && man == 7) return std::numeric_limits<float>::quiet_NaN();
  if (format == Fp8Format::kE5M2 && field == 31)
    return man ? std::numeric_limits<float>::quiet_NaN() : sign * std::numeric_limits<float>::infinity();
  if (field == 0) return sign * static_cast<float>(std::ldexp(man, 1 - l.bias - l.man_bits));
  return sign * static_cast<float>(std::ldexp(1.0 + man / std::ldexp(1.0, l.man_bits), field - l.bias));
}

int64_t fp8_scale_workspace_numel(int64_t numel) {
  // One partial maximum per block of 256 threads x 16 elements, at most 1024 blocks (fixed: not the device's SMs).
  constexpr int64_t kPerBlock = 256 * 16, kMaxBlocks = 1024;
  return std::clamp<int64_t>((numel + kPerBlock - 1) / kPerBlock, 1, kMaxBlocks);
}

void fp8_scale_cpu(const void* x, DType dtype, int64_t numel, Fp8Format format, float* stats) {
  check_dtype(dtype, "fp8_scale_cpu");
  BMT_CHECK(numel >= 0 && stats && (numel == 0 || x), "fp8_scale_cpu: bad arguments (numel ", numel, ")");
  float amax = 0.0f;
  for (int64_t i = 0; i < numel; ++i) {
    const float v = std::fabs(static_cast<float>(load_float_element(x, dtype, i, "fp8_scale_cpu")));
    if (std::isnan(v)) {  // sticky: a NaN anywhere makes the tensor's amax NaN
      amax = v;
      break;
    }
    amax = std::max(amax, v);
  }
  stats[kFp8Amax] = amax;
  fp8_scale_of(amax, format, &stats[kFp8Scale], &stats[kFp8InvScale]);
}

void fp8_scale_of(float amax, Fp8Format format, float* scale, float* inv_scale) {
  float s = 1.0f, inv = 1.0f;
  if (!std::isfinite(amax)) {
    s = inv = std::numeric_limits<float>::quiet_NaN();
  } else if (amax > 0.0f) {
    s = std::min(fp8_max(format) / amax, FLT_MAX);  // (a subnormal amax would give inf)
    inv = 1.0f / s;
  }
  *scale = s;
  *inv_scale = inv;
}

void fp8_cast_cpu(const void* x, DType dtype, int64_t rows, int64_t cols, const float* stats, Fp8Format format,
                  uint8_t* q, uint8_t* qt) {
  check_dtype(dtype, "fp8_cast_cpu");
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_cpu: negative shape [", rows, ", ", cols, "]");
  BMT_CHECK(stats, "fp8_cast_cpu: null statistics");
  const float scale = stats[kFp8Scale];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = static_cast<float>(load_float_element(x, dtype, r * cols + c, "fp8_cast_cpu"));
      const uint8_t b = float_to_fp8(v * scale, format);
      if (q) q[r * cols + c] = b;
      if (qt) qt[c * rows + r] = b;
    }
  }
}

void fp8_cast_delayed_cpu(const void* x, DType dtype, int64_t rows, int64_t cols, const float* scale, float* amax_io,
                          Fp8Format format, uint8_t* q, uint8_t* qt) {
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_delayed_cpu: negative shape [", rows, ", ", cols, "]");
  BMT_CHECK(scale && amax_io, "fp8_cast_delayed_cpu: null scale or amax");
  float stats[3];
  fp8_scale_cpu(x, dtype, rows * cols, format, stats);  // (only its amax is used: the scale is the given one)
  const float amax = stats[kFp8Amax];
  if (std::isnan(amax) || (!std::isnan(*amax_io) && amax > *amax_io)) *amax_io = amax;
  stats[kFp8Scale] = *scale;
  fp8_cast_cpu(x, dtype, rows, cols, stats, format, q, qt);
}

void fp8_cast_rowwise_cpu(const void* x, DType dtype, int64_t rows, int64_t cols, Fp8Format format, uint8_t* q,
                          float* q_inv, uint8_t* qt, float* qt_inv) {
  check_dtype(dtype, "fp8_cast_rowwise_cpu");
  BMT_CHECK(rows >= 0 && cols >= 0, "fp8_cast_rowwise_cpu: negative shape [", rows, ", ", cols, "]");
  BMT_CHECK(!q == !q_inv && !qt == !qt_inv, "fp8_cast_rowwise_cpu: each copy needs its inverse scales");
  auto at = [&](int64_t r, int64_t c) {
    return std::fabs(static_cast<float>(load_float_element(x, dtype, r * cols + c, "fp8_cast_rowwise_cpu")));
  };
  // |v| compared as the CUDA kernels compare it (its bits as an unsigned integer): a NaN is above every number
  auto bigger = [](float a, float b) { return std::isnan(b) || (!std::isnan(a) && b > a); };
  std::vector<float> scale;
  if (q) {
    scale.assign(static_cast<size_t>(rows), 1.0f);
    for (int64_t r = 0; r < rows; ++r) {
      float amax = 0.0f;
      for (int64_t c = 0; c < cols; ++c)
        if (bigger(amax, at(r, c))) amax = at(r, c);
      fp8_scale_of(amax, format, &scale[r], &q_inv[r]);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        q[r * cols + c] = float_to_fp8(
            static_cast<float>(load_float_element(x, dtype, r * cols + c, "fp8_cast_rowwise_cpu")) * scale[r], format);
  }
  if (qt) {
    std::vector<float> amax(static_cast<size_t>(cols), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        if (bigger(amax[c], at(r, c))) amax[c] = at(r, c);
    scale.assign(static_cast<size_t>(cols), 1.0f);
    for (int64_t c = 0; c < cols; ++c) fp8_scale_of(amax[c], format, &scale[c], &qt_inv[c]);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        qt[c * rows + r] = float_to_fp8(
            static_cast<float>(load_float_element(x, dtype, r * cols + c, "fp8_cast_rowwise_cpu")) * scale[c], format);
  }
}

}  // namespace bmt::core::kernels
