// Text generation without a KV cache (the whole context is re-run for each new token; fine for samples).
// Collective: every rank must call it with the same arguments; the ranks compute identical tokens (the
// top-k draw uses a generator seeded with `seed`, identical everywhere). With tensor parallelism every rank runs
// the same forward steps and only the last position's vocabulary slices are all-gathered over tp.
#pragma once

#include <vector>

#include "models/language_model.h"

namespace examples {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  int64_t top_k = 0;        // 0: greedy; otherwise sample among the k most likely tokens
  double temperature = 1.0;
  int64_t stop_token = -1;  // stop after emitting it (-1: never)
  uint64_t seed = 0;
  int64_t vocab_size = 0;   // > 0: only ids below it are generated (the model's vocabulary may be padded for tp)
};

// Returns only the new tokens. The context is cropped to the model's max_seq_len.
std::vector<int64_t> generate(LanguageModel& model, const std::vector<int64_t>& prompt, const GenerateOptions& options);

}  // namespace examples
