// Module-level reads and writes of the parameters of models holding DistributedParameters (BMTrain's
// DistributedModule behaviour): state_dict / load_state_dict (full tensors under exactly the keys the unwrapped
// model has; loading scatters each value into the shards) and, declared in parameter.h, init_parameters. All three
// first wait for asynchronous optimizer updates (pending_update.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <map>
#include <string>

namespace bmt {

using StateDict = std::map<std::string, at::Tensor>;

// Full copies of every parameter and buffer (on CPU when to_cpu). Collective: every rank must call it.
StateDict state_dict(torch::nn::Module& module, bool to_cpu = true);

struct LoadResult {
  std::vector<std::string> missing_keys, unexpected_keys;
};
// strict: missing keys, unexpected keys and shape/dtype mismatches are reported together in one error.
LoadResult load_state_dict(torch::nn::Module& module, const StateDict& state, bool strict = true);

}  // namespace bmt
