// ShardedStateProvider: how optimizer-like components take part in sharded checkpoints (with resharding).
//
// A provider exposes its state as an optim::StateDict (bmt/optim/flat_state_dict.h) following the convention of
// bmtrain's optimizers, plus "parameter spaces" telling which parameters its indices refer to. For each space
// (prefix P, parameters params[0..n)):
//   P + "state.<i>.<name>"  a tensor with the LOCAL shape of params[i] (e.g. exp_avg, exp_avg_sq, master) is a
//                           shard aligned with the parameter's local shard: it is saved with the parameter's global
//                           shape and element range, and on load re-cut for the new sharding (any world size, ZeRO
//                           level, Block or not; for a TP-split parameter the stacked-pieces layout of tp_layout.h,
//                           re-cut for another tp size like the parameter);
//   P + "state.<i>.<name>"  any other tensor (e.g. the 0-dim "step") is a per-parameter value, saved once;
//   P + "param.<i>.shape"   the local shape of params[i]; not saved, regenerated on load;
// every other key is global (the same on every rank; rank 0's value is saved). In the checkpoint, per-parameter
// state is keyed by the parameter's model name (not by index), so loading into a model whose parameters differ is
// detected and listed (unknown names, different global shapes), and param-group order may change.
// A space marked per_rank (e.g. a plain torch::optim optimizer, whose archive is opaque) is saved per rank and can
// only be loaded at the same world size.
//
// Adapters for OptimManager (its optimizers, LR schedulers and loss scale), BmtOptimizer (AdamOptimizer,
// AdamOffloadOptimizer) and a lone LR scheduler are provided; another component implements the interface.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bmt/checkpoint/checkpoint_reader.h"
#include "bmt/checkpoint/state_slices.h"
#include "bmt/optim/lr_scheduler.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/optim/optimizer.h"
#include "bmt/optim/flat_state_dict.h"

namespace bmt::checkpoint {

class ShardedStateProvider {
 public:
  struct ParamSpace {
    std::string prefix;
    std::vector<at::Tensor> params;
    bool per_rank = false;
    // load_state_dict takes meta placeholders for this space's per-parameter state tensors and state_views()
    // then returns the live tensors to fill (optim::BmtOptimizer::accepts_state_placeholders).
    bool state_placeholders = false;
  };
  virtual ~ShardedStateProvider() = default;
  virtual std::vector<ParamSpace> param_spaces() const = 0;
  // Must return fresh copies (host or device), never live state: async saves keep host tensors as their snapshot.
  virtual optim::StateDict state_dict() const = 0;
  // What a save writes: by default state_dict(). A provider may return views of its live state instead (no
  // copy; views_alias_live_state() true): a sync save writes them directly, an async save copies them into its
  // host snapshot before returning.
  virtual optim::StateDict state_views() const { return state_dict(); }
  virtual bool views_alias_live_state() const { return false; }
  virtual void load_state_dict(const optim::StateDict& sd) = 0;
};

std::shared_ptr<ShardedStateProvider> sharded_state(optim::OptimManager& manager);
std::shared_ptr<ShardedStateProvider> sharded_state(optim::BmtOptimizer& optimizer);
std::shared_ptr<ShardedStateProvider> sharded_state(optim::lr_scheduler::WarmupLRScheduler& scheduler);

// Save side: the provider's state as local slices under "<component>/...". `names` maps parameters to model names.
std::vector<LocalSlice> provider_slices(const std::string& component, const ShardedStateProvider& provider,
                                        const std::unordered_map<const void*, std::string>& names, int rank);

// A per-parameter state tensor of a placeholder space, read after load_state_dict straight into the live
// tensor state_views()[sd_key]: elements [begin, end) of `entry`.
struct DeferredStateRead {
  std::string sd_key;
  const EntryMeta* entry = nullptr;
  int64_t begin = 0, end = 0;
};

// Load side: rebuilds the provider's StateDict for this rank's current sharding from the checkpoint. Problems
// (unknown parameters, shape/dtype mismatches, missing entries) are appended to `errors`; the state dict is only
// meaningful when none were added. With `deferred`, the per-parameter state tensors of spaces marked
// state_placeholders that need no tp re-cut are not read: the state dict holds meta tensors of their shape and
// dtype, and `deferred` says where their values are.
optim::StateDict provider_state_from(const std::string& component, const ShardedStateProvider& provider,
                                     const std::unordered_map<const void*, std::string>& names, int rank,
                                     int world_size, CheckpointReader& reader, std::vector<std::string>& errors,
                                     std::vector<DeferredStateRead>* deferred = nullptr);

}  // namespace bmt::checkpoint
