// A minimal safetensors writer (https://github.com/huggingface/safetensors, format section):
//   8 bytes   little-endian uint64 N = header length in bytes
//   N bytes   JSON: {"__metadata__": {...}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...}
//             padded with spaces to a multiple of 8 bytes
//   rest      raw little-endian tensor bytes; offsets are relative to the end of the header, tensors back to back
// Names are written in the given order. Supported dtypes: F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace examples {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes atomically (temp file + rename). Tensors may live on any device; they are copied to CPU contiguous.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// The JSON header as written (without the length prefix and padding), for tests and tools.
std::string safetensors_header(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata);
const char* safetensors_dtype(at::ScalarType t);  // throws bmt::core::Error for unsupported types

// JSON string literal with escapes.
std::string json_quote(const std::string& s);

}  // namespace examples
