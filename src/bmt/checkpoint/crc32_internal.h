// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF: the zlib / PNG / zip
// value), slicing-by-8, torch-free. crc32(data) == crc32_update(crc32_update(0, a), b) for data = a + b, so
// checksums can be computed while streaming.
#pragma once

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

// 8 lowercase hex digits.
std::string crc32_hex(uint32_t crc);

}  // namespace bmt::checkpoint
