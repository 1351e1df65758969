// What a rank contributes to a checkpoint and where loaded values go, for the model and the RNG states.
//
// LocalSlice: elements [begin, end) of the flattened global tensor `decl.key`, held in `data` (numel == end -
// begin, any device, row-major order of the global tensor). LoadTarget: the same range of an entry, to be written
// into `dst` (whose logical row-major order is that range).
//
// Model entries use the unwrapped model's keys (bmt::state_dict's) under "model/": a DistributedParameter
// contributes its shard [shard_begin, shard_end) of full_shape (the same rule inside and outside Blocks);
// plain parameters and buffers are replicated, so every rank declares the whole tensor (the plan writes rank 0's
// copy once). Tensor-parallel split parameters are not supported yet (a clear error).
// RNG entries "rng/<rank>/cpu" and "rng/<rank>/cuda:<i>" hold a rank's generator states (uint8); they are restored
// only at the same world size (a different world size keeps the current, per-rank seeded generators).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "bmt/checkpoint/slice_plan.h"

namespace bmt::checkpoint {

struct LocalSlice {
  SliceDecl decl;
  at::Tensor data;
};

struct LoadTarget {
  std::string key;
  std::string dtype;           // required dtype (safetensors name)
  std::vector<int64_t> shape;  // required global shape
  int64_t begin = 0, end = 0;
  at::Tensor dst;
};

// at::ScalarType <-> safetensors dtype names; unsupported types throw naming the context.
std::string dtype_name(at::ScalarType t);
at::ScalarType scalar_type_of(const std::string& dtype);

// The unwrapped model's parameter and buffer names, by TensorImpl (stable across Block's set_data).
std::unordered_map<const void*, std::string> param_names(torch::nn::Module& model);

// Global shape and local element range of a parameter (DistributedParameter or plain tensor).
struct ParamRange {
  std::vector<int64_t> full_shape;
  int64_t begin = 0, end = 0;
};
ParamRange param_range(const at::Tensor& p, const std::string& name);

std::vector<LocalSlice> model_slices(torch::nn::Module& model, const std::string& prefix = "model/");
std::vector<LoadTarget> model_targets(torch::nn::Module& model, const std::string& prefix = "model/");

std::vector<LocalSlice> rng_slices(int rank);
// Restores the generators of `rank` from entries read by `read_entry(key)` (undefined tensor when absent).
// Returns the number of generators restored.
int restore_rng(int rank, const std::function<at::Tensor(const std::string&)>& read_entry);

}  // namespace bmt::checkpoint
