// DistributedParameter: a parameter tensor that holds only this rank's shard of the flattened full tensor.
//
// Layout: the full tensor (shape `full_shape`, `full_numel` elements) is flattened and cut into `comm->size()`
// contiguous chunks of ceil(full_numel / size) elements in rank order; rank r holds [shard_begin, shard_end)
// (the last ranks may hold fewer or zero elements). The registered tensor is 1-D with shard_end - shard_begin
// elements. Inside a Block the tensor's storage is re-pointed into the Block's flat shard (same element range
// rule, over the Block's packed layout), and while the Block runs it temporarily holds the full tensor.
//
// Metadata lives in a registry keyed by the tensor's TensorImpl, so ordinary torch::nn::Module code can hold
// and register these tensors like any parameter.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <vector>

#include "bmt/core/communicator.h"

namespace bmt {

class Block;

// Fills a full-size tensor in place; runs once per parameter in init_parameters().
using InitMethod = std::function<void(at::Tensor& full)>;

namespace init {
InitMethod normal(double mean, double std);
InitMethod uniform(double low, double high);
InitMethod constant(double value);
InitMethod zeros();
InitMethod ones();
InitMethod xavier_normal();
}  // namespace init

struct ParamMeta {
  std::vector<int64_t> full_shape;
  int64_t full_numel = 0;
  at::ScalarType dtype = at::kFloat;
  std::shared_ptr<core::Communicator> comm;  // the group the parameter is sharded over
  int64_t shard_begin = 0;                    // element range of the flattened full tensor held here
  int64_t shard_end = 0;
  InitMethod init_method;
  int tp_split_dim = -1;  // tensor parallelism: dim along which the logical tensor is split (-1: not split)
  int tp_size = 1;
  Block* block = nullptr;  // the Block owning this parameter's storage, if any
};

// Creates a sharded parameter of `full_shape` on the configured device (only the shard is allocated).
// Default communicator: config().zero_comm. requires_grad defaults to true.
at::Tensor DistributedParameter(at::IntArrayRef full_shape, at::ScalarType dtype, InitMethod init_method,
                                bool requires_grad = true, std::shared_ptr<core::Communicator> comm = nullptr);
// Shards an existing full tensor (every rank must pass the same values).
at::Tensor DistributedParameter(const at::Tensor& full, bool requires_grad = true,
                                std::shared_ptr<core::Communicator> comm = nullptr);

bool is_distributed_param(const at::Tensor& param);
// Throws when `param` is not a DistributedParameter.
ParamMeta& meta_of(const at::Tensor& param);
ParamMeta* find_meta(const at::Tensor& param);

// Differentiable: the full tensor (full_shape). If the parameter is currently gathered by its Block, returns it
// as is; otherwise all-gathers it once (call once per forward and reuse the result). The backward
// reduce-scatters the gradient (fp32 for half dtypes) into the parameter's main_grad shard.
at::Tensor gathered(const at::Tensor& param);
// Non-differentiable full copy (for state_dict, checkpoints, tests).
at::Tensor gather_full(const at::Tensor& param);
// Copies this rank's slice of `full` (full_shape, any device/dtype) into the parameter.
void scatter_full(const at::Tensor& param, const at::Tensor& full);

// Initialises every DistributedParameter of `module` (recursively, in named_parameters order) with its
// init_method applied to a full-size tensor generated on this rank, keeping only the local shard, so the
// result is bit-identical to initialising the unwrapped model with the same seed. At most one full parameter
// exists at a time. Then reseeds per data-parallel rank (seed_per_data_parallel_rank).
void init_parameters(torch::nn::Module& module);

// The fp32 (or param-dtype, when fp32) gradient shard of a DistributedParameter, allocated zeroed on first use.
at::Tensor ensure_main_grad(const at::Tensor& param);

}  // namespace bmt
