#include "bmt/core/philox.h"

#include <cmath>

#include "bmt/core/error.h"

namespace bmt::core {
namespace {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments
constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInv2Pow32 = 1.0 / 4294967296.0;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

inline double unit_uniform(uint32_t word) { return (static_cast<double>(word) + 0.5) * kInv2Pow32; }

PhiloxCounter block_words(const RandomStream& s, uint64_t block) {
  const PhiloxCounter ctr{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                          static_cast<uint32_t>(s.stream), static_cast<uint32_t>(s.stream >> 32)};
  return philox4x32_10(ctr, {static_cast<uint32_t>(s.seed), static_cast<uint32_t>(s.seed >> 32)});
}

// The four unit variates of one block.
std::array<double, 4> block_variates(const RandomStream& s, uint64_t block) {
  const PhiloxCounter w = block_words(s, block);
  std::array<double, 4> v;
  if (s.dist == RandomDist::kUniform) {
    for (int k = 0; k < 4; ++k) v[k] = unit_uniform(w[k]);
    return v;
  }
  for (int k = 0; k < 4; k += 2) {
    const double r = std::sqrt(-2.0 * std::log(unit_uniform(w[k])));
    const double theta = kTwoPi * unit_uniform(w[k + 1]);
    v[k] = r * std::cos(theta);
    v[k + 1] = r * std::sin(theta);
  }
  return v;
}

void store(double value, DType dtype, void* out, int64_t j) {
  switch (dtype) {
    case DType::kFloat64: static_cast<double*>(out)[j] = value; return;
    case DType::kFloat32: static_cast<float*>(out)[j] = static_cast<float>(value); return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(out)[j] = float_to_bf16_bits(static_cast<float>(value));
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(out)[j] = float_to_fp16_bits(static_cast<float>(value));
      return;
    default: break;
  }
  BMT_ERROR("random_fill: dtype ", dtype_name(dtype), " is not a floating type; initialise it with a constant");
}

}  // namespace

PhiloxCounter philox4x32_10(PhiloxCounter x, PhiloxKey key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kWeyl0;
      key[1] += kWeyl1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, x[0], hi0, lo0);
    mulhilo(kMul1, x[2], hi1, lo1);
    x = {hi1 ^ x[1] ^ key[0], lo1, hi0 ^ x[3] ^ key[1], lo0};
  }
  return x;
}

double random_value(const RandomStream& s, int64_t i) {
  BMT_CHECK(i >= 0, "random_value: negative element index ", i);
  return s.shift + s.scale * block_variates(s, static_cast<uint64_t>(i) / 4)[static_cast<size_t>(i % 4)];
}

void random_fill(const RandomStream& s, int64_t first, int64_t count, DType dtype, void* out) {
  BMT_CHECK(first >= 0 && count >= 0, "random_fill: bad element range [", first, ", ", first + count, ")");
  int64_t j = 0;
  while (j < count) {
    const int64_t i = first + j;
    const std::array<double, 4> v = block_variates(s, static_cast<uint64_t>(i) / 4);
    for (int64_t lane = i % 4; lane < 4 && j < count; ++lane, ++j) store(s.shift + s.scale * v[lane], dtype, out, j);
  }
}

uint64_t stream_of_name(const char* name, size_t nbytes) {
  uint64_t h = 1469598103934665603ull;
  for (size_t k = 0; k < nbytes; ++k) h = (h ^ static_cast<unsigned char>(name[k])) * 1099511628211ull;
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

}  // namespace bmt::core
