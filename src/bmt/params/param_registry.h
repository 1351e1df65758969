// Per-parameter facts the optimizers and gradient utilities need. They live in one record per tensor together with
// a DistributedParameter's ParamMeta (parameter.h), keyed by the tensor's TensorImpl (stable for the parameter's
// life, also across set_data; tensor_registry.h):
//   main_grad    the gradient the optimizer must read (e.g. an fp32 shard gradient of a bf16 shard parameter);
//                when none is registered, the parameter's own .grad() is used.
//   replication  how many ranks of the world hold an identical copy of this parameter's local elements:
//                1 for ZeRO shards, tp for TP-replicated shards, world size for plain (unsharded) parameters.
//                Global reductions (grad norm, inf check) divide by it so every element counts once.
#pragma once

#include <ATen/ATen.h>

namespace bmt {

void set_main_grad(const at::Tensor& param, const at::Tensor& grad);
// The gradient to use for `param` (may be undefined when nothing was accumulated).
at::Tensor main_grad(const at::Tensor& param);

void set_replication(const at::Tensor& param, int copies);
// Registered value, else the world size (a plain parameter is replicated on every rank).
int replication(const at::Tensor& param);

// Forgets the main grad and the replication of a parameter (a Block being destroyed; tests). A
// DistributedParameter keeps its ParamMeta.
void forget_param(const at::Tensor& param);

}  // namespace bmt
