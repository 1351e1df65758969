#include "bmt/checkpoint/safetensors_format_internal.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "bmt/checkpoint/json_internal.h"
#include "bmt/core/error.h"

namespace bmt::checkpoint {

int64_t safetensors_header_nbytes(const uint8_t first8[8], int64_t file_nbytes, const std::string& what) {
  BMT_CHECK(file_nbytes >= 8, what, ": not a safetensors file (", file_nbytes, " bytes, shorter than the 8-byte header "
            "length)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  BMT_CHECK(n <= static_cast<uint64_t>(kSafetensorsMaxHeaderNbytes), what, ": header length ", n,
            " is larger than the limit of ", kSafetensorsMaxHeaderNbytes, " bytes (corrupted or not a safetensors file)");
  BMT_CHECK(static_cast<int64_t>(n) <= file_nbytes - 8, what, ": header length ", n, " runs past the end of the ",
            file_nbytes, "-byte file (truncated?)");
  return static_cast<int64_t>(n);
}

SafetensorsHeader parse_safetensors_json(std::string_view json, int64_t file_nbytes, const std::string& what) {
  SafetensorsHeader h;
  h.data_start_nbytes = 8 + static_cast<int64_t>(json.size());
  BMT_CHECK(h.data_start_nbytes <= file_nbytes, what, ": header runs past the end of the file");
  const int64_t data_nbytes = file_nbytes - h.data_start_nbytes;
  Json root = Json::parse(json, what + " header");
  struct Item {
    TensorInfo info;
    int64_t begin, end;
  };
  std::vector<Item> items;
  for (const auto& kv : root.as_object(what + " header")) {
    const std::string ctx = what + ": tensor \"" + kv.first + "\"";
    if (kv.first == "__metadata__") {
      for (const auto& m : kv.second.as_object(what + ": __metadata__"))
        h.metadata[m.first] = m.second.as_string(what + ": __metadata__." + m.first);
      continue;
    }
    Item it;
    it.info.name = kv.first;
    it.info.dtype = kv.second.at("dtype", ctx).as_string(ctx + ".dtype");
    for (const Json& d : kv.second.at("shape", ctx).as_array(ctx + ".shape")) it.info.shape.push_back(d.as_int(ctx + ".shape"));
    const auto& off = kv.second.at("data_offsets", ctx).as_array(ctx + ".data_offsets");
    BMT_CHECK(off.size() == 2, ctx, ": data_offsets must have 2 entries, has ", off.size());
    it.begin = off[0].as_int(ctx + ".data_offsets");
    it.end = off[1].as_int(ctx + ".data_offsets");
    BMT_CHECK(0 <= it.begin && it.begin <= it.end && it.end <= data_nbytes, ctx, ": data_offsets [", it.begin, ", ",
              it.end, "] outside the ", data_nbytes, "-byte data buffer (truncated or corrupted file)");
    const int64_t want = checked_nbytes(it.info.dtype, it.info.shape, ctx);
    BMT_CHECK(it.end - it.begin == want, ctx, ": ", it.info.dtype, " ", shape_string(it.info.shape), " needs ", want,
              " bytes but data_offsets span ", it.end - it.begin);
    items.push_back(std::move(it));
  }
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return items[a].begin != items[b].begin ? items[a].begin < items[b].begin : items[a].end < items[b].end;
  });
  int64_t expect = 0;
  for (size_t i : order) {
    BMT_CHECK(items[i].begin == expect, what, ": tensor \"", items[i].info.name, "\" starts at data offset ",
              items[i].begin, " but the previous tensor ends at ", expect, " (overlapping or non-contiguous data)");
    expect = items[i].end;
    h.data_offsets.push_back(items[i].begin);
    h.tensors.push_back(std::move(items[i].info));
  }
  BMT_CHECK(expect == data_nbytes, what, ": tensors cover ", expect, " data bytes but the file holds ", data_nbytes,
            " (truncated file or trailing garbage)");
  return h;
}

SafetensorsHeader parse_safetensors_prefix(const uint8_t* data, size_t nbytes, int64_t file_nbytes,
                                           const std::string& what) {
  BMT_CHECK(nbytes >= 8 || static_cast<int64_t>(nbytes) >= file_nbytes, what, ": need the first 8 bytes");
  BMT_CHECK(file_nbytes >= 8, what, ": not a safetensors file (", file_nbytes, " bytes)");
  const int64_t n = safetensors_header_nbytes(data, file_nbytes, what);
  BMT_CHECK(static_cast<int64_t>(nbytes) - 8 >= n, what, ": buffer holds ", nbytes, " bytes, header needs ", 8 + n);
  return parse_safetensors_json(std::string_view(reinterpret_cast<const char*>(data) + 8, static_cast<size_t>(n)),
                                file_nbytes, what);
}

std::string build_safetensors_header(const std::vector<TensorInfo>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  Json root = Json::object();
  if (!metadata.empty()) {
    Json m = Json::object();
    for (const auto& kv : metadata) m.set(kv.first, kv.second);
    root.set("__metadata__", std::move(m));
  }
  int64_t offset = 0;
  std::set<std::string> names;
  for (const TensorInfo& t : tensors) {
    BMT_CHECK(t.name != "__metadata__", "a tensor cannot be named __metadata__ in a safetensors file");
    BMT_CHECK(names.insert(t.name).second, "duplicate tensor name \"", t.name, "\" in a safetensors file");
    const int64_t nbytes = checked_nbytes(t.dtype, t.shape, "safetensors tensor \"" + t.name + "\"");
    Json shape = Json::array();
    for (int64_t d : t.shape) shape.push_back(d);
    Json entry = Json::object();
    entry.set("dtype", t.dtype);
    entry.set("shape", std::move(shape));
    entry.set("data_offsets", Json::array({Json(offset), Json(offset + nbytes)}));
    root.append(t.name, std::move(entry));
    offset += nbytes;
  }
  std::string json = root.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + json;
}

}  // namespace bmt::checkpoint
