// Block's private storage records, shared by the files that implement Block (block.cpp: storage, gather, forward
// and backward; block_gradients.cpp: gradient reduction and the grad-ready hooks). Not installed.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bmt/engine/block.h"
#include "bmt/core/communicator.h"
#include "bmt/params/parameter.h"

namespace bmt {

struct Block::Group {
  at::ScalarType dtype;
  std::shared_ptr<core::Communicator> comm;
  TpGradReduce tp_grad_reduce = TpGradReduce::kNone;  // tp-replicated parameters: all-reduce over tp after reducing
  int64_t used_numel = 0;       // packed length incl. alignment padding
  int64_t partition_numel = 0;  // shard length; the full buffer is partition_numel * comm->size()
  at::Tensor shard;
  at::Tensor grad_shard;          // allocated on first use: the first reduction, or a main_grad read (zeros)
  at::TensorOptions grad_shard_options;  // dtype/device of grad_shard, kept while it is released
  bool grad_released = true;      // grad_shard not allocated (not yet, or freed by release_gradients()); the next
                                  // reduction allocates it
  bool grad_lazy = true;          // not allocated since construction: reading a main gradient allocates zeros
                                  // (released gradients read as undefined instead)
  bool grad_fresh = false;        // grad_shard reallocated but not written yet (its reduction overwrites it)
  bool grad_handed_over = false;  // no grad_shard: main gradients are the parameters' own (hand_over_gradients)
  at::Tensor full;                // gathered buffer (only between gather and release)
  at::Tensor full_store;          // the one storage `full` uses (several ranks); its bytes are freed on release
  at::Tensor deferred_grad_full;  // accumulation while GradSyncGuard defers reduction
  std::optional<c10::Event> ready;  // recorded on the comm stream when `full` is complete

  // `full` is a gathered buffer of its own (not the one-rank alias of the shard).
  bool owns_full() const { return full.defined() && !full.is_same(shard); }
};

struct Block::Slot {
  at::Tensor param;
  std::string name;
  size_t group = 0;
  int64_t offset = 0;  // in the group's packed (full) space
  int64_t numel = 0;
  std::vector<int64_t> shape;
  int64_t local_begin = 0;  // intersection with this rank's partition, in shard coordinates
  int64_t local_numel = 0;
  // The parameter's views of the full buffer and of the shard, made once (point_at_full / point_at_shard): both
  // buffers keep their storage across gathers, so narrowing and reshaping again every step would only cost host time.
  at::Tensor full_view;
  at::Tensor shard_view;
};

// Calls every hook of add_grad_ready_hook with `block` (its gradients are reduced).
void run_grad_ready_hooks(Block& block);
// Whether a hook takes `block`'s gradients over once reduced (GradTakeoverQuery).
bool gradients_taken_over(const Block& block);

namespace detail {
// Block forwards recomputed in a backward so far (checkpointing; block.cpp): CudaGraphStep's warm-up compares it
// around a step to detect device random numbers drawn by a recompute.
int64_t block_recompute_count();
}  // namespace detail

}  // namespace bmt
