#include "models/presets.h"

#include "bmt/core/error.h"
#include "models/preset_shapes.h"

namespace examples {
namespace {

// The sizes come from the one table (preset_shapes.cpp); the trainer sets arch and vocab_size.
ModelConfig shape(const std::string& name) {
  const bmt::ModelShape s = preset_shape(name);
  ModelConfig c;
  c.num_layers = s.layers;
  c.dim = s.hidden;
  c.num_heads = s.heads;
  c.ffn_dim = s.ffn;
  c.max_seq_len = s.max_seq;
  return c;
}

const std::vector<Preset>& all_presets() {
  static const std::vector<Preset> presets = {
      // tiny: tuned so that `bmtrun --nproc 2 train_gpt` learns the embedded arithmetic task in ~2 minutes. The
      // batch is global (64 sequences whatever the world size): at 32 sequences per step the GPT can stay on the
      // "operands only" plateau (loss ~1.40, accuracy ~0) for the whole run.
      {"tiny", shape("tiny"), TrainDefaults{1500, 32, 64, 2e-3, 50, 100}},
      {"gpt2-124m", shape("gpt2-124m"), TrainDefaults{5000, 16, 0, 6e-4, 200, 250}},
      {"gpt-1.3b", shape("gpt-1.3b"), TrainDefaults{5000, 8, 0, 2e-4, 200, 250}},
      // gpt-6.7b: the benchmark's largest model (bmt-bench-train; GPT-3 6.7B's shape and peak learning rate).
      {"gpt-6.7b", shape("gpt-6.7b"), TrainDefaults{5000, 2, 0, 1.2e-4, 200, 250}},
      {"llama-7b", shape("llama-7b"), TrainDefaults{5000, 2, 0, 1.5e-4, 200, 250}},
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
