// bench_adam: CPU Adam(W) throughput in parameters per second, bmtrain's fused CPU kernel against torch's CPU
// AdamW implementations, for a mixed-precision model (bf16 parameters and gradients, fp32 master and moments).
//
//   bmt kernel <isa>         core::kernels Adam over the tensors on ThreadPool::global() (scalar / avx2 / avx512)
//   bmt AdamOffloadOptimizer the optimizer object on CPU parameters (kernel + bookkeeping)
//   torch _fused_adamw_      at::_fused_adamw_ on fp32 masters, plus the bf16->fp32 gradient and fp32->bf16
//                            parameter casts a mixed-precision step needs ("+casts"), and without them
//   torch::optim::AdamW      the C++ frontend (one op sequence per tensor), plus the same casts
// Each row: median over --iters steps after one warm-up step. --json appends one JSON line per row (fields bench,
// config, framework, params_per_s, machine, git_commit) to bench/results/<date>-<machine>.jsonl.
//
// Usage: bench_adam [--params N (default 64M)] [--tensors T (default 64)] [--iters K (default 5)] [--json]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <unistd.h>
#include <vector>

#include "bench_env.h"
#include "bmt/core/kernels/adam.h"
#include "bmt/core/kernels/thread_pool.h"
#include "bmt/optim/adam_offload.h"

#ifndef BMT_SOURCE_DIR
#define BMT_SOURCE_DIR "."
#endif

namespace k = bmt::core::kernels;

namespace {

struct Row {
  std::string framework, config;
  double params_per_s = 0;  // 0 = unavailable
  std::string note;
};

double median_seconds(int iters, const std::function<void()>& fn) {
  fn();  // warm-up (lazy state, page faults)
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<int64_t> split_sizes(int64_t total, int64_t tensors) {
  std::vector<int64_t> sizes(tensors, total / tensors);
  sizes.back() += total % tensors;
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t total = 64ll << 20, tensors = 64;
  int iters = 5;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--params" && i + 1 < argc) total = std::atoll(argv[++i]);
    else if (a == "--tensors" && i + 1 < argc) tensors = std::atoll(argv[++i]);
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--json") json = true;
    else {
      std::fprintf(stderr, "usage: %s [--params N] [--tensors T] [--iters K] [--json]\n", argv[0]);
      return 2;
    }
  }
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  auto& pool = k::ThreadPool::global();
  const std::string config = std::to_string(total) + " params in " + std::to_string(tensors) +
                             " tensors, bf16 param+grad, fp32 master/moments, " + std::to_string(pool.num_threads()) +
                             " threads";
  std::printf("bench_adam: %s; torch intra-op threads %d; best ISA %s\n", config.c_str(), at::get_num_threads(),
              k::cpu_isa_name(k::adam_cpu_best_isa()));
  std::vector<Row> rows;
  std::vector<int64_t> sizes = split_sizes(total, tensors);

  {  // bmtrain kernel, per ISA
    std::vector<at::Tensor> p, g, master, m, v;
    for (int64_t n : sizes) {
      p.push_back(at::randn({n}).to(at::kBFloat16));
      g.push_back((at::randn({n}) * 1e-2).to(at::kBFloat16));
      master.push_back(p.back().to(at::kFloat));
      m.push_back(at::zeros({n}));
      v.push_back(at::zeros({n}));
    }
    for (k::CpuIsa isa : {k::CpuIsa::kScalar, k::CpuIsa::kAvx2, k::CpuIsa::kAvx512}) {
      if (!k::adam_cpu_isa_supported(isa)) {
        rows.push_back({"bmt kernel", std::string(k::cpu_isa_name(isa)), 0, "unsupported CPU"});
        continue;
      }
      int64_t step = 0;
      double t = median_seconds(iters, [&] {
        ++step;
        std::vector<k::AdamTensorArgs> args(sizes.size());
        std::vector<std::pair<size_t, int64_t>> chunks;
        for (size_t i = 0; i < sizes.size(); ++i) {
          k::AdamTensorArgs& a = args[i];
          a.param = p[i].data_ptr();
          a.master = master[i].data_ptr<float>();
          a.grad = g[i].data_ptr();
          a.exp_avg = m[i].data_ptr<float>();
          a.exp_avg_sq = v[i].data_ptr<float>();
          a.numel = sizes[i];
          a.param_dtype = bmt::core::DType::kBFloat16;
          a.grad_dtype = bmt::core::DType::kBFloat16;
          k::adam_step_scalars(a, lr, b1, b2, eps, wd, step);
          for (int64_t b = 0; b < sizes[i]; b += k::kAdamCpuChunkElems) chunks.emplace_back(i, b);
        }
        pool.parallel_for(static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
          for (int64_t c = lo; c < hi; ++c) {
            auto [i, b] = chunks[c];
            k::adam_cpu_range_isa(args[i], 1.0f, b, std::min(sizes[i], b + k::kAdamCpuChunkElems), isa);
          }
        });
      });
      rows.push_back({"bmt kernel", std::string(k::cpu_isa_name(isa)), total / t, ""});
    }
  }

