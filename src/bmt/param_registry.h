// Per-parameter facts the optimizers and gradient utilities need, keyed by the parameter's TensorImpl
// (stable for the parameter's life, also across set_data):
//   main_grad    the gradient the optimizer must read (e.g. an fp32 shard gradient of a bf16 shard parameter);
//                when none is registered, the parameter's own .grad() is used.
//   replication  how many ranks of the world hold an identical copy of this parameter's local elements:
//                1 for ZeRO shards, tp for TP-replicated shards, world size for plain (unsharded) parameters.
//                Global reductions (grad norm, inf check) divide by it so every element counts once.
#pragma once

#include <ATen/ATen.h>

namespace bmt {

void set_main_grad(const at::Tensor& param, const at::Tensor& grad);
void clear_main_grad(const at::Tensor& param);
// The gradient to use for `param` (may be undefined when nothing was accumulated).
at::Tensor main_grad(const at::Tensor& param);

void set_replication(const at::Tensor& param, int copies);
// Registered value, else the world size (a plain parameter is replicated on every rank).
int replication(const at::Tensor& param);

// Forgets everything about a parameter (called when a Block is destroyed).
void forget_param(const at::Tensor& param);

}  // namespace bmt
