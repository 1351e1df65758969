// Initialising parameters without a full model per rank (issue 16 item 5).
//
// Two paths, chosen per parameter by init_parameters:
//  * Built-in initialisers (bmt::init::normal, uniform, constant, zeros, ones, xavier_normal, xavier_uniform: what
//    bmt::nn's layers and the example models use) fill this rank's shard directly. Random values come from a
//    counter-based generator (core/philox.h): element i of a parameter is a function of (seed, the parameter's name
//    in named_parameters, i), with i its index in the whole logical tensor (also for tensor-parallel pieces). So a
//    rank computes only its own elements, no full tensor exists anywhere, and the model is bit-identical at every
//    world, tp and pipe size. The values differ from torch::nn::init's with the same seed.
//  * Any other InitMethod (an arbitrary function of the full tensor, BMTrain's init_method; from Python every
//    Python callable such as torch.nn.init.normal_) runs as before: on the whole logical tensor, one parameter at a
//    time, drawing from torch's default generator, and this rank keeps its part. Every rank draws every random
//    number of such parameters, so they equal the unsharded model's only while torch's generator is in the same
//    state on every rank (after at::manual_seed / torch.manual_seed, before the per-rank reseed below).
// InitParametersOptions::torch_generator sends built-in initialisers down the second path as well (values equal
// torch::nn::init's after at::manual_seed: the behaviour before this option existed).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <string>

#include "bmt/params/parameter.h"

namespace bmt {

struct InitParametersOptions {
  std::optional<uint64_t> seed;  // of the counter-based streams; default config().seed (InitOptions::seed)
  bool torch_generator = false;  // every initialiser on the full tensor with torch's default generator
};

// Initialises every DistributedParameter of `module` that has an init method (named_parameters order), then reseeds
// torch's generators per data-parallel rank (seed_per_data_parallel_rank). init_parameters(module) uses the
// default options.
void init_parameters(torch::nn::Module& module, const InitParametersOptions& options);

// True when `init` is one of bmt::init's initialisers (it fills shards directly).
bool is_builtin_init(const InitMethod& init);
// Fills this rank's elements of a DistributedParameter from a built-in initialiser's stream (seed, name).
void init_shard(const at::Tensor& param, const InitMethod& init, uint64_t seed, const std::string& name);
// The whole logical tensor a parameter called `name` gets from a built-in initialiser (what init_shard's elements
// are taken from): a reference for tests and tools; allocates the full tensor.
at::Tensor init_logical(const InitMethod& init, at::IntArrayRef logical_shape, at::ScalarType dtype, uint64_t seed,
                        const std::string& name);

}  // namespace bmt