  {  // bmtrain optimizer object (AdamOffloadOptimizer on CPU parameters)
    std::vector<at::Tensor> p;
    for (int64_t n : sizes) {
      p.push_back(at::randn({n}).to(at::kBFloat16).requires_grad_(true));
      p.back().mutable_grad() = (at::randn({n}) * 1e-2).to(at::kBFloat16);
    }
    bmt::optim::AdamOffloadOptimizer opt(p, bmt::optim::AdamOptions(lr, {b1, b2}, eps, wd));
    double t = median_seconds(iters, [&] { opt.step(1.0); });
    rows.push_back({"bmt AdamOffloadOptimizer", k::cpu_isa_name(k::adam_cpu_best_isa()), total / t, ""});
  }

  {  // torch fused AdamW on fp32 masters
    std::vector<at::Tensor> p16, g16, p32, g32, m, v, steps;
    for (int64_t n : sizes) {
      p16.push_back(at::randn({n}).to(at::kBFloat16));
      g16.push_back((at::randn({n}) * 1e-2).to(at::kBFloat16));
      p32.push_back(p16.back().to(at::kFloat));
      g32.push_back(g16.back().to(at::kFloat));
      m.push_back(at::zeros({n}));
      v.push_back(at::zeros({n}));
      steps.push_back(at::zeros({}, at::kFloat));
    }
    auto fused = [&] {
      at::_foreach_add_(steps, 1);
      at::_fused_adamw_(p32, g32, m, v, {}, steps, lr, b1, b2, wd, eps, false, false);
    };
    try {
      double t = median_seconds(iters, fused);
      rows.push_back({"torch _fused_adamw_", "fp32 only", total / t, ""});
      t = median_seconds(iters, [&] {
        for (size_t i = 0; i < g32.size(); ++i) g32[i].copy_(g16[i]);
        fused();
        for (size_t i = 0; i < p16.size(); ++i) p16[i].copy_(p32[i]);
      });
      rows.push_back({"torch _fused_adamw_", "+casts", total / t, ""});
    } catch (const std::exception& e) {
      rows.push_back({"torch _fused_adamw_", "fp32", 0, std::string("unavailable: ") + e.what()});
    }
  }

  {  // torch::optim::AdamW (C++ frontend, per-tensor op sequence) on fp32 masters
    std::vector<at::Tensor> p16, g16, p32;
    for (int64_t n : sizes) {
      p16.push_back(at::randn({n}).to(at::kBFloat16));
      g16.push_back((at::randn({n}) * 1e-2).to(at::kBFloat16));
      p32.push_back(p16.back().to(at::kFloat).requires_grad_(true));
      p32.back().mutable_grad() = g16.back().to(at::kFloat);
    }
    torch::optim::AdamW opt(p32, torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd));
    double t = median_seconds(iters, [&] { opt.step(); });
    rows.push_back({"torch::optim::AdamW", "fp32 only", total / t, ""});
    t = median_seconds(iters, [&] {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < p32.size(); ++i) p32[i].mutable_grad().copy_(g16[i]);
      opt.step();
      for (size_t i = 0; i < p16.size(); ++i) p16[i].copy_(p32[i]);
    });
    rows.push_back({"torch::optim::AdamW", "+casts", total / t, ""});
  }

  std::printf("\n%-28s %-10s %16s\n", "framework", "variant", "Mparams/s");
  for (const Row& r : rows) {
    if (r.params_per_s > 0) std::printf("%-28s %-10s %16.1f\n", r.framework.c_str(), r.config.c_str(), r.params_per_s / 1e6);
    else std::printf("%-28s %-10s %16s  %s\n", r.framework.c_str(), r.config.c_str(), "-", r.note.c_str());
  }

  if (json) {
    std::string machine = bench::machine_name();
    std::string commit = bench::git_commit();
    char date[32];
    std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%d", std::localtime(&now));
    std::filesystem::path dir = std::filesystem::path(BMT_SOURCE_DIR) / "bench" / "results";
    std::filesystem::create_directories(dir);
    std::filesystem::path file = dir / (std::string(date) + "-" + machine + ".jsonl");
    std::ofstream out(file, std::ios::app);
    for (const Row& r : rows) {
      if (r.params_per_s <= 0) continue;
      out << "{\"bench\":\"adam_cpu\",\"config\":\"" << config << ", " << r.config << "\",\"framework\":\""
          << r.framework << "\",\"params_per_s\":" << static_cast<int64_t>(r.params_per_s) << ",\"machine\":\""
          << machine << "\",\"git_commit\":\"" << commit << "\"}\n";
    }
    std::printf("\nappended %zu lines to %s\n", rows.size(), file.c_str());
  }
  return 0;
}
