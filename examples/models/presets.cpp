#include "models/presets.h"

#include "bmt/core/error.h"

namespace examples {
namespace {

ModelConfig shape(int64_t layers, int64_t dim, int64_t heads, int64_t ffn, int64_t seq) {
  ModelConfig c;
  c.num_layers = layers;
  c.dim = dim;
  c.num_heads = heads;
  c.ffn_dim = ffn;
  c.max_seq_len = seq;
  return c;
}

const std::vector<Preset>& all_presets() {
  static const std::vector<Preset> presets = {
      // tiny: tuned so that `bmtrun --nproc 2 train_gpt` learns the embedded arithmetic task in ~2 minutes. The
      // batch is global (64 sequences whatever the world size): at 32 sequences per step the GPT can stay on the
      // "operands only" plateau (loss ~1.40, accuracy ~0) for the whole run.
      {"tiny", shape(2, 64, 4, 256, 64), TrainDefaults{1500, 32, 64, 2e-3, 50, 100}},
      {"gpt2-124m", shape(12, 768, 12, 3072, 1024), TrainDefaults{5000, 16, 0, 6e-4, 200, 250}},
      {"gpt-1.3b", shape(24, 2048, 16, 8192, 2048), TrainDefaults{5000, 8, 0, 2e-4, 200, 250}},
      {"llama-7b", shape(32, 4096, 32, 11008, 2048), TrainDefaults{5000, 2, 0, 1.5e-4, 200, 250}},
  };
  return presets;
}

}  // namespace

const Preset& find_preset(const std::string& name) {
  for (const Preset& p : all_presets())
    if (p.name == name) return p;
  std::string known;
  for (const Preset& p : all_presets()) known += (known.empty() ? "" : ", ") + p.name;
  BMT_ERROR("unknown preset '", name, "' (known: ", known, ")");
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : all_presets()) names.push_back(p.name);
  return names;
}

}  // namespace examples
