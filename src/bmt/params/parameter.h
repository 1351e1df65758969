// DistributedParameter: a parameter tensor that holds only this rank's shard of the flattened full tensor.
//
// Layout: the full tensor (shape `full_shape`, `full_numel` elements) is flattened and cut into `comm->size()`
// contiguous chunks of ceil(full_numel / size) elements in rank order; rank r holds [shard_begin, shard_end)
// (the last ranks may hold fewer or zero elements). The registered tensor is 1-D with shard_end - shard_begin
// elements. Inside a Block the tensor's storage is re-pointed into the Block's flat shard (same element range
// rule, over the Block's packed layout), and while the Block runs it temporarily holds the full tensor.
//
// Metadata (ParamMeta, param_meta.h) lives in a registry keyed by the tensor's TensorImpl, so ordinary
// torch::nn::Module code can hold and register these tensors like any parameter.
//
// Tensor parallelism (tp_size > 1): a TP-split parameter (TensorParallelParameter) has a logical shape that is
// cut along `tp_split_dim` into tp_size equal pieces; tp rank r owns piece r (with tp_split_groups > 1, e.g. a
// fused Q/K/V projection: slice r of every block), and `full_shape` is the piece's shape. The piece is
// ZeRO-sharded over config().tp_zero_comm (the data-parallel group). A parameter that is not split is replicated
// over the tp group (one copy per tp rank, each ZeRO-sharded over tp_zero_comm); after its gradient is
// reduce-scattered, the gradient shard is all-reduced over config().tp_comm (tp_grad_reduce: kSum when each tp rank
// computed a partial gradient, as under sequence parallelism; kAvg when each computed the whole, identical
// gradient, as with replicated activations), so the copies never diverge.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bmt/core/communicator.h"
#include "bmt/params/param_meta.h"

namespace bmt {

// Creates a sharded parameter of `full_shape` on the configured device (only the shard is allocated).
// Default communicator: config().tp_zero_comm (= the stage's zero_comm when tp_size == 1); with tp_size > 1 the
// parameter is replicated over the tp group, its tp_grad_reduce defaulting to config().sequence_parallel ? kSum :
// kAvg. requires_grad defaults to true.
at::Tensor DistributedParameter(at::IntArrayRef full_shape, at::ScalarType dtype, InitMethod init_method,
                                bool requires_grad = true, std::shared_ptr<core::Communicator> comm = nullptr);
// Shards an existing full tensor (every rank must pass the same values).
at::Tensor DistributedParameter(const at::Tensor& full, bool requires_grad = true,
                                std::shared_ptr<core::Communicator> comm = nullptr);

// A tensor-parallel parameter: `logical_shape` is split along `split_dim` over config().tp_comm (the size must be
// divisible by tp_size; `who` names the layer in the error), and this rank's piece is ZeRO-sharded over
// tp_zero_comm. init_method receives the whole logical tensor (identical on every rank), so initialisation equals
// the unsplit model's. split_groups > 1: the split dim holds that many equal blocks (fused Q/K/V: 3), each split
// over tp separately (ParamMeta::tp_split_groups; every block's size must be divisible by tp_size).
at::Tensor TensorParallelParameter(at::IntArrayRef logical_shape, int split_dim, at::ScalarType dtype,
                                   InitMethod init_method, bool requires_grad = true, const std::string& who = "",
                                   int64_t split_groups = 1);

// Sets how the gradient copies of a tp-replicated parameter combine (no effect on TP-split parameters or when
// tp_size == 1). Call before the parameter's module is wrapped in a Block.
void set_tp_grad_reduce(const at::Tensor& param, TpGradReduce reduce);
// The same for every replicated DistributedParameter of `module` (recursively).
void set_tp_grad_reduce(torch::nn::Module& module, TpGradReduce reduce);

// Makes `target`, an existing tensor object (e.g. the one a Python torch.nn.Parameter wraps: torch.nn.Parameter(t)
// makes a new TensorImpl, so a record made for `t` would not be found for it), the DistributedParameter that
// `created` is: its shard storage and its record move over, and `created` is forgotten. `target` keeps its
// requires_grad. Neither may belong to a Block yet.
void adopt_distributed_parameter(const at::Tensor& target, const at::Tensor& created);

// Moves a standalone DistributedParameter onto another sharding group `comm` in place (the same tensor object keeps
// its record, init method and requires_grad; its shard is re-cut over `comm`). Collective over the parameter's
// current group (it gathers the full value once), then local. Used when a pipeline stage takes a layer built over
// the whole world (BMTrain's Python builds every layer on every rank) into its own data-parallel group.
void reshard_distributed_parameter(const at::Tensor& param, std::shared_ptr<core::Communicator> comm);

// Differentiable: the full tensor (full_shape). If the parameter is currently gathered by its Block, returns it
// as is; otherwise all-gathers it once (call once per forward and reuse the result). The backward
// reduce-scatters the gradient (fp32 for half dtypes) into the parameter's main_grad shard.
at::Tensor gathered(const at::Tensor& param);
// Non-differentiable full copy (for state_dict, checkpoints, tests).
at::Tensor gather_full(const at::Tensor& param);
// Copies this rank's slice of `full` (full_shape, any device/dtype) into the parameter.
void scatter_full(const at::Tensor& param, const at::Tensor& full);
// The whole logical tensor: gather_full, then (TP-split parameters) all-gathered over config().tp_comm and
// concatenated along the split dimension — a collective over the tp group.
at::Tensor gather_logical(const at::Tensor& param);
// Writes this rank's part of the logical tensor (logical_shape) into the parameter (no communication).
void scatter_logical(const at::Tensor& param, const at::Tensor& logical);
// The layout of TP-split parameters without communication: the logical tensor from every tp rank's piece (in tp
// rank order), and tp rank `tp_rank`'s piece of a logical tensor (honouring tp_split_groups). Identity for
// parameters that are not split.
at::Tensor logical_from_pieces(const ParamMeta& m, const std::vector<at::Tensor>& pieces);
at::Tensor piece_of_logical(const ParamMeta& m, const at::Tensor& logical, int tp_rank);
// Internal (Blocks, gathered()): all-reduces a reduced gradient shard over config().tp_comm as `reduce` says, on
// the tensor's current stream (no-op for kNone or tp_size 1).
void reduce_over_tp(at::Tensor& grad_shard, TpGradReduce reduce);

// Initialises every DistributedParameter of `module` that has an init method (named_parameters order): bmt::init's
// initialisers fill this rank's shard directly from a counter-based stream (seed, name, element index), the same
// values at every world/tp/pipe size; custom init methods run on the full logical tensor with torch's generator,
// one parameter at a time, keeping the shard. Then reseeds per data-parallel rank (seed_per_data_parallel_rank).
// Options (seed, torch_generator) and the details: bmt/param_init.h (param_init.cpp).
void init_parameters(torch::nn::Module& module);
// As init_parameters with `seed`, but custom init methods draw from a torch generator seeded from `seed` and the
// name (FNV-1a): their values depend only on the name, not on which other parameters this rank holds, so a pipelined
// model (each stage holds some layers) gets the same weights at every pipe_size. Then seeds per data-parallel rank.
void init_parameters_by_name(torch::nn::Module& module, uint64_t seed);

// The fp32 (or param-dtype, when fp32) gradient shard of a DistributedParameter, allocated zeroed on first use.
at::Tensor ensure_main_grad(const at::Tensor& param);

}  // namespace bmt
