// bmt-bench-kernels: our CUDA kernels against the torch operators they replace, at the training presets' shapes
// (one GPU). Each kernel family is one suite in its own file (bench_kernels_<family>.cpp), listed in
// bench_kernels.cpp. A suite times both sides with the same KernelTimer and reports one row per shape.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>

namespace bench {

class KernelTimer {
 public:
  explicit KernelTimer(int iters) : iters_(iters) {}
  // Mean milliseconds of one call of `fn` on the current stream (3 warm-up calls, then `iters` timed calls between
  // two CUDA events).
  double time_ms(const std::function<void()>& fn) const;
  int iters() const { return iters_; }

 private:
  int iters_;
};

// One JSON line on stdout and one human-readable line on stderr. `nbytes` is the memory traffic one call of ours
// must do at least (reads + writes), for the GB/s figure; torch_ms <= 0 when there is no torch counterpart.
void report_kernel(const std::string& suite, const std::string& shape, double ours_ms, double torch_ms,
                   double nbytes, double max_abs_diff);

// Suites (one per bench_kernels_<family>.cpp).
void bench_cross_entropy(const KernelTimer& timer);
void bench_column_sum(const KernelTimer& timer);
void bench_layer_norm_grads(const KernelTimer& timer);

}  // namespace bench
