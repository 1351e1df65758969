// bmt-bench-kernels [--iters N] [--suite NAME]: see bench_kernels.h. Needs a CUDA build and a GPU.
#include "bench_kernels.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace bench {

double KernelTimer::time_ms(const std::function<void()>& fn) const {
  for (int i = 0; i < 3; ++i) fn();
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  auto stream = at::cuda::getCurrentCUDAStream();
  start.record(stream);
  for (int i = 0; i < iters_; ++i) fn();
  stop.record(stream);
  stop.synchronize();
  return static_cast<double>(start.elapsed_time(stop)) / iters_;
}

void report_kernel(const std::string& suite, const std::string& shape, double ours_ms, double torch_ms,
                   double nbytes, double max_abs_diff) {
  const double gbps = nbytes / (ours_ms * 1e-3) / 1e9;
  std::printf("{\"suite\":\"%s\",\"shape\":\"%s\",\"ours_ms\":%.4f,\"torch_ms\":%.4f,\"ours_GBps\":%.1f,"
              "\"max_abs_diff\":%.3g}\n",
              suite.c_str(), shape.c_str(), ours_ms, torch_ms, gbps, max_abs_diff);
  std::fprintf(stderr, "%-18s %-28s ours %8.4f ms (%6.0f GB/s)  torch %8.4f ms  speed-up %5.2fx  max|diff| %.3g\n",
               suite.c_str(), shape.c_str(), ours_ms, gbps, torch_ms, torch_ms > 0 ? torch_ms / ours_ms : 0.0,
               max_abs_diff);
  std::fflush(stdout);
}

}  // namespace bench

int main(int argc, char** argv) {
  int iters = 50;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--suite") && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bmt-bench-kernels [--iters N] [--suite NAME]\n");
      return 2;
    }
  }
  if (!at::cuda::is_available()) {
    std::fprintf(stderr, "bmt-bench-kernels: no CUDA device visible; run it on a GPU machine\n");
    return 1;
  }
  const bench::KernelTimer timer(iters);
  const std::vector<std::pair<std::string, void (*)(const bench::KernelTimer&)>> suites = {
      {"cross_entropy", bench::bench_cross_entropy},
      {"column_sum", bench::bench_column_sum},
      {"layer_norm_grads", bench::bench_layer_norm_grads},
  };
  for (const auto& [name, fn] : suites)
    if (only.empty() || only == name) fn(timer);
  return 0;
}
