// The full (unsharded) fp32 value of a ZeRO-sharded parameter's main gradient, assembled from every rank's shard
// (collective over the parameter's communicator). For tensor-parallel pieces see tests/tp/tp_test_util.h.
#pragma once

#include <ATen/ATen.h>

#include "bmt/runtime/distributed.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"

namespace bmt::testing {

inline at::Tensor full_main_grad(const at::Tensor& param) {
  ParamMeta& m = meta_of(param);
  at::Tensor full = at::zeros({m.full_numel}, at::kFloat);
  at::Tensor g = main_grad(param);
  if (g.defined() && g.numel() > 0) full.narrow(0, m.shard_begin, g.numel()).copy_(g.reshape({-1}).to(at::kFloat));
  return distributed::raw_all_reduce(full, core::ReduceOp::kSum, *m.comm).view(m.full_shape);
}

}  // namespace bmt::testing
