// "Where does GPU time go" for a few training steps: a thin wrapper over LibTorch's Kineto profiler that
// reduces the trace to busy/idle figures and the kernels with the most time.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace bench {

struct KernelTime {
  std::string name;
  int64_t calls = 0;
  double total_ms = 0;  // sum of the kernel's durations (not a union: concurrent launches all count)
};

struct GpuProfileSummary {
  double wall_ms = 0;         // host wall time between start() and stop() (stop synchronises the device first)
  double kernel_busy_ms = 0;  // union of all GPU kernel intervals (overlapping kernels on several streams counted once)
  double memcpy_ms = 0;       // union of memcpy/memset intervals
  double busy_ms = 0;         // union of kernels + memcpy/memset
  double idle_ms = 0;         // wall_ms - busy_ms, clamped at 0: gaps where the GPU did nothing
  std::vector<KernelTime> top;  // the N kernels (by name) with the most total time, descending
  // A few human-readable lines: the figures above and the top list (names cut to ~80 chars).
  std::string table() const;
  // {"wall_ms":..,"kernel_busy_ms":..,"memcpy_ms":..,"busy_ms":..,"idle_ms":..,"top":[{"name":..,"calls":..,"ms":..},..]}
  std::string json() const;
};

// Records CPU + CUDA activities between start() and stop(). Without CUDA (a CPU build, or no visible GPU) only
// CPU activity is recorded and the summary has only wall_ms. One profiler per process may be active at a time.
class GpuProfile {
 public:
  GpuProfile() = default;
  GpuProfile(const GpuProfile&) = delete;
  GpuProfile& operator=(const GpuProfile&) = delete;
  ~GpuProfile();  // disables a profiler left running, so an exception between start() and stop() doesn't leak it

  void start();                            // begins recording; throws std::runtime_error if already recording
  GpuProfileSummary stop(int top_n = 12);  // synchronises the current CUDA device if any, stops, summarises

 private:
  bool active_ = false;
  bool cuda_ = false;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace bench
