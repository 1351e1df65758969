// The two frameworks bmt-bench-train measures, each as a Runner: how to run one step and what to report about the
// model (bench_train.cpp times them; bench_runners.cpp builds them). The optimizer settings are the benchmark's.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>

#include "bench_train_args.h"
#include "memory_report.h"

namespace bench {

constexpr double kPeakFlops = 989e12;  // H100/H200 SXM dense bf16
constexpr double kLr = 3e-4, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWeightDecay = 0.1;

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline int64_t proc_kib(const char* file, const char* key) {
  std::ifstream in(file);
  std::string k;
  int64_t v = -1;
  while (in >> k) {
    if (k == key) {
      in >> v;
      return v;
    }
    in.ignore(1 << 16, '\n');
  }
  return -1;
}

inline double gib(double bytes) { return bytes / double(1ll << 30); }

// One benchmark: how to run a step, and what to report about the model.
struct Runner {
  int data_parallel = 1;  // ranks with distinct batches (world / (tp * pp))
  int pp = 1, micro_batches = 1;
  std::function<double()> bubble = [] { return NAN; };  // measured over the timed steps (pipeline only)
  std::function<void()> reset_bubble = [] {};
  std::function<at::Tensor(const at::Tensor& tokens)> step;  // one optimizer step; returns the detached loss
  c10::Device device{c10::kCPU};
  int64_t num_params = 0, num_matmul_params = 0;
  std::string precision, optimizer;
  int world = 1, rank = 0;  // bmt under a launcher: every rank runs B sequences per step
  std::function<int64_t()> early_started = [] { return int64_t{0}; };  // Blocks updated during the backward
  std::function<int64_t()> skipped_steps = [] { return int64_t{0}; };  // OptimManager's inf/NaN skips
  std::function<void()> finish = [] {};
  std::function<std::string()> graph_status = [] { return std::string("off"); };  // --cuda-graphs
  // --memory-breakdown: registers the categories this framework can name (bytes on the device now).
  std::function<void(MemoryBreakdown&)> memory_categories = [](MemoryBreakdown&) {};
};

// Set while --memory-breakdown samples: the steps call it at their fixed points.
inline MemoryBreakdown* g_breakdown = nullptr;
inline void sample_memory(const char* where) {
  if (g_breakdown) g_breakdown->sample(where);
}


struct Failure : std::runtime_error {
  int code;
  Failure(const std::string& what, int c) : std::runtime_error(what), code(c) {}
};

// The bmt framework (examples' model in Blocks, AdamOptimizer / offload, OptimManager; also tp and pp) and the
// same GPT in plain LibTorch (fused AdamW). Both call init / build / initialise according to `a`.
Runner make_bmt_runner(const Args& a, const Shape& shape);
Runner make_plain_runner(const Args& a, const Shape& shape);

}  // namespace bench
