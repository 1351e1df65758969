// bmt-bench-train's memory tools (issue 17 item 2): what holds the peak of GPU memory.
//
// --memory-snapshot PATH: the CUDA caching allocator records its history (torch::cuda::_record_memory_history,
// the C++ side of torch.cuda.memory._record_memory_history) from before the model is built, and the pickled
// snapshot (torch.cuda.memory._snapshot()) is written to PATH after the run: open it in
// https://pytorch.org/memory_viz, or summarise the live blocks at the peak with tools/memory_snapshot_peak.py.
// Env BMT_MEMORY_SNAPSHOT_STACKS=python (default: no C++ frames, cheap) | all (C++ stack of every allocation:
// slow, for short runs); BMT_MEMORY_SNAPSHOT_ENTRIES (default 200000) bounds the trace.
//
// --memory-breakdown: samples the allocator at fixed points of every step (after the forward, after each Block's
// gradients are reduced in the backward, after the backward, after the optimizer step), and at the sample with
// the most allocated bytes splits them into named categories (MemoryBreakdown::add_category: bytes held now by
// parameter shards, gathered copies, fp32 gradient buffers, optimizer states, ...); the remainder is activations
// (saved tensors), logits and temporaries. Printed with the true allocator peak (whose excess over the sampled
// maximum lies between samples: a Block's own backward) and reserved-but-unallocated bytes (cache and
// fragmentation). Without CUDA both are no-ops that say so.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bmt/optim/optimizer.h"

namespace bench {

// Starts recording the allocator history of every CUDA device; false (with a message) without CUDA.
bool start_memory_history();
// Writes the pickled snapshot to path; throws std::runtime_error when it cannot.
void write_memory_snapshot(const std::string& path);

class MemoryBreakdown {
 public:
  explicit MemoryBreakdown(int device_index) : device_(device_index) {}
  // A category and how to read the device bytes it holds now. `counted` false: shown, not subtracted (aliases).
  void add_category(const std::string& name, std::function<int64_t()> bytes, bool counted = true);
  // Reads the allocator; keeps the categories' values if this is the largest allocation seen.
  void sample(const char* where);
  // The table (empty samples: a line saying so).
  std::string report() const;

 private:
  struct Category {
    std::string name;
    std::function<int64_t()> bytes;
    bool counted;
  };
  int device_;
  std::vector<Category> categories_;
  int64_t best_allocated_ = -1, best_reserved_ = 0;
  std::string best_where_;
  std::vector<int64_t> best_values_;
  int64_t num_samples_ = 0;
};

// bmtrain's categories: parameter shards (Blocks, and the parameters outside them), gathered copies (counted only
// with more than one data-parallel rank: at world 1 they alias the shards), fp32 gradient buffers (Blocks' and
// main_grad outside them), and the device states of the AdamOptimizers among `optimizers` (null entries allowed;
// offloaded states live in host memory).
void add_bmt_memory_categories(MemoryBreakdown& b, torch::nn::Module& model,
                               const std::vector<std::shared_ptr<bmt::optim::BmtOptimizer>>& optimizers,
                               int data_parallel);

}  // namespace bench
