// init_memory_tool PRESET [gpt|llama] [fp32|bf16] [LAYERS] [torch]   (under bmtrun --nproc W)
// Host memory of building and initialising a preset's model on every rank (issue 16 item 5). Parameters are
// created as shards (DistributedParameter allocates only its shard), Blocks allocate their gradient shards on first
// use, and bmt::init_parameters fills each shard directly from the built-in initialisers' counter-based streams
// (bmt/param_init.h); "torch" selects the full-tensor path with torch's generator instead (every rank generates
// every parameter: the comparison). Prints, per rank, the resident set before building (the process baseline), the
// peak (VmHWM) after building and after init and their increase over the baseline, this rank's parameter shard
// bytes and the bytes of one (the largest) block, so the increase can be checked against shard + one block.
// LAYERS overrides the preset's (0 or absent: the preset's).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "bmt/runtime/init.h"
#include "bmt/params/param_init.h"
#include "bmt/params/parameter.h"
#include "models/presets.h"

namespace {

int64_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  for (std::string k; f >> k;) {
    int64_t v = 0;
    if (k == key) {
      f >> v;
      return v;
    }
    f.ignore(1 << 12, '\n');
  }
  return -1;
}

// "layers.12.attention.wq.weight" -> "layers.12."; names outside a numbered layer are their own group.
std::string block_of(const std::string& name) {
  const auto dot = name.find('.');
  if (dot == std::string::npos) return name;
  const auto second = name.find('.', dot + 1);
  return second == std::string::npos ? name : name.substr(0, second + 1);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: init_memory_tool PRESET [gpt|llama] [fp32|bf16] [LAYERS] [torch]\n");
    return 2;
  }
  bmt::InitOptions init;
  init.quiet = true;
  init.seed = 1;
  bmt::init_distributed(init);
  examples::ModelConfig c = examples::find_preset(argv[1]).model;
  c.arch = argc > 2 ? argv[2] : "gpt";
  const at::ScalarType dtype = argc > 3 && std::string(argv[3]) == "bf16" ? at::kBFloat16 : at::kFloat;
  if (argc > 4 && std::atoll(argv[4]) > 0) c.num_layers = std::atoll(argv[4]);
  bmt::InitParametersOptions init_options;
  init_options.torch_generator = argc > 5 && std::string(argv[5]) == "torch";
  const int64_t rss_before = status_kib("VmRSS:");
  auto model = examples::make_model(c, {}, dtype);
  const int64_t hwm_built = status_kib("VmHWM:");
  int64_t shard_nbytes = 0;
  std::map<std::string, int64_t> group_nbytes;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    shard_nbytes += p.numel() * static_cast<int64_t>(p.element_size());
    int64_t n = static_cast<int64_t>(p.element_size());
    for (int64_t d : bmt::meta_of(p).logical_shape()) n *= d;
    group_nbytes[block_of(item.key())] += n;
  }
  int64_t block_nbytes = 0;
  for (const auto& [name, n] : group_nbytes) block_nbytes = std::max(block_nbytes, n);
  const auto t0 = std::chrono::steady_clock::now();
  bmt::init_parameters(*model, init_options);
  const double init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t hwm_init = status_kib("VmHWM:");
  const double mib = 1024.0;
  std::printf("rank %d: %s %s, %.1fM params, %s init in %.1f s: rss before build %.0f MiB; peak after build %.0f MiB "
              "(+%.0f), after init %.0f MiB (+%.0f); shard %.0f MiB + one block %.0f MiB = %.0f MiB\n",
              bmt::config().rank, c.describe().c_str(), c10::toString(dtype), model->num_params() / 1e6,
              init_options.torch_generator ? "torch-generator" : "sharded", init_s, rss_before / mib, hwm_built / mib,
              (hwm_built - rss_before) / mib, hwm_init / mib, (hwm_init - rss_before) / mib, shard_nbytes / 1048576.0,
              block_nbytes / 1048576.0, (shard_nbytes + block_nbytes) / 1048576.0);
  std::fflush(stdout);
  bmt::finalize();
  return 0;
}
