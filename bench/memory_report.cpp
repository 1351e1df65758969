#include "memory_report.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include "bmt/engine/block.h"
#include "bmt/runtime/memory_stats.h"
#include "bmt/optim/adam.h"
#include "bmt/params/param_meta.h"
#include "bmt/params/parameter.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace bench {
namespace {

[[maybe_unused]] double gib(int64_t bytes) { return static_cast<double>(bytes) / double(1ll << 30); }

#ifdef BMT_WITH_CUDA
struct AllocatorNow {
  int64_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0;
};
AllocatorNow allocator_now(int device) {
  const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {st.allocated_bytes[agg].current, st.reserved_bytes[agg].current, st.allocated_bytes[agg].peak,
          st.reserved_bytes[agg].peak};
}
#endif

}  // namespace

bool start_memory_history() {
#ifdef BMT_WITH_CUDA
  const char* stacks = std::getenv("BMT_MEMORY_SNAPSHOT_STACKS");
  const char* entries = std::getenv("BMT_MEMORY_SNAPSHOT_ENTRIES");
  const size_t max_entries = entries && *entries ? static_cast<size_t>(std::atoll(entries)) : size_t{200000};
  torch::cuda::_record_memory_history(std::string("all"), std::string("all"), stacks && *stacks ? stacks : "python",
                                      max_entries);
  return true;
#else
  std::printf("memory snapshot: not a CUDA build, nothing recorded\n");
  return false;
#endif
}

void write_memory_snapshot(const std::string& path) {
#ifdef BMT_WITH_CUDA
  const std::string pickled = torch::cuda::_memory_snapshot_pickled();
  std::ofstream out(path, std::ios::binary);
  if (!out) throw std::runtime_error("--memory-snapshot: cannot open " + path + " for writing");
  out.write(pickled.data(), static_cast<std::streamsize>(pickled.size()));
  if (!out) throw std::runtime_error("--memory-snapshot: writing " + path + " failed");
  std::printf("memory snapshot: %.1f MiB written to %s (https://pytorch.org/memory_viz, "
              "tools/memory_snapshot_peak.py)\n", static_cast<double>(pickled.size()) / (1 << 20), path.c_str());
#else
  (void)path;
#endif
}

void MemoryBreakdown::add_category(const std::string& name, std::function<int64_t()> bytes, bool counted) {
  categories_.push_back({name, std::move(bytes), counted});
}

void MemoryBreakdown::sample(const char* where) {
#ifdef BMT_WITH_CUDA
  const AllocatorNow now = allocator_now(device_);
  ++num_samples_;
  if (now.allocated <= best_allocated_) return;
  best_allocated_ = now.allocated;
  best_reserved_ = now.reserved;
  best_where_ = where;
  best_values_.clear();
  for (const Category& c : categories_) best_values_.push_back(c.bytes());
#else
  (void)where;
#endif
}

std::string MemoryBreakdown::report() const {
#ifdef BMT_WITH_CUDA
  if (best_allocated_ < 0) return "memory breakdown: no samples\n";
  const AllocatorNow now = allocator_now(device_);
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "memory breakdown at the largest of %ld samples (%s): %.3f GiB allocated, %.3f GiB "
                "reserved\n", static_cast<long>(num_samples_), best_where_.c_str(), gib(best_allocated_),
                gib(best_reserved_));
  out += line;
  int64_t counted = 0;
  for (size_t i = 0; i < categories_.size(); ++i) {
    std::snprintf(line, sizeof line, "  %-58s %9.3f GiB%s\n", categories_[i].name.c_str(), gib(best_values_[i]),
                  categories_[i].counted ? "" : "  (not extra: aliases)");
    out += line;
    if (categories_[i].counted) counted += best_values_[i];
  }
  std::snprintf(line, sizeof line, "  %-58s %9.3f GiB\n", "activations, logits, temporaries (the remainder)",
                gib(best_allocated_ - counted));
  out += line;
  std::snprintf(line, sizeof line, "  %-58s %9.3f GiB\n", "reserved but unallocated (cache, fragmentation)",
                gib(best_reserved_ - best_allocated_));
  out += line;
  std::snprintf(line, sizeof line, "  allocator peak allocated %.3f GiB (%.3f GiB above the sampled maximum: transient "
                "inside a Block's forward/backward), peak reserved %.3f GiB\n", gib(now.peak_allocated),
                gib(now.peak_allocated - best_allocated_), gib(now.peak_reserved));
  out += line;
  return out;
#else
  return "memory breakdown: not a CUDA build (CPU memory is not sampled)\n";
#endif
}

void add_bmt_memory_categories(MemoryBreakdown& b, torch::nn::Module& model,
                               const std::vector<std::shared_ptr<bmt::optim::BmtOptimizer>>& optimizers,
                               int data_parallel) {
  std::vector<at::Tensor> outside, all;
  for (const auto& item : model.named_parameters()) {
    all.push_back(item.value());
    if (!bmt::in_block(item.value())) outside.push_back(item.value());
  }
  auto device_bytes = [](const at::Tensor& t) { return t.defined() && t.is_cuda() ? int64_t(t.nbytes()) : int64_t{0}; };
  b.add_category("parameter shards held by Blocks", [] { return bmt::memory_stats().shard_nbytes; });
  b.add_category("parameters outside Blocks (embeddings, final norm)", [outside, device_bytes] {
    int64_t n = 0;
    for (const auto& p : outside) n += device_bytes(p);
    return n;
  });
  // One data-parallel rank: a Block's "gathered" buffer is its shard (an alias), no extra bytes.
  b.add_category("gathered parameter copies of Blocks", [] { return bmt::memory_stats().gathered_nbytes; },
                 data_parallel > 1);
  b.add_category("fp32 gradient buffers of Blocks (shards, deferred)", [] { return bmt::memory_stats().grad_nbytes; });
  b.add_category("gradients outside Blocks (main_grad)", [outside, device_bytes] {
    int64_t n = 0;
    for (const auto& p : outside) n += device_bytes(bmt::main_grad(p));
    return n;
  });
  b.add_category("optimizer states on the GPU (fp32 master, exp_avg, exp_avg_sq)",
                 [all, device_bytes, opts = optimizers] {
    int64_t n = 0;
    for (const auto& o : opts) {
      // Host-side (offload) states are not device bytes; find_state would also wait for running CPU updates.
      auto* adam = dynamic_cast<bmt::optim::AdamOptimizer*>(o.get());
      if (adam == nullptr) continue;
      for (const auto& p : all)
        if (const bmt::optim::AdamState* s = adam->find_state(p))
          n += device_bytes(s->exp_avg) + device_bytes(s->exp_avg_sq) + device_bytes(s->master);
    }
    return n;
  });
}

}  // namespace bench
