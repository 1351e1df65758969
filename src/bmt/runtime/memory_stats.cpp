#include "bmt/runtime/memory_stats.h"

#include <algorithm>
#include <atomic>

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "bmt/runtime/init.h"

namespace bmt {
namespace {
std::atomic<int64_t> g_shard{0}, g_full{0}, g_full_peak{0}, g_grad{0};
}

namespace memory {
void add_shard_bytes(int64_t d) { g_shard += d; }
void add_full_bytes(int64_t d) {
  int64_t now = (g_full += d);
  int64_t peak = g_full_peak.load();
  while (now > peak && !g_full_peak.compare_exchange_weak(peak, now)) {
  }
}
void add_grad_bytes(int64_t d) { g_grad += d; }
}  // namespace memory

MemoryStats memory_stats() {
  MemoryStats s;
  s.shard_nbytes = g_shard;
  s.gathered_nbytes = g_full;
  s.gathered_peak_nbytes = g_full_peak;
  s.grad_nbytes = g_grad;
#ifdef BMT_WITH_CUDA
  if (is_initialized() && config().device.is_cuda()) {
    auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(config().device.index());
    using c10::CachingAllocator::StatType;
    s.device_allocated_nbytes = st.allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].current;
    s.device_peak_nbytes = st.allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  }
#endif
  return s;
}

void reset_peak_memory_stats() {
  g_full_peak = g_full.load();
#ifdef BMT_WITH_CUDA
  if (is_initialized() && config().device.is_cuda())
    c10::cuda::CUDACachingAllocator::resetPeakStats(config().device.index());
#endif
}

}  // namespace bmt
