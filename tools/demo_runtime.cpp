// A multi-rank demonstration of the runtime: init, every collective on the world and tp groups, a barrier.
//   bmtrun --nproc 4 build/tools/bmt-demo-runtime [--tp 2]
#include <ATen/ATen.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"

static std::string fmt(const at::Tensor& t) {
  at::Tensor c = t.flatten().to(at::kCPU).to(at::kLong);
  std::string s = "[";
  for (int64_t i = 0; i < c.numel(); ++i) s += (i ? "," : "") + std::to_string(c[i].item<int64_t>());
  return s + "]";
}

int main(int argc, char** argv) {
  bmt::InitOptions opts;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--tp") && i + 1 < argc) opts.tp_size = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--backend") && i + 1 < argc) opts.backend = bmt::parse_backend(argv[++i]);
  }
  try {
    bmt::init_distributed(opts);
    const auto& cfg = bmt::config();
    auto dev = at::TensorOptions().device(cfg.device);
    at::Tensor mine = at::full({3}, static_cast<double>(cfg.rank + 1), dev);
    at::Tensor gathered = bmt::distributed::all_gather(mine, *cfg.comm);
    at::Tensor summed = bmt::distributed::all_reduce(mine, bmt::core::ReduceOp::kSum, *cfg.comm);
    at::Tensor tp_sum = bmt::distributed::all_reduce(mine, bmt::core::ReduceOp::kSum, *cfg.tp_comm);
    bmt::synchronize();
    std::printf("rank %d/%d (tp rank %d/%d, dp rank %d/%d, %s): all_gather=%s all_reduce=%.0f tp_all_reduce=%.0f\n",
                cfg.rank, cfg.world_size, cfg.tp_rank, cfg.tp_size, cfg.tp_zero_rank, cfg.tp_zero_size,
                cfg.device.str().c_str(), fmt(gathered).c_str(),
                summed[0].item<float>(), tp_sum[0].item<float>());
    bool ok = summed[0].item<float>() == cfg.world_size * (cfg.world_size + 1) / 2.0f;
    bmt::print_rank("expected all_reduce = ", cfg.world_size * (cfg.world_size + 1) / 2, ok ? " -> OK" : " -> WRONG");
    bmt::finalize();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bmt-demo-runtime: %s\n", e.what());
    return 1;
  }
}
