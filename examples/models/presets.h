// Named model shapes and their training defaults.
//
//   tiny        L2  d64   h4  ff256   seq 64    trains in ~minutes on 2 CPU cores (vocab from the data)
//   gpt2-124m   L12 d768  h12 ff3072  seq 1024
//   gpt-1.3b    L24 d2048 h16 ff8192  seq 2048
//   llama-7b    L32 d4096 h32 ff11008 seq 2048
// Vocabulary 50304 unless the data says otherwise. The shapes are architecture-neutral: `--model llama` with
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
