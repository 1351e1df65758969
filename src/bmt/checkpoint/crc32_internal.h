// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF: the zlib / PNG / zip
// value), slicing-by-16, torch-free. crc32(data) == crc32_update(crc32_update(0, a), b) for data = a + b, so
// checksums can be computed while streaming, and independent pieces in parallel (joined with crc32_combine).
// The algorithm is the on-disk checksum of every checkpoint written so far: it must not change.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace bmt::checkpoint {

// Continues `crc` (0 for a fresh checksum) over nbytes bytes.
uint32_t crc32_update(uint32_t crc, const void* data, size_t nbytes);
inline uint32_t crc32(const void* data, size_t nbytes) { return crc32_update(0, data, nbytes); }

// The CRC of A followed by B from crc(A), crc(B) and len(B): crc(A) advanced over len(B) zero bytes (a 32x32
// matrix over GF(2), raised to the power by repeated squaring), xor crc(B). Cost grows with log2(len(B)).
uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, int64_t nbytes_b);

// crc32_combine for one fixed len(B), with the matrix computed once: 32 xors per combine (joining thousands
// of equal-sized checksum blocks into a whole-file CRC).
class Crc32Combiner {
 public:
  explicit Crc32Combiner(int64_t nbytes_b);
  uint32_t combine(uint32_t crc_a, uint32_t crc_b) const;
  int64_t nbytes_b() const { return nbytes_b_; }

 private:
  int64_t nbytes_b_;
  std::array<uint32_t, 32> shift_{};
};

// 8 lowercase hex digits.
std::string crc32_hex(uint32_t crc);

}  // namespace bmt::checkpoint
