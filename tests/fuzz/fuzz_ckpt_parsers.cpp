// libFuzzer target for the parsers that read untrusted checkpoint bytes: the safetensors header, the sharded
// checkpoint's metadata file, the JSON parser under both, and the torch.save pickle reader. The first input byte picks the parser, the rest is
// the input. Properties (checked under ASan + UBSan): no crash, no out-of-bounds read, no undefined behaviour;
// malformed input only ever raises bmt::core::Error; whatever parses re-serializes to something that parses to
// the same result (metadata, safetensors header).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "bmt/checkpoint/json_internal.h"
#include "bmt/checkpoint/metadata.h"
#include "bmt/checkpoint/pt_pickle_internal.h"
#include "bmt/checkpoint/safetensors_format_internal.h"
#include "bmt/core/error.h"

using namespace bmt::checkpoint;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

void fuzz_safetensors(const uint8_t* data, size_t size) {
  SafetensorsHeader h = parse_safetensors_prefix(data, size, static_cast<int64_t>(size), "fuzz.safetensors");
  // Rebuilding the header from what was parsed must give a valid file of the same layout.
  std::string header = build_safetensors_header(h.tensors, h.metadata);
  int64_t data_nbytes = 0;
  for (const TensorInfo& t : h.tensors) data_nbytes += checked_nbytes(t.dtype, t.shape, t.name);
  check(data_nbytes == static_cast<int64_t>(size) - h.data_start_nbytes);
  std::string file = header + std::string(static_cast<size_t>(data_nbytes), '\0');
  SafetensorsHeader again = parse_safetensors_prefix(reinterpret_cast<const uint8_t*>(file.data()), file.size(),
                                                     static_cast<int64_t>(file.size()), "again");
  check(again.tensors.size() == h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i)
    check(again.tensors[i].name == h.tensors[i].name && again.tensors[i].shape == h.tensors[i].shape);
}

void fuzz_metadata(const uint8_t* data, size_t size) {
  CheckpointMetadata m = parse_metadata(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.meta");
  const std::string s = serialize_metadata(m);
  CheckpointMetadata again = parse_metadata(s, "again");
  check(serialize_metadata(again) == s);
}

void fuzz_pickle(const uint8_t* data, size_t size) {
  for (const PickledTensor& t : parse_torch_pickle(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.pkl")) {
    check(t.shape.size() == t.strides.size());
    (void)t.is_contiguous();
  }
}

void fuzz_json(const uint8_t* data, size_t size) {
  Json j = Json::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.json");
  const std::string s = j.dump();
  check(Json::parse(s, "again").dump() == s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  try {
    switch (data[0] % 4) {
      case 0: fuzz_safetensors(data + 1, size - 1); break;
      case 1: fuzz_metadata(data + 1, size - 1); break;
      case 2: fuzz_json(data + 1, size - 1); break;
      default: fuzz_pickle(data + 1, size - 1); break;
    }
  } catch (const bmt::core::Error&) {
    // Malformed input, reported as it should be.
  }
  return 0;
}
