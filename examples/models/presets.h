// Named model shapes (preset_shapes.h: tiny, gpt2-124m, gpt-1.3b, gpt-6.7b, llama-7b) and their training defaults.
// tiny trains in ~minutes on 2 CPU cores (vocab from the data). Vocabulary 50304 unless the data says otherwise. The shapes are architecture-neutral: `--model llama` with
// `tiny` keeps the sizes (llama presets get num_kv_heads = num_heads unless overridden).
#pragma once

#include <string>
#include <vector>

#include "models/language_model.h"

namespace examples {

struct TrainDefaults {
  int64_t steps = 1000;
  int64_t batch_per_rank = 8;  // sequences per rank per step
  int64_t global_batch = 0;    // > 0: sequences per step over all ranks (batch per rank = global / world instead)
  double lr = 3e-4;            // peak learning rate (cosine decay to 10% after warm-up)
  int64_t warmup_steps = 100;
  int64_t eval_every_steps = 100;
};

struct Preset {
  std::string name;
  ModelConfig model;  // arch "gpt"; the trainer sets arch and vocab_size
  TrainDefaults train;
};

// Throws bmt::core::Error listing the known names when `name` is unknown.
const Preset& find_preset(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace examples
