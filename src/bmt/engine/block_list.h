// TransformerBlockList: runs Blocks in sequence with parameter prefetch.
// Forward: before block i runs, blocks i+1..i+depth start their all_gather (on the comm stream on GPUs), so at
// most depth+1 blocks hold gathered parameters at once. Backward (depth >= 1; depth 0 prefetches nothing): block
// i, once its own parameters are gathered, prefetches block i-1's; its gradient reduce-scatter is queued on the
// comm stream and overlaps block i-1's backward on GPUs. The inner modules are registered as children "0", "1",
// ... so state_dict keys are those of an unwrapped ModuleList.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <vector>

#include "bmt/engine/block.h"

namespace bmt {

class TransformerBlockList : public torch::nn::Module {
 public:
  explicit TransformerBlockList(std::vector<std::shared_ptr<Block>> blocks, int prefetch_depth = 1);

  // The first `num_hidden` tensors of `args` are threaded through the blocks (each block's first num_hidden
  // outputs replace them); the rest are passed unchanged to every block. Returns the final hidden states; with
  // return_hidden_states, also one stacked tensor per hidden state holding every block's input
  // (shape (num_blocks, ...)), appended after them. `context` is passed to every Block's call (Block::forward).
  std::vector<at::Tensor> forward(std::vector<at::Tensor> args, int num_hidden = 1, bool return_hidden_states = false,
                                  CallContext context = nullptr);
  at::Tensor forward(const at::Tensor& hidden) { return forward(std::vector<at::Tensor>{hidden})[0]; }

  size_t size() const { return blocks_.size(); }
  Block& operator[](size_t i) { return *blocks_.at(i); }
  const std::vector<std::shared_ptr<Block>>& blocks() const { return blocks_; }
  int prefetch_depth() const { return prefetch_depth_; }

 private:
  std::vector<std::shared_ptr<Block>> blocks_;
  int prefetch_depth_;
};

}  // namespace bmt
