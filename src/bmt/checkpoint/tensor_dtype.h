// at::ScalarType <-> the safetensors dtype names every checkpoint format of bmtrain uses (tensor_info.h).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace bmt::checkpoint {

// at::ScalarType <-> safetensors dtype names; unsupported types throw naming the context.
std::string dtype_name(at::ScalarType t);
at::ScalarType scalar_type_of(const std::string& dtype);

}  // namespace bmt::checkpoint
