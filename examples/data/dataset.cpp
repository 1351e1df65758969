#include "data/dataset.h"

#include "bmt/core/error.h"
#include "data/file_dataset.h"
#include "data/synthetic_addition.h"

namespace examples {

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t mix64(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return mix64(mix64(mix64(mix64(a) ^ b) ^ c) ^ d);
}

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

std::unique_ptr<Dataset> make_dataset(const DataOptions& o) {
  std::string format = o.format;
  if (format == "auto") format = o.path.empty() ? "synthetic" : ends_with(o.path, ".bin") ? "bin" : "text";
  if (format == "synthetic") {
    BMT_CHECK(o.path.empty(), "--data-format synthetic takes no file (got '", o.path, "')");
    return std::make_unique<SyntheticAddition>(o.seed);
  }
  BMT_CHECK(!o.path.empty(), "--data-format ", format, " needs --data PATH");
  if (format == "text") return std::make_unique<FileDataset>(open_byte_file(o.path), o.seed, o.eval_fraction);
  if (format == "bin" || format == "llm.c" || format == "nanoGPT")
    return std::make_unique<FileDataset>(open_token_bin(o.path, format == "bin" ? "auto" : format), o.seed,
                                         o.eval_fraction);
  BMT_ERROR("unknown data format '", format, "' (expected auto, synthetic, text, bin, llm.c or nanoGPT)");
}

}  // namespace examples
