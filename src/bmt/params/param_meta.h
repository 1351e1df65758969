// A parameter's record: one per tensor, keyed by the tensor's TensorImpl (stable for the parameter's life, also
// across set_data; tensor_registry_internal.h), thread-safe (param_meta.cpp). It holds
//   ParamMeta    a DistributedParameter's layout (shape, shard range, communicator, tensor-parallel piece), its
//                init method, its owning Block and its pending optimizer update (pending_update.h);
//   main_grad    the gradient the optimizer must read (e.g. an fp32 shard gradient of a bf16 shard parameter);
//                when none is registered, the parameter's own .grad() is used;
//   replication  how many ranks of the world hold an identical copy of this parameter's local elements:
//                1 for ZeRO shards, tp for TP-replicated shards, world size for plain (unsharded) parameters.
//                Global reductions (grad norm, inf check) divide by it so every element counts once.
// Everything else in params/ (parameter.h: creating, gathering, scattering; param_init.h: initialising;
// pending_update.h: the asynchronous-update lock; module_state.h) builds on this header.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "bmt/core/communicator.h"

namespace bmt {

class PendingUpdate;

// What parameter.cpp asks of the owner of a parameter's storage (a Block, which implements it). The owner
// packs its parameters into flat shards and gathers them while it runs.
class ParamOwner {
 public:
  // The owner's parameters currently point at their full tensors.
  virtual bool is_gathered() const = 0;
  // Full value of one of the owner's parameters (a copy; collective over the owner's communicator).
  virtual at::Tensor gather_param_copy(const at::Tensor& param) = 0;
  // Writes this rank's part of `full` into one of the owner's parameters.
  virtual void scatter_param(const at::Tensor& param, const at::Tensor& full) = 0;

 protected:
  ~ParamOwner() = default;
};

// Fills a full-size tensor in place (bmt::init's built-ins are recognised and fill shards instead: param_init.h).
using InitMethod = std::function<void(at::Tensor& full)>;

// bmt::init's built-in initialisers (param_init.cpp): recognised by init_parameters, which fills shards from their
// counter-based streams.
namespace init {
InitMethod normal(double mean, double std);
InitMethod uniform(double low, double high);
InitMethod constant(double value);
InitMethod zeros();
InitMethod ones();
InitMethod xavier_normal();
InitMethod xavier_normal(double gain);
InitMethod xavier_uniform(double gain = 1.0);
}  // namespace init

enum class TpGradReduce { kNone, kSum, kAvg };

struct ParamMeta {
  std::vector<int64_t> full_shape;  // this tp rank's piece (the logical shape unless TP-split)
  int64_t full_numel = 0;
  at::ScalarType dtype = at::kFloat;
  std::shared_ptr<core::Communicator> comm;  // the group the parameter is sharded over
  int64_t shard_begin = 0;                    // element range of the flattened full tensor held here
  int64_t shard_end = 0;
  InitMethod init_method;
  int tp_split_dim = -1;  // tensor parallelism: dim along which the logical tensor is split (-1: not split)
  // The split dim is tp_split_groups equal blocks (e.g. a fused Q/K/V projection: 3), each cut into tp_size
  // slices; the piece of tp rank r is slice r of every block, in block order (1: one contiguous piece per rank).
  int64_t tp_split_groups = 1;
  int tp_size = 1;        // number of pieces (Config::tp_size for split parameters, else 1)
  int tp_rank = 0;        // the piece held here
  TpGradReduce tp_grad_reduce = TpGradReduce::kNone;  // replicated over tp > 1: how gradient copies combine
  // Outside a Block: the dtype of the gradient shard (main_grad). Unset: fp32 for fp16/bf16 parameters, else the
  // parameter's dtype. When it equals the parameter's dtype, .grad is the shard too (BMTrain's Python API sets
  // it to the parameter's dtype; inside a Block, BlockOptions::reduce_dtype decides).
  std::optional<at::ScalarType> grad_dtype;
  ParamOwner* block = nullptr;  // the Block owning this parameter's storage, if any
  // An asynchronous optimizer update still running on this parameter (see pending_update.h, the only code that
  // touches it, under its lock).
  std::shared_ptr<PendingUpdate> pending_update;

  bool is_tp_split() const { return tp_split_dim >= 0 && tp_size > 1; }
  // full_shape with the split dimension multiplied back by tp_size.
  std::vector<int64_t> logical_shape() const;
};

bool is_distributed_param(const at::Tensor& param);
// Throws when `param` is not a DistributedParameter.
ParamMeta& meta_of(const at::Tensor& param);
ParamMeta* find_meta(const at::Tensor& param);
// True when a Block owns the parameter's storage (false for plain tensors and standalone DistributedParameters).
bool in_block(const at::Tensor& param);
// Ranks of the world holding an identical copy of this parameter's local elements (bmt::replication), given the
// size of the pipeline stage's ZeRO group (Config::zero_size) the parameter lives in.
int replication_of(const ParamMeta& m, int stage_zero_size);

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
