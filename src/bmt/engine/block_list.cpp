#include "bmt/engine/block_list.h"

#include <set>

#include "bmt/core/error.h"

namespace bmt {

TransformerBlockList::TransformerBlockList(std::vector<std::shared_ptr<Block>> blocks, int prefetch_depth)
    : blocks_(std::move(blocks)), prefetch_depth_(prefetch_depth) {
  BMT_CHECK(prefetch_depth_ >= 0, "TransformerBlockList: prefetch_depth ", prefetch_depth_, " must be >= 0");
  std::set<Block*> seen;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    BMT_CHECK(blocks_[i] != nullptr, "TransformerBlockList: block ", i, " is null");
    BMT_CHECK(seen.insert(blocks_[i].get()).second, "TransformerBlockList: block ", i,
              " appears twice; each Block may occur once in a list");
    register_module(std::to_string(i), blocks_[i]->module());
    // The backward prefetches the previous block (two blocks gathered at once); prefetch_depth 0 means none.
    blocks_[i]->prev_in_list_ = i > 0 && prefetch_depth_ > 0 ? blocks_[i - 1].get() : nullptr;
  }
}

std::vector<at::Tensor> TransformerBlockList::forward(std::vector<at::Tensor> args, int num_hidden,
                                                      bool return_hidden_states, CallContext context) {
  BMT_CHECK(num_hidden >= 1 && num_hidden <= static_cast<int>(args.size()), "TransformerBlockList: num_hidden ",
            num_hidden, " must be in [1, number of arguments = ", args.size(), "]");
  std::vector<std::vector<at::Tensor>> layer_inputs(num_hidden);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    for (int d = 1; d <= prefetch_depth_ && i + d < blocks_.size(); ++d) blocks_[i + d]->prefetch();
    if (return_hidden_states)
      for (int h = 0; h < num_hidden; ++h) layer_inputs[h].push_back(args[h]);
    std::vector<at::Tensor> out = blocks_[i]->forward(args, context);
    BMT_CHECK(static_cast<int>(out.size()) >= num_hidden, "TransformerBlockList: block ", i, " returned ", out.size(),
              " tensors but num_hidden is ", num_hidden);
    for (int h = 0; h < num_hidden; ++h) args[h] = out[h];
  }
  std::vector<at::Tensor> result(args.begin(), args.begin() + num_hidden);
  if (return_hidden_states)
    for (int h = 0; h < num_hidden; ++h) result.push_back(at::stack(layer_inputs[h]));
  return result;
}

}  // namespace bmt
