// Writing a list of named tensors as one safetensors file, through bmtrain's checkpoint writer
// (bmt/checkpoint/tensor_file.h, format in safetensors_format.h). Names are written in the given order.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace examples {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes atomically (temp file, fsync, rename). Tensors may live on any device; they are copied to CPU contiguous.
// Duplicate names and unsupported dtypes throw bmt::core::Error.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// The JSON header as written (without the length prefix and padding), for tests and tools.
std::string safetensors_header(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata);

// JSON string literal with escapes.
std::string json_quote(const std::string& s);

}  // namespace examples
