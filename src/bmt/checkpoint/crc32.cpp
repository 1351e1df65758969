#include "bmt/checkpoint/crc32_internal.h"

#include <array>
#include <cstring>

namespace bmt::checkpoint {
namespace {

using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, size_t nbytes) {
  const Tables& t = tables();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (nbytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian hosts only (x86-64, aarch64)
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
    p += 8;
    nbytes -= 8;
  }
  while (nbytes-- > 0) c = t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
  return ~c;
}

namespace {

// A linear map on 32-bit CRC registers as 32 columns: column k is the image of bit k.
using Gf2Matrix = std::array<uint32_t, 32>;

uint32_t gf2_apply(const Gf2Matrix& m, uint32_t v) {
  uint32_t out = 0;
  for (int k = 0; v != 0; ++k, v >>= 1)
    if (v & 1u) out ^= m[static_cast<size_t>(k)];
  return out;
}

Gf2Matrix compose(const Gf2Matrix& a, const Gf2Matrix& b) {  // a after b
  Gf2Matrix out{};
  for (size_t k = 0; k < 32; ++k) out[k] = gf2_apply(a, b[k]);
  return out;
}

}  // namespace

uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, int64_t nbytes_b) {
  if (nbytes_b <= 0) return crc_a ^ crc_b;
  // One zero bit through the reflected register: shift right, fold the polynomial in when bit 0 falls out.
  Gf2Matrix step{};
  step[0] = 0xEDB88320u;
  for (size_t k = 1; k < 32; ++k) step[k] = 1u << (k - 1);
  Gf2Matrix zero_byte = step;
  for (int i = 0; i < 3; ++i) zero_byte = compose(zero_byte, zero_byte);  // 2^3 = 8 bits
  // Raw registers (no pre/post inversion) are linear, and the inversions of A's and B's CRCs cancel here.
  uint32_t reg = crc_a;
  Gf2Matrix power = zero_byte;
  for (uint64_t n = static_cast<uint64_t>(nbytes_b); n != 0; n >>= 1) {
    if (n & 1u) reg = gf2_apply(power, reg);
    if (n > 1) power = compose(power, power);
  }
  return reg ^ crc_b;
}

std::string crc32_hex(uint32_t crc) {
  static const char* digits = "0123456789abcdef";
  std::string s(8, '0');
  for (int i = 7; i >= 0; --i, crc >>= 4) s[i] = digits[crc & 0xFu];
  return s;
}

}  // namespace bmt::checkpoint
