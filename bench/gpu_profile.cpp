#include "gpu_profile.h"

#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "bench_env.h"

namespace bench {
namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

namespace {

using Interval = std::pair<uint64_t, uint64_t>;  // [start, end) in ns

// Total length of the union of intervals: sort by start, merge overlaps, so that kernels running at the same
// time on different streams count once.
double union_ms(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  uint64_t total = 0, cur_s = 0, cur_e = 0;
  bool open = false;
  for (const auto& [s, e] : v) {
    if (open && s <= cur_e) {
      cur_e = std::max(cur_e, e);
      continue;
    }
    if (open) total += cur_e - cur_s;
    cur_s = s, cur_e = e, open = true;
  }
  if (open) total += cur_e - cur_s;
  return static_cast<double>(total) / 1e6;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

GpuProfile::~GpuProfile() {
  if (!active_) return;
  try {
    prof::disableProfiler();
  } catch (...) {  // a destructor must not throw; the profile is being discarded anyway
  }
}

void GpuProfile::start() {
  if (active_) throw std::runtime_error("GpuProfile::start: already recording (call stop() first)");
  cuda_ = false;
#ifdef BMT_WITH_CUDA
  // Asking Kineto for CUDA activity without a GPU makes CUPTI fail, so only ask when one is visible.
  cuda_ = c10::cuda::device_count() > 0;
#endif
  // Kineto needs CPU activity even when only GPU time is wanted: GPU events are correlated to CPU launches.
  std::set<impl::ActivityType> acts{impl::ActivityType::CPU};
  if (cuda_) acts.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig cfg(impl::ProfilerState::KINETO);
  try {
    prof::prepareProfiler(cfg, acts);
    prof::enableProfiler(cfg, acts);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("GpuProfile::start: could not enable the Kineto profiler "
                                         "(is another profiler active?): ") + e.what());
  }
  active_ = true;
  t0_ = std::chrono::steady_clock::now();
}

GpuProfileSummary GpuProfile::stop(int top_n) {
  if (!active_) throw std::runtime_error("GpuProfile::stop: not recording (call start() first)");
  GpuProfileSummary s;
#ifdef BMT_WITH_CUDA
  // Kernels are asynchronous: wait for those launched during the window so the wall time covers them.
  if (cuda_) c10::cuda::device_synchronize();
#endif
  s.wall_ms = ms_since(t0_);
  active_ = false;  // whatever happens next, the profiler is being turned off
  std::unique_ptr<prof::ProfilerResult> res;
  try {
    res = prof::disableProfiler();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("GpuProfile::stop: disabling the Kineto profiler failed: ") + e.what());
  }
  if (!res) throw std::runtime_error("GpuProfile::stop: the Kineto profiler returned no result");

  using KT = libkineto::ActivityType;
  std::vector<Interval> kernels, copies;
  std::map<std::string, KernelTime> by_name;
  for (const auto& ev : res->events()) {
    const auto type = static_cast<KT>(ev.activityType());
    const bool is_kernel = type == KT::CONCURRENT_KERNEL;
    const bool is_copy = type == KT::GPU_MEMCPY || type == KT::GPU_MEMSET;
    if (!is_kernel && !is_copy) continue;  // CPU ops, runtime calls, annotations: host-side, not GPU time
    const uint64_t b = ev.startNs(), e = std::max(ev.endNs(), b);
    (is_kernel ? kernels : copies).emplace_back(b, e);
    if (!is_kernel) continue;
    auto& k = by_name[ev.name()];
    k.calls += 1;
    k.total_ms += static_cast<double>(e - b) / 1e6;
  }
  s.kernel_busy_ms = union_ms(kernels);
  s.memcpy_ms = union_ms(copies);
  kernels.insert(kernels.end(), copies.begin(), copies.end());
  s.busy_ms = union_ms(std::move(kernels));
  s.idle_ms = std::max(0.0, s.wall_ms - s.busy_ms);

  for (auto& [name, k] : by_name) {
    k.name = name;
    s.top.push_back(std::move(k));
  }
  std::sort(s.top.begin(), s.top.end(), [](const KernelTime& a, const KernelTime& b) { return a.total_ms > b.total_ms; });
  if (s.top.size() > static_cast<size_t>(std::max(top_n, 0))) s.top.resize(static_cast<size_t>(std::max(top_n, 0)));
  return s;
}

std::string GpuProfileSummary::table() const {
  char buf[256];
  const double pct = wall_ms > 0 ? 100.0 / wall_ms : 0.0;
  std::snprintf(buf, sizeof(buf),
                "GPU profile: wall %.3f ms | busy %.3f ms (%.1f%%) = kernels %.3f + memcpy/memset %.3f (unions) | "
                "idle %.3f ms (%.1f%%)\n",
                wall_ms, busy_ms, busy_ms * pct, kernel_busy_ms, memcpy_ms, idle_ms, idle_ms * pct);
  std::string out = buf;
  if (!top.empty()) out += "  total ms   share  calls  kernel\n";
  for (const auto& k : top) {
    const std::string name = k.name.size() > 80 ? k.name.substr(0, 77) + "..." : k.name;
    std::snprintf(buf, sizeof(buf), "  %8.3f  %5.1f%%  %5lld  ", k.total_ms,
                  kernel_busy_ms > 0 ? 100.0 * k.total_ms / kernel_busy_ms : 0.0, static_cast<long long>(k.calls));
    out += buf + name + "\n";
  }
  return out;
}

std::string GpuProfileSummary::json() const {
  std::string out = "{\"wall_ms\":" + json_num(wall_ms) + ",\"kernel_busy_ms\":" + json_num(kernel_busy_ms) +
                    ",\"memcpy_ms\":" + json_num(memcpy_ms) + ",\"busy_ms\":" + json_num(busy_ms) +
                    ",\"idle_ms\":" + json_num(idle_ms) + ",\"top\":[";
  for (size_t i = 0; i < top.size(); ++i) {
    out += (i ? "," : "") + std::string("{\"name\":") + json_str(top[i].name) +
           ",\"calls\":" + std::to_string(top[i].calls) + ",\"ms\":" + json_num(top[i].total_ms) + "}";
  }
  return out + "]}";
}

}  // namespace bench
