// TensorInfo: name, dtype and shape of a tensor in a checkpoint file, torch-free. Dtypes are safetensors'
// names ("F32", "BF16", "I64", ...), used by every checkpoint format of bmtrain; tensor_dtype.h maps them to
// at::ScalarType.
//
// Invariants checked by checked_numel / checked_nbytes (used on untrusted headers): dimensions are >= 0 and the
// element and byte counts fit int64 (no overflow); unknown dtypes are rejected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bmt::checkpoint {

struct TensorInfo {
  std::string name;
  std::string dtype;            // safetensors name
  std::vector<int64_t> shape;
};

// Bytes per element of a safetensors dtype name; 0 when unknown.
int64_t dtype_element_nbytes(const std::string& dtype);
// Throws bmt::core::Error naming `ctx` on negative dimensions or int64 overflow.
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& ctx);
// numel * element size, overflow-checked; throws on unknown dtypes.
int64_t checked_nbytes(const std::string& dtype, const std::vector<int64_t>& shape, const std::string& ctx);
// "[2, 3]"
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace bmt::checkpoint
