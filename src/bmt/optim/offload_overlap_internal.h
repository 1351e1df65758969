// The shared state behind an OffloadOverlap handle, OptimManager and the grad-ready hook (not installed).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace bmt {
class Block;
}

namespace bmt::optim {

class AdamOffloadOptimizer;
class AdamOptimizer;

namespace detail {

class OffloadOverlapState : public std::enable_shared_from_this<OffloadOverlapState> {
 public:
  // `device_optimizers` (AdamOptimizer, state on the parameters' device) update without a per-Block host check: each
  // Block's gradients OR into a local inf/NaN flag that step() reads (take_local_nonfinite) with its own check.
  // release_gradients: a Block whose every trainable parameter was updated early frees its gradient shards.
  OffloadOverlapState(std::vector<std::shared_ptr<AdamOffloadOptimizer>> optimizers,
                      std::vector<std::shared_ptr<AdamOptimizer>> device_optimizers = {},
                      bool release_gradients = false);
  ~OffloadOverlapState();
  void install();  // adds the grad-ready hook (after construction: it needs shared_from_this)
  void remove_hook();
  bool installed() const { return hook_id_ >= 0; }
  // The grad-ready hook: checks the Block's gradients, then starts its update if they are finite.
  void on_block_reduced(Block& block);
  // The hook's GradTakeoverQuery: this hook updates every trainable parameter of `block` on the device as soon as
  // its gradients are reduced, then frees them (release_gradients).
  bool takes_over(const Block& block) const;
  // Forgets the iteration's records (OptimManager::step and zero_grad).
  void end_iteration();
  // Whether a Block updated early by a device optimizer in this iteration had an inf/NaN gradient on this rank
  // (reads the flag: a host wait on GPUs). Resets the flag.
  bool take_local_nonfinite();
  // Blocks updated early / withheld for inf/NaN in the current iteration ("#k (ModuleName)", backward order).
  const std::vector<std::string>& early_blocks() const { return early_blocks_; }
  const std::vector<std::string>& nonfinite_blocks() const { return nonfinite_blocks_; }
  int64_t num_early() const { return num_early_; }
  int64_t num_nonfinite() const { return num_nonfinite_; }

 private:
  std::vector<std::shared_ptr<AdamOffloadOptimizer>> optimizers_;
  std::vector<std::unordered_set<const void*>> owned_;  // per optimizer: its parameters' TensorImpls
  std::vector<std::shared_ptr<AdamOptimizer>> device_optimizers_;
  std::vector<std::unordered_set<const void*>> device_owned_;
  bool release_gradients_ = false;
  at::Tensor local_nonfinite_;  // int32 flag on the gradients' device (undefined until a device update)
  bool local_nonfinite_host_ = false;
  int hook_id_ = -1;
  int64_t blocks_seen_ = 0;  // Blocks reduced so far in this iteration
  std::set<std::pair<const Block*, size_t>> seen_this_iteration_;  // (Block, optimizer) checked this iteration
  std::vector<std::string> early_blocks_, nonfinite_blocks_;
  int64_t num_early_ = 0, num_nonfinite_ = 0;
};

}  // namespace detail
}  // namespace bmt::optim
