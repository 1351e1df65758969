// OffloadOverlap: the handle of OptimManager::overlap_offload_with_backward(), which starts each Block's CPU Adam
// update (AdamOffloadOptimizer) as soon as the Block's gradients are reduced, while the rest of the backward runs.
//
// Per Block and iteration (a grad-ready hook, bmt/block.h), for every AdamOffloadOptimizer of the manager that
// holds parameters of that Block:
//   1. wait for the Block's gradient reduction, then check the Block's gradients (those the optimizer holds) for
//      inf/NaN and agree on the answer over the Block's communicators: one all_reduce(max) of a one-element flag
//      per communicator (on GPUs this waits on the host for the Block's backward so far);
//   2. if finite everywhere, start the update (AdamOffloadOptimizer::step_params); otherwise leave the Block to
//      step(), which will find the same inf/NaN.
// An early update cannot be undone (keeping a copy of the host state would double host memory). So:
//   * loss scaling skips steps as part of normal training: overlap_offload_with_backward() refuses a manager with
//     dynamic loss scaling;
//   * without loss scaling, an inf/NaN found by step() after some Blocks were updated early means the run has
//     diverged: step() throws (naming those Blocks) instead of skipping half a step.
//
// The handle is movable; remove() (or its destructor) removes the hook. The manager and the optimizers must
// outlive the iterations run with the overlap on (the hook keeps the optimizers alive, not the manager).
#pragma once

#include <cstdint>
#include <memory>

namespace bmt::optim {

namespace detail {
struct OffloadOverlapState;
}

class OffloadOverlap {
 public:
  OffloadOverlap() = default;
  explicit OffloadOverlap(std::shared_ptr<detail::OffloadOverlapState> state);
  ~OffloadOverlap();
  OffloadOverlap(OffloadOverlap&& other) noexcept;
  OffloadOverlap& operator=(OffloadOverlap&& other) noexcept;
  OffloadOverlap(const OffloadOverlap&) = delete;
  OffloadOverlap& operator=(const OffloadOverlap&) = delete;

  // Removes the hook: later backward passes leave every update to step(). Idempotent.
  void remove();
  bool active() const;
  // Block updates started early since the overlap was turned on (one per Block, optimizer and iteration).
  int64_t num_early_starts() const;
  // Blocks whose early start was withheld because their gradients held inf/NaN.
  int64_t num_nonfinite_blocks() const;

 private:
  std::shared_ptr<detail::OffloadOverlapState> state_;
};

}  // namespace bmt::optim
