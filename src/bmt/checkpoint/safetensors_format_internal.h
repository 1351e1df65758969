// The safetensors container, torch-free: building and parsing its header.
//
// Layout: u64 little-endian N, then N bytes of UTF-8 JSON {"__metadata__": {str: str}, name: {"dtype": str,
// "shape": [int...], "data_offsets": [begin, end]}, ...}, then the data buffer; offsets are relative to the buffer
// start (byte 8 + N).
//
// Parser invariants (it reads untrusted input and is fuzzed), as the reference Rust implementation checks:
// 8 <= file size, N <= kMaxHeaderNbytes and 8 + N <= file size; the JSON is an object of tensor entries with known
// dtypes and non-negative shapes; end - begin == numel * element size (overflow-checked); sorted by begin the
// tensors are contiguous from 0 and the last ends exactly at the end of the file. Violations throw
// bmt::core::Error naming `what`.
// The writer pads the JSON with spaces to a multiple of 8 bytes (so the data buffer is 8-byte aligned) and lays
// tensors out contiguously in the given order.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "bmt/checkpoint/tensor_info.h"

namespace bmt::checkpoint {

constexpr int64_t kSafetensorsMaxHeaderNbytes = 100'000'000;

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;     // in data order
  std::vector<int64_t> data_offsets;   // begin of tensors[i] relative to data_start_nbytes
  std::map<std::string, std::string> metadata;
  int64_t data_start_nbytes = 0;       // 8 + N
};

// Reads N from the first 8 bytes and checks it against the file size; returns N.
int64_t safetensors_header_nbytes(const uint8_t first8[8], int64_t file_nbytes, const std::string& what);
// Parses the JSON header (N bytes that followed the length) of a file of file_nbytes bytes.
SafetensorsHeader parse_safetensors_json(std::string_view json, int64_t file_nbytes, const std::string& what);
// Both steps over a buffer holding (at least) the first 8 + N bytes of a file of file_nbytes bytes.
SafetensorsHeader parse_safetensors_prefix(const uint8_t* data, size_t nbytes, int64_t file_nbytes,
                                           const std::string& what);

// The bytes that precede the data buffer: u64 N + padded JSON. Tensors are laid out in the given order.
std::string build_safetensors_header(const std::vector<TensorInfo>& tensors,
                                     const std::map<std::string, std::string>& metadata);

}  // namespace bmt::checkpoint
