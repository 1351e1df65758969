// Global gradient checks over (sharded) parameters: inf/NaN detection and norms, each with exactly one collective.
//
// Gradients are read with bmt::main_grad(p); parameters without a gradient, or with an empty local shard,
// contribute nothing. `comm` is the group the parameters are spread over (normally bmt::config().comm); nullptr
// means this process only. Every rank must call these collectively with its own local parameters.
//
// Invariants: a p-norm sums |g|^p of each local gradient divided by bmt::replication(p), so an element held by
// several ranks (a replicated or TP-replicated parameter) counts once in the global sum; the inf-norm is a max and
// needs no correction. Accumulation is in float64; the collective runs on the communicator's device kind.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "bmt/core/communicator.h"

namespace bmt::optim {

// True on every rank if any rank's gradient of any of `params` contains inf or NaN. One all_reduce(max).
bool grads_have_inf_nan(const std::vector<at::Tensor>& params, core::Communicator* comm);
// The same, agreeing over each of `comms` in turn (one all_reduce(max) each; nullptr entries are skipped), e.g. the
// sharding groups of one Block's parameters.
bool grads_have_inf_nan(const std::vector<at::Tensor>& params, const std::vector<core::Communicator*>& comms,
                        bool local_found = false);
// The same verdict without reading it on the host: a one-element float tensor (1 = some gradient is inf/NaN on some
// rank, else 0), already all-reduced over `comms`, on the device of the first communicator's reductions.
at::Tensor inf_nan_flag(const std::vector<at::Tensor>& params, const std::vector<core::Communicator*>& comms,
                        bool local_found = false);
// Without a collective or a host wait: ORs "some gradient of `params` is inf/NaN" into `device_flag` (an int32
// one-element tensor on the gradients' CUDA device, created when undefined) for CUDA gradients; returns the answer
// for CPU gradients.
bool accumulate_inf_nan_flag(const std::vector<at::Tensor>& params, at::Tensor& device_flag);

// The global norm_type-norm (finite p >= 1, or INFINITY) of the gradients of `params`. One all_reduce
// (sum for p-norms, max for the inf-norm). May return inf/NaN if a gradient overflowed.
double global_grad_norm(const std::vector<at::Tensor>& params, double norm_type, core::Communicator* comm);

// Multiplies every gradient of `params` by factor, in place.
void scale_grads(const std::vector<at::Tensor>& params, double factor);

}  // namespace bmt::optim
