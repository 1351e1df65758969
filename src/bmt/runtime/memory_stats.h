// memory_stats(): where the bytes are. Shards, gathered (full) buffers and gradients are counted by the engine;
// device allocated/peak come from the CUDA caching allocator (0 on CPU).
#pragma once

#include <cstdint>

namespace bmt {

struct MemoryStats {
  int64_t device_allocated_nbytes = 0;
  int64_t device_peak_nbytes = 0;
  int64_t shard_nbytes = 0;      // parameter shards held by Blocks
  int64_t gathered_nbytes = 0;   // full parameter buffers alive now
  int64_t gathered_peak_nbytes = 0;
  int64_t grad_nbytes = 0;       // gradient shards (+ deferred accumulation buffers)
};

MemoryStats memory_stats();
void reset_peak_memory_stats();

namespace memory {
void add_shard_bytes(int64_t delta);
void add_full_bytes(int64_t delta);
void add_grad_bytes(int64_t delta);
}  // namespace memory

}  // namespace bmt
