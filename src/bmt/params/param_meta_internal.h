// The registration of a DistributedParameter's ParamMeta in its per-tensor record (param_meta.cpp), used by
// parameter.cpp when it creates one, and the lazy main gradients of Blocks. Not installed.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>

#include "bmt/params/param_meta.h"

namespace bmt {

// Sets (or replaces) t's ParamMeta; drops the records of dead tensors first.
void register_meta(const at::Tensor& t, std::shared_ptr<ParamMeta> meta);
// Removes t's whole record and returns its ParamMeta (nullptr when t is not a DistributedParameter).
std::shared_ptr<ParamMeta> take_meta(const at::Tensor& t);

// A gradient allocated on first use (a Block's gradient shard): when no main grad is set, main_grad(param) calls
// `allocate` first, which may set one (zeros: no gradient accumulated yet). Cleared by forget_param.
void set_lazy_main_grad(const at::Tensor& param, std::function<void()> allocate);
// main_grad without allocating a lazy gradient (zero_grad: zeroing one that does not exist yet is a no-op).
at::Tensor peek_main_grad(const at::Tensor& param);

}  // namespace bmt
