// init_memory_tool PRESET [gpt|llama] [fp32|bf16] [LAYERS]   (under bmtrun --nproc W)
// Host memory of building and initialising a preset's model on every rank (issue 16 item 5): parameters are
// created as shards (DistributedParameter allocates only its shard) and bmt::init_parameters generates one
// logical parameter at a time, keeps this rank's part and drops it. Prints, per rank, the resident set before
// building, the peak (VmHWM) after building and after init, this rank's parameter shard bytes and the largest
// single parameter, so the peak can be checked against shard + one parameter. LAYERS overrides the preset's.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "bmt/init.h"
#include "bmt/parameter.h"
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: init_memory_tool PRESET [gpt|llama] [fp32|bf16] [LAYERS]\n");
    return 2;
  }
  bmt::InitOptions init;
  init.quiet = true;
  bmt::init_distributed(init);
  examples::ModelConfig c = examples::find_preset(argv[1]).model;
  c.arch = argc > 2 ? argv[2] : "gpt";
  const at::ScalarType dtype = argc > 3 && std::string(argv[3]) == "bf16" ? at::kBFloat16 : at::kFloat;
  if (argc > 4) c.num_layers = std::atoll(argv[4]);
  const int64_t rss_before = status_kib("VmRSS:");
  auto model = examples::make_model(c, {}, dtype);
  const int64_t hwm_built = status_kib("VmHWM:");
  int64_t shard_nbytes = 0, largest_nbytes = 0;
  for (const auto& p : model->parameters()) {
    shard_nbytes += p.numel() * static_cast<int64_t>(p.element_size());
    int64_t n = static_cast<int64_t>(p.element_size());
    for (int64_t d : bmt::meta_of(p).logical_shape()) n *= d;
    largest_nbytes = std::max(largest_nbytes, n);
  }
  at::manual_seed(1);
  bmt::init_parameters(*model);
  const int64_t hwm_init = status_kib("VmHWM:");
  const double mib = 1024.0;
  std::printf("rank %d: %s %s, %.1fM params: rss before build %.0f MiB, peak after build %.0f MiB, peak after init "
              "%.0f MiB; shard %.0f MiB + largest parameter %.0f MiB\n",
              bmt::config().rank, c.describe().c_str(), c10::toString(dtype), model->num_params() / 1e6,
              rss_before / mib, hwm_built / mib, hwm_init / mib, shard_nbytes / 1048576.0, largest_nbytes / 1048576.0);
  std::fflush(stdout);
  bmt::finalize();
  return 0;
}
