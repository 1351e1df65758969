// The scalar fp16 / bf16 <-> float conversions of bmt/core/dtype.h against torch's own c10::Half / c10::BFloat16
// (round to nearest even; NaNs compared by class, since payloads and quiet bits may legitimately differ).
#include <gtest/gtest.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "bmt/core/dtype.h"

namespace {

using namespace bmt::core;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
bool fp16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }
bool bf16_is_nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }

float ref_fp16_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
float ref_bf16_to_float(uint16_t b) { return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits())); }
uint16_t ref_float_to_fp16(float f) { return c10::Half(f).x; }
uint16_t ref_float_to_bf16(float f) { return c10::BFloat16(f).x; }

// Compares both conversions of one float; returns false (after one failure message) on a mismatch.
bool check_float(float f, int& failures) {
  bool ok = true;
  uint16_t h = float_to_fp16_bits(f), h_ref = ref_float_to_fp16(f);
  if (fp16_is_nan(h_ref) ? !fp16_is_nan(h) : h != h_ref) {
    if (failures++ < 10)
      ADD_FAILURE() << "float_to_fp16_bits(" << f << " = 0x" << std::hex << bits_of(f) << ") = 0x" << h
                    << ", torch says 0x" << h_ref;
    ok = false;
  }
  uint16_t b = float_to_bf16_bits(f), b_ref = ref_float_to_bf16(f);
  if (bf16_is_nan(b_ref) ? !bf16_is_nan(b) : b != b_ref) {
    if (failures++ < 10)
      ADD_FAILURE() << "float_to_bf16_bits(" << f << " = 0x" << std::hex << bits_of(f) << ") = 0x" << b
                    << ", torch says 0x" << b_ref;
    ok = false;
  }
  return ok;
}

}  // namespace

TEST(DType, Fp16ToFloatAllBitPatterns) {
  int failures = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t h = static_cast<uint16_t>(i);
    float got = fp16_bits_to_float(h), want = ref_fp16_to_float(h);
    bool ok = std::isnan(want) ? std::isnan(got) : bits_of(got) == bits_of(want);  // bits: -0 != +0
    if (!ok && failures++ < 10)
      ADD_FAILURE() << "fp16_bits_to_float(0x" << std::hex << i << ") = " << got << ", torch says " << want;
    EXPECT_EQ(std::isnan(got), fp16_is_nan(h));
  }
  EXPECT_EQ(failures, 0);
}

TEST(DType, Bf16ToFloatAllBitPatterns) {
  int failures = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t b = static_cast<uint16_t>(i);
    float got = bf16_bits_to_float(b), want = ref_bf16_to_float(b);
    bool ok = std::isnan(want) ? std::isnan(got) : bits_of(got) == bits_of(want);
    if (!ok && failures++ < 10)
      ADD_FAILURE() << "bf16_bits_to_float(0x" << std::hex << i << ") = " << got << ", torch says " << want;
  }
  EXPECT_EQ(failures, 0);
}

// Every half / bf16 value survives float and back; NaNs stay NaNs.
TEST(DType, RoundTripOfEveryBitPattern) {
  int failures = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t v = static_cast<uint16_t>(i);
    uint16_t h = float_to_fp16_bits(fp16_bits_to_float(v));
    uint16_t b = float_to_bf16_bits(bf16_bits_to_float(v));
    if ((fp16_is_nan(v) ? !fp16_is_nan(h) : h != v) && failures++ < 10)
      ADD_FAILURE() << "fp16 0x" << std::hex << i << " -> float -> 0x" << h;
    if ((bf16_is_nan(v) ? !bf16_is_nan(b) : b != v) && failures++ < 10)
      ADD_FAILURE() << "bf16 0x" << std::hex << i << " -> float -> 0x" << b;
  }
  EXPECT_EQ(failures, 0);
}

// The rounding-critical floats of every interval between two consecutive half (bf16) values: both ends, the
// exact midpoint (ties to even) and one float ulp either side of it; plus a few points inside.
TEST(DType, FloatToHalfAndBf16AtEveryRoundingBoundary) {
  int failures = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    uint16_t v = static_cast<uint16_t>(i);
    for (bool bf : {false, true}) {
      if (bf ? bf16_is_nan(v) : fp16_is_nan(v)) continue;
      float lo = bf ? ref_bf16_to_float(v) : ref_fp16_to_float(v);
      uint16_t next = static_cast<uint16_t>(v + 1);  // the next larger magnitude, same sign
      if ((v & 0x7fffu) == 0x7fffu) continue;
      float hi = bf ? ref_bf16_to_float(next) : ref_fp16_to_float(next);
      if (std::isinf(lo)) continue;
      if (std::isnan(hi)) continue;
      float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);  // exact: one more mantissa bit
      if (std::isinf(hi)) {
        // Beyond the largest finite value: the midpoint towards infinity, computed in double.
        mid = static_cast<float>(static_cast<double>(lo) + (static_cast<double>(lo) - (bf ? ref_bf16_to_float(v - 1) : ref_fp16_to_float(v - 1))) / 2);
      }
      for (float f : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 2 * mid), std::nextafter(lo, 2 * lo),
                      static_cast<float>(lo + (mid - lo) / 3), static_cast<float>(mid + (mid - lo) / 2)}) {
        check_float(f, failures);
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(DType, FloatToHalfAndBf16RandomAndSpecial) {
  int failures = 0;
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::signaling_NaN(),
                            float_of(0x7f800001u), float_of(0xffbfffffu), std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::denorm_min(), 65504.0f, 65519.99f, 65520.0f, 65536.0f,
                            -65520.0f, 5.9604645e-08f /* 2^-24 */, 2.9802322e-08f /* 2^-25 */, 2.9802326e-08f,
                            6.1035156e-05f /* 2^-14 */, 6.1035152e-05f, 3.3895314e38f, 3.3961775e38f, 1.0f,
                            -1.0f, 1.0009766f, 1.0004883f, 3.0f, 0.1f, -2.5f};
  for (float f : specials) check_float(f, failures);
  std::mt19937 rng(1234);
  for (int k = 0; k < 2000000; ++k) check_float(float_of(static_cast<uint32_t>(rng())), failures);  // any bits
  std::uniform_real_distribution<float> wide(-70000.0f, 70000.0f), unit(-1.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1e-4f);
  for (int k = 0; k < 300000; ++k) {
    check_float(wide(rng), failures);
    check_float(unit(rng), failures);
    check_float(normal(rng), failures);  // many half subnormals
  }
  EXPECT_EQ(failures, 0);
}

TEST(DType, SizesAndNamesMatchTorch) {
  const std::pair<DType, at::ScalarType> pairs[] = {
      {DType::kFloat32, at::kFloat}, {DType::kFloat16, at::kHalf}, {DType::kBFloat16, at::kBFloat16},
      {DType::kInt64, at::kLong},    {DType::kInt32, at::kInt},    {DType::kUInt8, at::kByte},
      {DType::kFloat64, at::kDouble}};
  for (auto [dt, st] : pairs) {
    EXPECT_EQ(dtype_nbytes(dt), c10::elementSize(st)) << dtype_name(dt);
    EXPECT_EQ(dtype_is_half(dt), st == at::kHalf || st == at::kBFloat16) << dtype_name(dt);
  }
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kFloat16), "float16");
  EXPECT_THROW(dtype_nbytes(static_cast<DType>(42)), bmt::core::InternalError);
}
