// The registration of a DistributedParameter's ParamMeta in its per-tensor record (param_registry.cpp); used by
// parameter.cpp when it creates one. Not installed.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "bmt/parameter.h"

namespace bmt {

// Sets (or replaces) t's ParamMeta; drops the records of dead tensors first.
void register_meta(const at::Tensor& t, std::shared_ptr<ParamMeta> meta);
// Removes t's whole record and returns its ParamMeta (nullptr when t is not a DistributedParameter).
std::shared_ptr<ParamMeta> take_meta(const at::Tensor& t);

}  // namespace bmt
