#include "models/preset_shapes.h"

#include "bmt/core/error.h"

namespace examples {
namespace {

struct Row {
  const char* name;
  const char* arch;
  int64_t layers, hidden, heads, ffn, max_seq;
};

constexpr Row kPresets[] = {
    {"tiny", "gpt", 2, 64, 4, 256, 64},
    {"gpt2-124m", "gpt", 12, 768, 12, 3072, 1024},
    {"gpt-1.3b", "gpt", 24, 2048, 16, 8192, 2048},
    {"gpt-6.7b", "gpt", 32, 4096, 32, 16384, 2048},
    {"llama-7b", "llama", 32, 4096, 32, 11008, 2048},
};

}  // namespace

bmt::ModelShape preset_shape(const std::string& name) {
  for (const Row& r : kPresets) {
    if (name != r.name) continue;
    bmt::ModelShape m;
    m.arch = r.arch;
    m.layers = r.layers;
    m.hidden = r.hidden;
    m.heads = r.heads;
    m.ffn = r.ffn;
    m.max_seq = r.max_seq;
    return m;
  }
  std::string known;
  for (const auto& n : preset_shape_names()) known += (known.empty() ? "" : ", ") + n;
  BMT_ERROR("unknown preset '", name, "' (known: ", known,
            "); or describe the model by its shape (layers, hidden, heads, ffn, vocab)");
}

std::vector<std::string> preset_shape_names() {
  std::vector<std::string> names;
  for (const Row& r : kPresets) names.emplace_back(r.name);
  return names;
}

}  // namespace examples
